package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// With an hour between polls, a relay that has gone idle publishes a newly
// committed message promptly: only the notification can have woken it.
func TestRelayNotifyWakesIdleRelay(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	rec := &recorder{}
	published := make(chan struct{}, 10)
	r := newTestRelay(t, d.Pool, PublisherFunc(func(ctx context.Context, e Envelope) error {
		err := rec.publish(ctx, e)
		published <- struct{}{} // after recording, so the test sees what it waited for
		return err
	}), Config{PollInterval: time.Hour})
	idle := idleSignal(r)
	start(t, r)
	waitIdle(t, idle, true)

	enqueue(t, d.Pool, Message{Topic: "t", Payload: []byte("wake up")})
	select {
	case <-published:
	case <-time.After(20 * time.Second):
		t.Fatal("message not published: the notification did not wake the relay")
	}
	require.Equal(t, []string{"wake up"}, rec.payloads())
}

// With notifications disabled (as behind a transaction-pooling PgBouncer),
// polling delivers a message committed while the relay was idle.
func TestRelayPollsWithoutNotify(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	rec := &recorder{}
	r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{DisableNotify: true, PollInterval: 20 * time.Millisecond})
	idle := idleSignal(r)
	start(t, r)
	waitIdle(t, idle, false)
	require.False(t, r.listening.Load())

	enqueue(t, d.Pool, Message{Topic: "t", Payload: []byte("polled")})
	eventually(t, func() bool { return len(rec.published()) == 1 })
}

// When the listening connection dies, the relay reconnects and notifications
// wake it again.
func TestRelayListenerReconnects(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	app := "relay_" + uniqueName()
	pool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
	rec := &recorder{}
	r := newTestRelay(t, pool, PublisherFunc(rec.publish), Config{PollInterval: time.Hour})
	idle := idleSignal(r)
	start(t, r)
	waitIdle(t, idle, true)

	listenerPID := func() int {
		var pid int
		err := d.Pool.QueryRow(context.Background(), `SELECT coalesce(max(pid), 0) FROM pg_stat_activity
			WHERE application_name = $1 AND query LIKE 'LISTEN %'`, app).Scan(&pid)
		require.NoError(t, err)
		return pid
	}
	old := listenerPID()
	require.NotZero(t, old)
	_, err := d.Pool.Exec(context.Background(), "SELECT pg_terminate_backend($1)", old)
	require.NoError(t, err)
	// The listener is up again once a new connection listens and the flag
	// is set (after that connection's LISTEN returned).
	eventually(t, func() bool { p := listenerPID(); return p != 0 && p != old && r.listening.Load() })
	// The loop may already have reported going idle on the new connection,
	// and a report from before the reconnection may be queued: forget them
	// all and wake the loop once more, so that the next ready report comes
	// from after the reconnection. (Draining alone could swallow the only
	// report to come: the test then waited for a report that never came.)
	for len(idle) > 0 {
		<-idle
	}
	r.signal()
	waitIdle(t, idle, true)

	enqueue(t, d.Pool, Message{Topic: "t", Payload: []byte("after reconnect")})
	eventually(t, func() bool { return len(rec.published()) == 1 })
}
