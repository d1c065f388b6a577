package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/pgerr"
)

// idleLockClass is the first half of the relays' idle lock's name ("apoi");
// the second is the outbox_messages table's oid.
const idleLockClass int32 = 0x61706f69

// idleLockWait bounds how long a relay waits for producers in flight to
// end before it announces it is idle. A producer holds the lock shared from
// its Enqueue to its commit; a longer transaction than this leaves the
// relay polling every wakeCooldown until it ends.
const idleLockWait = 200 * time.Millisecond

// Wake wakes r's loop now, as a notification would: call it after
// committing a transaction that enqueued messages, in the process that runs
// the relay, to have them published without waiting for a notification or
// a poll (with DisableNotify, or while the relay is between batches). It
// never blocks; a wake-up while one is pending is folded into it.
func (r *Relay) Wake() { r.signal() }

// idleState says what announcing the relay idle achieved.
type idleState int

const (
	// idleNotAnnounced: the relay holds no idle lock; it waits as before
	// (producers do not notify while no relay is idle: poll).
	idleNotAnnounced idleState = iota
	// idleAnnounced: the relay holds the idle lock; producers notify.
	idleAnnounced
	// idleElsewhere: another relay holds the idle lock, so producers notify
	// and this relay, listening too, is woken like it.
	idleElsewhere
	// idleBusy: producers in flight kept the lock past idleLockWait: look
	// again after wakeCooldown.
	idleBusy
)

// announceIdle takes the idle lock on the relay's own connection (opening it
// if needed), so that producers notify from now on and those that did not
// have committed. The caller runs a batch next: anything those producers
// committed is in it.
func (r *Relay) announceIdle(ctx context.Context) idleState {
	if r.cfg.DisableNotify || !r.listening.Load() {
		return idleNotAnnounced
	}
	if r.testHookBeforeIdle != nil {
		r.testHookBeforeIdle()
	}
	if r.idleConn == nil {
		conn, err := r.openIdleConn(ctx)
		if err != nil {
			r.logIdleError(ctx, err)
			return idleNotAnnounced
		}
		r.idleConn = conn
	}
	q := db.New(r.idleConn)
	err := q.LockRelayIdle(ctx, idleLockClass)
	if err == nil {
		return idleAnnounced
	}
	if !pgerr.IsLockNotAvailable(err) {
		r.closeIdleConn()
		r.logIdleError(ctx, err)
		return idleNotAnnounced
	}
	held, err := q.RelayIdleHeldElsewhere(ctx, idleLockClass)
	switch {
	case err != nil:
		r.closeIdleConn()
		r.logIdleError(ctx, err)
		return idleNotAnnounced
	case held:
		return idleElsewhere
	default:
		return idleBusy
	}
}

// leaveIdle releases the idle lock: the relay is about to run a batch.
// If that fails, the connection is closed, which releases it.
func (r *Relay) leaveIdle(ctx context.Context) {
	if r.idleConn == nil {
		return
	}
	if err := db.New(r.idleConn).UnlockRelayIdle(ctx, idleLockClass); err != nil {
		r.closeIdleConn()
		r.logIdleError(ctx, err)
	}
}

// openIdleConn takes a connection out of the pool for the idle lock, with
// lock_timeout set to idleLockWait.
func (r *Relay) openIdleConn(ctx context.Context) (*pgx.Conn, error) {
	pc, err := r.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	// The connection leaves the pool: it holds a session-scoped lock and
	// is closed, never reused, when the relay stops or it fails.
	conn := pc.Hijack()
	if _, err := conn.Exec(ctx, fmt.Sprintf("SET lock_timeout = %d", idleLockWait.Milliseconds())); err != nil {
		closeConn(conn)
		return nil, err
	}
	return conn, nil
}

// closeIdleConn closes the idle lock's connection, if open, releasing the
// lock with it.
func (r *Relay) closeIdleConn() {
	if r.idleConn != nil {
		closeConn(r.idleConn)
		r.idleConn = nil
	}
}

func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// logIdleError logs a failure to announce or leave the idle state: until
// the next attempt, producers do not notify and the relay polls.
func (r *Relay) logIdleError(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return // stopping
	}
	r.log.Warn("outbox: relay: idle lock failed; polling until it is taken again", "error", err)
}
