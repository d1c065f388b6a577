package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// One batch carries a busy key's run of messages, published in id order; a
// failure stops that key for the rest of the batch, leaving its later
// messages untouched, while other keys go on. The next batch resumes the key
// with the failed message.
func TestRelayStopsKeyAtFirstFailure(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	for i := 1; i <= 5; i++ {
		enqueue(t, d.Pool,
			Message{Topic: "t", OrderingKey: "a", Payload: fmt.Appendf(nil, "a%d", i)},
			Message{Topic: "t", OrderingKey: "b", Payload: fmt.Appendf(nil, "b%d", i)})
	}
	var failedOnce atomic.Bool
	rec := &recorder{fail: func(e Envelope) error {
		if string(e.Payload) == "a3" && failedOnce.CompareAndSwap(false, true) {
			return errors.New("broker hiccup")
		}
		return nil
	}}
	r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{RetryBaseDelay: time.Millisecond, RetryMaxDelay: time.Millisecond})

	n, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 7, n, "a1 a2 and b1..b5 in one batch")
	require.Equal(t, []string{"a1", "b1", "a2", "b2", "b3", "b4", "b5"}, rec.payloads())
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE payload = 'a3' AND attempts = 1 AND last_error = 'broker hiccup'"))
	require.Equal(t, 2, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE payload IN ('a4', 'a5') AND attempts = 0"))

	eventually(t, func() bool {
		_, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		return len(rec.published()) == 10
	})
	require.Equal(t, []string{"a3", "a4", "a5"}, rec.payloads()[7:])
}

// A publisher that fails three times and then succeeds: the message is
// retried after growing delays (the relay's own scheduling, read from its
// log and from available_at) and published exactly once. The relay polls
// only hourly here, so the retries also prove it wakes when a retry is due.
func TestRelayRetriesWithGrowingDelays(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool, Message{Topic: "t", OrderingKey: "k", Payload: []byte("flaky")})

	var (
		mu          sync.Mutex
		attempts    []int
		availableAt []time.Time
		errs        []error
	)
	logger, logs := newTestLogger(t)
	base := 40 * time.Millisecond
	rec := &recorder{}
	r := newTestRelay(t, d.Pool, PublisherFunc(func(ctx context.Context, e Envelope) error {
		mu.Lock()
		defer mu.Unlock()
		attempts = append(attempts, e.Attempt)
		if e.Attempt > 1 {
			var at time.Time
			err := d.Pool.QueryRow(ctx, "SELECT available_at FROM outbox_messages WHERE id = $1", e.ID).Scan(&at)
			errs = append(errs, err)
			availableAt = append(availableAt, at)
		}
		if e.Attempt <= 3 {
			return fmt.Errorf("unavailable (attempt %d)", e.Attempt)
		}
		return rec.publish(ctx, e)
	}), Config{Logger: logger, PollInterval: time.Hour, RetryBaseDelay: base, RetryMaxDelay: time.Minute})
	start(t, r)

	eventually(t, func() bool { return len(rec.published()) == 1 })
	r.Stop()
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int{1, 2, 3, 4}, attempts)
	require.Equal(t, []error{nil, nil, nil}, errs)
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NOT NULL AND attempts = 4"))

	delays := logs.attrs("outbox: publish failed; will retry", "retry_in")
	require.Len(t, delays, 3)
	for i, v := range delays {
		full := base << i
		got := v.Duration()
		require.GreaterOrEqual(t, got, full/2, "attempt %d", i+1)
		require.LessOrEqual(t, got, full, "attempt %d", i+1)
		if i > 0 {
			require.GreaterOrEqual(t, got, delays[i-1].Duration(), "delays never shrink")
		}
	}
	require.Len(t, availableAt, 3)
	require.True(t, availableAt[0].Before(availableAt[1]) && availableAt[1].Before(availableAt[2]))
	stats, err := r.Stats(context.Background())
	require.NoError(t, err)
	require.Equal(t, Stats{Published: 1, Retried: 3}, stats)
}

