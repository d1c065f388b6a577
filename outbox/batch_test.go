package outbox

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/backoff"
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
			err := d.Pool.QueryRow(ctx, "SELECT available_at FROM outbox_messages WHERE id = $1", e.RowID).Scan(&at)
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

// A destination that is down (a broker outage, a receiver refusing
// connections) is not the message's failure: a publisher reports it with
// Unavailable, the relay retries with backoff without counting an attempt,
// and an outage of any length dead-letters nothing. Here the outage outlasts
// MaxAttempts tries; the message is published when the broker is back.
func TestRelayUnavailableDestinationSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool, Message{Topic: "t", OrderingKey: "k", Payload: []byte("k1")},
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("k2")})
	var down atomic.Bool
	down.Store(true)
	var tries atomic.Int64
	rec := &recorder{fail: func(e Envelope) error {
		if down.Load() {
			tries.Add(1)
			return Unavailable(errors.New("nats: connection closed"))
		}
		return nil
	}}
	r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish),
		Config{MaxAttempts: 2, RetryBaseDelay: time.Millisecond, RetryMaxDelay: time.Millisecond})
	eventually(t, func() bool {
		_, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		return tries.Load() >= 5
	})
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE payload = 'k1'
		AND attempts = 0 AND dead_at IS NULL AND published_at IS NULL AND last_error LIKE '%connection closed%'`),
		"no attempt counted, not dead-lettered, the error kept")
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE payload = 'k2' AND attempts = 0`),
		"its key held back behind it")

	down.Store(false)
	eventually(t, func() bool {
		_, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		return len(rec.published()) == 2
	})
	require.Equal(t, []string{"k1", "k2"}, rec.payloads()[len(rec.payloads())-2:])
	require.Zero(t, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL`))
	stats, err := r.Stats(context.Background())
	require.NoError(t, err)
	require.Zero(t, stats.Dead)
	require.Equal(t, uint64(2), stats.Published)
	require.GreaterOrEqual(t, stats.Unavailable, uint64(5))
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

// Cancelling RunOnce's context mid-wave (the relay stopping) sends no
// further message, lets the one in flight finish, and keeps every
// acknowledgement: first and second are marked published. The rest, unsent,
// is left as it was, without an attempt counted, for the next run.
func TestRelayCancelMidWaveKeepsAcknowledgedAndSendsNoMore(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool,
		Message{Topic: "t", Payload: []byte("first")},
		Message{Topic: "t", Payload: []byte("second")},
		Message{Topic: "t", Payload: []byte("third")},
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("k1")},
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("k2")})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rec := &recorder{}
	r := newTestRelay(t, d.Pool, PublisherFunc(func(ctx context.Context, e Envelope) error {
		if string(e.Payload) == "second" {
			cancel() // the relay stops while second is in flight
		}
		return rec.publish(ctx, e)
	}), Config{})
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, []string{"first", "second"}, rec.payloads())
	require.Equal(t, 2, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NOT NULL AND attempts = 1"))
	require.Equal(t, 3, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NULL AND attempts = 0 AND last_error IS NULL"))
}

// Each message of a wave keeps its own outcome. One message's publish hangs
// until the deadline, every time: it is dead-lettered after MaxAttempts, and
// its key's next message waits behind it and goes out once it is dead. The
// other messages, acknowledged while it hung, are marked published after one
// attempt and delivered once; the next wave, not sent before the deadline,
// waits for the next batch without an attempt counted. No message is
// charged for the slow one.
func TestRelaySlowMessageCostsOthersNothing(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool,
		Message{Topic: "t", Payload: []byte("fast")},
		Message{Topic: "t", OrderingKey: "s", Payload: []byte("slow")},
		Message{Topic: "t", OrderingKey: "s", Payload: []byte("after-slow")},
		Message{Topic: "t", OrderingKey: "b", Payload: []byte("b1")},
		Message{Topic: "t", OrderingKey: "b", Payload: []byte("b2")})
	pub := &concurrentPublisher{hang: map[string]bool{"slow": true}}
	r := newTestRelay(t, d.Pool, pub, Config{MaxAttempts: 3, PublishTimeout: 2 * time.Second})

	n, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, n, "fast and b1, acknowledged while slow hung until the deadline")
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE payload = 'slow' AND attempts = 1 AND published_at IS NULL"))
	// The wave ended at the deadline: b2, in the next wave, was not sent.
	require.Equal(t, 2, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE payload IN ('b2', 'after-slow') AND attempts = 0"))
	eventually(t, func() bool {
		_, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		return d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NULL AND dead_at IS NULL") == 0
	})
	require.Equal(t, map[string]int{"fast": 1, "b1": 1, "b2": 1, "slow": 3, "after-slow": 1}, pub.sent())
	require.Equal(t, 4, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NOT NULL AND attempts = 1"))
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE payload = 'slow'
		AND attempts = 3 AND dead_at IS NOT NULL AND last_error LIKE '%deadline exceeded%'`))
}

