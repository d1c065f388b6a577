package outbox

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// signal wakes the loop, or leaves a wake-up pending if it is busy.
func (r *Relay) signal() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// listen keeps a LISTEN connection open and turns notifications for this
// relay's schema into wake-ups, reconnecting with backoff when it fails.
// While it is down, the loop's polling delivers.
func (r *Relay) listen(ctx context.Context) {
	failures := 0 // consecutive failures without listening in between
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		connected, err := r.listenOnce(ctx)
		r.listening.Store(false)
		// A loop waiting announced idle would have producers notify a
		// relay that no longer listens: wake it, so it leaves that state.
		r.signal()
		if ctx.Err() != nil {
			return
		}
		if connected {
			failures = 0
		}
		delay := listenBackoff.Delay(failures)
		failures++
		r.log.Warn("outbox: relay listener failed; polling until it reconnects",
			"error", err, "retry_in", delay)
		timer.Reset(delay)
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
	}
}

// listenOnce runs one listening connection until it fails or ctx is done.
func (r *Relay) listenOnce(ctx context.Context) (connected bool, err error) {
	pc, err := r.pool.Acquire(ctx)
	if err != nil {
		return false, err
	}
	// The connection leaves the pool: it stays in LISTEN state and is
	// closed, never reused, when the listener ends.
	conn := pc.Hijack()
	defer closeConn(conn)
	var schema string
	if err := conn.QueryRow(ctx, "SELECT coalesce(current_schema(), '')").Scan(&schema); err != nil {
		return false, err
	}
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{NotifyChannel}.Sanitize()); err != nil {
		return false, err
	}
	// Messages committed while no one was listening are found by this
	// wake-up; the flag is set after it, so a loop that sees the flag and
	// no pending wake-up has already run a batch since listening began.
	r.signal()
	r.listening.Store(true)
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return true, err
		}
		if n.Channel == NotifyChannel && (n.Payload == schema || n.Payload == "") {
			r.signal()
		}
	}
}