// A message that always fails is dead-lettered after MaxAttempts, kept with
// its last error. Its ordering key's later messages are held back while it
// is retried and released once it is dead; messages without an ordering key
// and of other keys are never held back.
func TestRelayDeadLettersAndReleasesKey(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool,
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("poison")},
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("k2")},
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("k3")},
		Message{Topic: "t", Payload: []byte("unordered")},
		Message{Topic: "t", OrderingKey: "j", Payload: []byte("j1")},
	)
	var poisonDeadWhenReleased []bool // read by the test after the relay ran
	rec := &recorder{fail: func(e Envelope) error {
		switch string(e.Payload) {
		case "poison":
			return errors.New("boom")
		case "k2", "k3":
			var dead bool
			err := d.Pool.QueryRow(context.Background(),
				"SELECT dead_at IS NOT NULL FROM outbox_messages WHERE payload = 'poison'").Scan(&dead)
			poisonDeadWhenReleased = append(poisonDeadWhenReleased, err == nil && dead)
		}
		return nil
	}}
	r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{MaxAttempts: 3})

	n, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.ElementsMatch(t, []string{"unordered", "j1"}, rec.payloads(), "not held back by the failing key")

	eventually(t, func() bool {
		_, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		return len(rec.published()) == 4
	})
	require.Equal(t, []string{"k2", "k3"}, rec.payloads()[2:])
	require.Equal(t, []bool{true, true}, poisonDeadWhenReleased, "held back until the poison was dead")
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE payload = 'poison'
		AND attempts = 3 AND dead_at IS NOT NULL AND published_at IS NULL AND last_error = 'boom'`))
	stats, err := r.Stats(context.Background())
	require.NoError(t, err)
	require.Equal(t, Stats{Published: 4, Retried: 2, Dead: 1}, stats)
}

// A permanent failure dead-letters at once, without retries.
func TestRelayPermanentErrorDeadLettersAtOnce(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool, Message{Topic: "t", Payload: []byte("rejected")})
	r := newTestRelay(t, d.Pool, PublisherFunc(func(context.Context, Envelope) error {
		return Permanent(errors.New("receiver said no"))
	}), Config{})
	n, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, n)
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages
		WHERE attempts = 1 AND dead_at IS NOT NULL AND last_error = 'permanent: receiver said no'`))
	require.Zero(t, drain(t, r))
}

// Cancelling a batch mid-publish (the relay stopping) keeps what was
// acknowledged: it is marked published. The rest is left as it was, without
// an attempt counted, for the next run.
func TestRelayCancelMidBatchKeepsAcknowledged(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool,
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("first")},
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("second")},
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("third")})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r := newTestRelay(t, d.Pool, PublisherFunc(func(ctx context.Context, e Envelope) error {
		if string(e.Payload) == "second" {
			cancel()
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}), Config{})
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE payload = 'first' AND published_at IS NOT NULL"))
	require.Equal(t, 2, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NULL AND attempts = 0 AND last_error IS NULL"))
}

// A publisher that ignores its context cannot hold the claim transaction
// open past PublishTimeout: the relay stops waiting, counts a failed
// attempt and commits.
func TestRelayPublishTimeoutBoundsHungPublisher(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool, Message{Topic: "t", Payload: []byte("stuck")})
	release := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	t.Cleanup(func() { close(release); wg.Wait() })
	r := newTestRelay(t, d.Pool, PublisherFunc(func(context.Context, Envelope) error {
		defer wg.Done()
		<-release // ignores ctx
		return nil
	}), Config{PublishTimeout: 2 * time.Second})
	n, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, n)
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages
		WHERE attempts = 1 AND published_at IS NULL AND last_error LIKE '%deadline exceeded%'`))
}

// A panicking publisher fails its messages instead of the relay.
func TestRelayPublisherPanicIsAFailure(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool, Message{Topic: "t"})
	r := newTestRelay(t, d.Pool, PublisherFunc(func(context.Context, Envelope) error { panic("oops") }), Config{})
	_, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE attempts = 1 AND last_error LIKE '%panicked: oops%'"))
}

// backoff doubles from the base, is capped, never shrinks from one attempt
// to the next, and survives huge attempt numbers.
func TestBackoff(t *testing.T) {
	t.Parallel()
	r := &Relay{cfg: Config{RetryBaseDelay: time.Second, RetryMaxDelay: time.Minute}}
	prevMax := time.Duration(0)
	for attempt := 1; attempt <= 100; attempt++ {
		full := min(time.Second<<min(attempt-1, 20), time.Minute)
		for range 50 {
			d := r.backoff(attempt)
			require.GreaterOrEqual(t, d, full/2)
			require.LessOrEqual(t, d, full)
			require.GreaterOrEqual(t, d, prevMax/2)
		}
		prevMax = full
	}
	require.True(t, strings.HasPrefix(errorText(errors.New(strings.Repeat("é", 2000))), "é"))
	require.LessOrEqual(t, len(errorText(errors.New(strings.Repeat("é", 2000)))), maxErrorBytes)
	require.Equal(t, "ab\uFFFD", errorText(errors.New("a\x00b\xff")))
}