// concurrentPublisher publishes each message of a call on its own
// goroutine, acknowledging at once, except the payloads in hang, which it
// holds until ctx's deadline and then fails. It counts what it sent.
type concurrentPublisher struct {
	hang  map[string]bool
	mu    sync.Mutex
	count map[string]int
}

func (p *concurrentPublisher) Publish(ctx context.Context, msgs []Envelope, res *Results) {
	var wg sync.WaitGroup
	for i := range msgs {
		wg.Go(func() {
			payload := string(msgs[i].Payload)
			p.mu.Lock()
			if p.count == nil {
				p.count = make(map[string]int)
			}
			p.count[payload]++
			p.mu.Unlock()
			if p.hang[payload] {
				<-ctx.Done()
				res.Set(i, ctx.Err())
				return
			}
			res.Set(i, nil)
		})
	}
	wg.Wait()
}

func (p *concurrentPublisher) sent() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.count)
}

// Two relays drain 20,000 messages while one of them is stopped gracefully
// three times, mid-wave, and restarted. Every message is delivered exactly
// once: a stop sends no further message and records every acknowledgement,
// so it adds no duplicate.
func TestRelayGracefulStopsDuringDrainDeliverNothingTwice(t *testing.T) {
	t.Parallel()
	const total = 20000
	d := pgtest.New(t)
	_, err := d.Pool.Exec(context.Background(), `INSERT INTO outbox_messages (topic, ordering_key, payload)
		SELECT 't', CASE WHEN i % 4 = 0 THEN 'key-' || (i % 97) END, convert_to(i::text, 'UTF8')
		FROM generate_series(1, $1) AS i`, total)
	require.NoError(t, err)

	var mu sync.Mutex
	deliveries := make(map[uuid.UUID]int, total)
	deliver := func(e Envelope) {
		mu.Lock()
		deliveries[e.ID]++
		mu.Unlock()
	}
	stopping := &stoppingPublisher{deliver: deliver, trigger: make(chan struct{}), every: 2500}
	other := newTestRelay(t, d.Pool, PublisherFunc(func(_ context.Context, e Envelope) error {
		deliver(e)
		return nil
	}), Config{PollInterval: 10 * time.Millisecond})
	start(t, other)
	r := newTestRelay(t, d.Pool, stopping, Config{PollInterval: 10 * time.Millisecond})
	require.NoError(t, r.Start(context.Background()))
	for range 3 {
		select {
		case <-stopping.trigger:
		case <-time.After(time.Minute):
			t.Fatal("the stopping relay delivered too little")
		}
		r.Stop()
		require.NoError(t, r.Start(context.Background()))
	}
	eventually(t, func() bool {
		return d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NULL") == 0
	})
	r.Stop()
	other.Stop()

	mu.Lock()
	defer mu.Unlock()
	require.Len(t, deliveries, total)
	duplicates := 0
	for _, n := range deliveries {
		duplicates += n - 1
	}
	require.Zero(t, duplicates, "duplicate deliveries")
	require.Equal(t, 3, stopping.stops)
	require.Equal(t, total, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE attempts = 1"))
}

// stoppingPublisher delivers each message of a call in turn. Three times,
// every 'every' deliveries, it asks the test to stop its relay (on trigger)
// while messages of the call are left, and holds the message in flight
// until the stop has begun.
type stoppingPublisher struct {
	deliver   func(Envelope)
	trigger   chan struct{}
	every     int
	delivered int
	stops     int
}

func (p *stoppingPublisher) Publish(_ context.Context, msgs []Envelope, res *Results) {
	for i := range msgs {
		select {
		case <-res.Stopping():
			res.Set(i, ErrNotSent)
			continue
		default:
		}
		p.deliver(msgs[i])
		if p.delivered++; p.delivered >= (p.stops+1)*p.every && p.stops < 3 && i < len(msgs)-1 {
			p.stops++
			p.trigger <- struct{}{}
			<-res.Stopping()
		}
		res.Set(i, nil)
	}
}

// A publisher that ignores its context and never returns cannot hold the
// claim transaction open past PublishTimeout: the relay stops waiting,
// keeps the acknowledgement that came before, counts a failed attempt for
// the message without an outcome, and commits.
func TestRelayPublishTimeoutBoundsHungPublisher(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool, Message{Topic: "t", Payload: []byte("done")}, Message{Topic: "t", Payload: []byte("stuck")})
	release := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	t.Cleanup(func() { close(release); wg.Wait() })
	r := newTestRelay(t, d.Pool, hungPublisher(func(_ context.Context, msgs []Envelope, res *Results) {
		defer wg.Done()
		res.Set(0, nil)
		<-release // ignores ctx
	}), Config{PublishTimeout: 2 * time.Second})
	began := time.Now()
	n, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Less(t, time.Since(began), 2*time.Second+500*time.Millisecond, "bounded by PublishTimeout")
	require.Equal(t, 1, n)
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages
		WHERE payload = 'done' AND attempts = 1 AND published_at IS NOT NULL`))
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages
		WHERE payload = 'stuck' AND attempts = 1 AND published_at IS NULL AND last_error LIKE '%deadline exceeded%'`))
}

