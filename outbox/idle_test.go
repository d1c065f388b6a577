package outbox

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// firstNotification listens on NotifyChannel on a connection of its own,
// runs commit (which commits a transaction that may notify), then sends a
// probe notification, and returns the payload of the first notification for
// schema or the probe: "probe" means commit notified nothing. Notifications
// of distinct transactions arrive in commit order, so no waiting is needed to
// show that none came.
func firstNotification(t *testing.T, d *pgtest.DB, commit func()) string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, d.ConnString(t))
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{NotifyChannel}.Sanitize())
	require.NoError(t, err)
	commit()
	probe := "probe-" + uniqueName()
	_, err = d.Pool.Exec(ctx, "SELECT pg_notify($1, $2)", NotifyChannel, probe)
	require.NoError(t, err)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for {
		n, err := conn.WaitForNotification(wctx)
		require.NoError(t, err)
		switch n.Payload {
		case probe:
			return "probe"
		case d.Schema:
			return n.Payload
		}
	}
}

// With no relay idle, a committing producer sends no notification: NOTIFY
// takes a database-wide lock at commit, and a busy relay, or none, has no use
// for it.
func TestEnqueueDoesNotNotifyWhileNoRelayIsIdle(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	got := firstNotification(t, d, func() { enqueue(t, d.Pool, Message{Topic: "t", Payload: []byte("quiet")}) })
	require.Equal(t, "probe", got, "Enqueue notified although no relay was waiting")
}

// With a relay idle and listening, a committing producer notifies it.
func TestEnqueueNotifiesWhileARelayIsIdle(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	rec := &recorder{}
	r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{PollInterval: time.Hour})
	idle := idleSignal(r)
	start(t, r)
	waitIdle(t, idle, true)
	got := firstNotification(t, d, func() { enqueue(t, d.Pool, Message{Topic: "t", Payload: []byte("loud")}) })
	require.Equal(t, d.Schema, got, "Enqueue did not notify the idle relay")
	eventually(t, func() bool { return len(rec.published()) == 1 })
}

// The race a conditional notification must not lose: a producer commits,
// without notifying, after the relay's last batch found nothing and before
// the relay announced it is idle. The relay re-checks after announcing it, so
// the message is published at once; with an hour between polls nothing else
// could publish it. The second case holds the producer's transaction open
// across the announcement (shorter and longer than the relay's lock wait).
func TestMessageCommittedAsTheRelayGoesIdleIsPublishedWithoutAPoll(t *testing.T) {
	t.Parallel()
	for _, hold := range []time.Duration{0, 50 * time.Millisecond, 3 * idleLockWait} {
		t.Run(fmt.Sprintf("held_%v", hold), func(t *testing.T) {
			t.Parallel()
			d := pgtest.New(t)
			rec := &recorder{}
			r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{PollInterval: time.Hour})
			var once sync.Once
			committed := make(chan struct{})
			r.testHookBeforeIdle = func() {
				if !r.listening.Load() {
					return // the first batches run before the listener is up
				}
				once.Do(func() {
					ctx := context.Background()
					tx, err := d.Pool.Begin(ctx)
					if err != nil {
						panic(err)
					}
					if err := Enqueue(ctx, tx, Message{Topic: "t", Payload: []byte("raced")}); err != nil {
						panic(err)
					}
					go func() {
						defer close(committed)
						time.Sleep(hold)
						if err := tx.Commit(ctx); err != nil {
							panic(err)
						}
					}()
					if hold == 0 {
						<-committed
					}
				})
			}
			start(t, r)
			select {
			case <-committed:
			case <-time.After(20 * time.Second):
				t.Fatal("the hook never ran")
			}
			deadline := time.Now().Add(10 * time.Second)
			for len(rec.published()) == 0 {
				require.False(t, time.Now().After(deadline), "message committed as the relay went idle was not published")
				time.Sleep(5 * time.Millisecond)
			}
			require.Equal(t, []string{"raced"}, rec.payloads())
		})
	}
}

// Several relays on one table, an hour between polls, producers committing
// at random moments: every message is published promptly, whichever relay is
// idle, busy, or waiting to announce it is idle when it commits.
func TestRelaysPublishEveryMessagePromptlyWithoutPolling(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	rec := &recorder{}
	for range 3 {
		start(t, newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{PollInterval: time.Hour}))
	}
	const producers, each = 4, 40
	var wg sync.WaitGroup
	for p := range producers {
		wg.Go(func() {
			for i := range each {
				time.Sleep(time.Duration(rand.IntN(15)) * time.Millisecond)
				enqueue(t, d.Pool, Message{Topic: "t", Payload: fmt.Appendf(nil, "%d-%d", p, i)})
			}
		})
	}
	wg.Wait()
	// The last message was committed now; with an hour between polls, only
	// a notification or a busy relay's next batch can publish it.
	deadline := time.Now().Add(10 * time.Second)
	for len(rec.published()) < producers*each {
		require.False(t, time.Now().After(deadline), "published %d of %d messages", len(rec.published()), producers*each)
		time.Sleep(5 * time.Millisecond)
	}
	require.Len(t, rec.published(), producers*each)
}

// Wake wakes a relay in this process at once: with notifications off and an
// hour between polls, nothing else would.
func TestRelayWakePublishesWithoutNotifyOrPoll(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	rec := &recorder{}
	r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{PollInterval: time.Hour, DisableNotify: true})
	idle := idleSignal(r)
	start(t, r)
	waitIdle(t, idle, false)
	enqueue(t, d.Pool, Message{Topic: "t", Payload: []byte("woken")})
	r.Wake()
	eventually(t, func() bool { return len(rec.published()) == 1 })
	require.Equal(t, []string{"woken"}, rec.payloads())
}