type hungPublisher func(ctx context.Context, msgs []Envelope, res *Results)

func (f hungPublisher) Publish(ctx context.Context, msgs []Envelope, res *Results) { f(ctx, msgs, res) }

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
// A failed message waits RetryBaseDelay doubled per earlier failure, capped
// at RetryMaxDelay, with equal jitter; failed batches and listener
// reconnects wait 100 ms doubling to 30 s, without jitter.
func TestRelayBackoffPolicies(t *testing.T) {
	t.Parallel()
	r, err := New(pgtest.Pool(t), PublisherFunc((&recorder{}).publish),
		&Config{RetryBaseDelay: time.Second, RetryMaxDelay: time.Minute})
	require.NoError(t, err)
	require.Equal(t, backoff.Policy{Base: time.Second, Max: time.Minute, Jitter: backoff.Equal}, r.retry)
	for attempt := 1; attempt <= 100; attempt++ {
		full := min(time.Second<<min(attempt-1, 20), time.Minute)
		for range 50 {
			d := r.retry.Delay(attempt - 1)
			require.GreaterOrEqual(t, d, full/2)
			require.LessOrEqual(t, d, full)
		}
	}
	require.Equal(t, backoff.Policy{Base: 100 * time.Millisecond, Max: 30 * time.Second, Jitter: backoff.None}, loopErrorBackoff)
	require.Equal(t, backoff.Policy{Base: 100 * time.Millisecond, Max: 30 * time.Second, Jitter: backoff.None}, listenBackoff)
}

func TestErrorTextIsStorable(t *testing.T) {
	t.Parallel()
	require.True(t, strings.HasPrefix(errorText(errors.New(strings.Repeat("é", 2000))), "é"))
	require.LessOrEqual(t, len(errorText(errors.New(strings.Repeat("é", 2000)))), maxErrorBytes)
	require.Equal(t, "ab\uFFFD", errorText(errors.New("a\x00b\xff")))
}
