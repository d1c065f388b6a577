package txn

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/pgbatch"
	"github.com/atomicphase/atomicphase/internal/pgerr"
)

// errUnsure wraps what fn made of a run (its error, or nil for a response
// that is not stored) that may not mean what it says, with the run's
// transaction id (0 if none began); Runner.run settles it (settleUnsure)
// once the run's connection is back in the pool, so that a pool of one
// connection does not wait on itself. What settling reads, a Run reads
// with its ROLLBACK when it can (rollbackAndReadOutcome). A workflow's
// first phase, which inserts its key with its commit, is settled the same
// way (see Attempt.txOnce and Attempt.outcome).
type errUnsure struct {
	err     error
	xid     int64     // the transaction's id
	started time.Time // the start of the server that gave it
	// out is KeyOutcome as read with the run's ROLLBACK, on its own
	// connection (rollbackAndReadOutcome); nil when it could not be, and
	// settleUnsure reads it on the pool.
	out *db.KeyOutcomeRow
}

func (e errUnsure) Error() string {
	if e.err == nil {
		return "response not stored"
	}
	return e.err.Error()
}

func (e errUnsure) Unwrap() error { return e.err }

// errCommittedByFunction: the run's transaction committed although the
// library never committed it, so fn did (a COMMIT the library did not see,
// e.g. in a batch fn left unread).
var errCommittedByFunction = fmt.Errorf("%w: the function's transaction committed without the library (COMMIT sent as SQL)", ErrInvalidUse)

// settleUnsure reads what a run that did not end as the library ends it
// left behind (KeyOutcome), and reports whether the call should look the
// key up again and replay it, and whether fn committed the transaction
// itself. A run here is a single-phase one (workflow empty) or a
// workflow's first phase that was to insert its key with its commit; id
// is the key's allotted id. Two things can make fn's outcome misleading:
//
//   - The run takes the key with fn's first statement, and finds the lock
//     free when a twin committed just after this call's lookup. fn then ran
//     on a snapshot without the twin's writes, and what it made of them (a
//     unique violation, a rejection) is not the answer a retry would get.
//     Once the run held the lock no other could commit the key, so a
//     committed row is the twin's: replay it.
//   - fn sent COMMIT as SQL (seen by userTx.watch, or unseen: in a batch it
//     left unread, in a multi-statement string). Its writes then committed
//     without the key: the key is stored failed (failUnstoredKey), so
//     that no retry runs the operation again. A
//     transaction that did not commit (a ROLLBACK sent as SQL) leaves
//     nothing to fail, and a retry runs the operation as new.
func (r *Runner) settleUnsure(ctx context.Context, req request, workflow string, id int64, u errUnsure) (replay, committed bool) {
	// Not bounded by the caller's context: a COMMIT fn sent must be found
	// even when the caller has gone.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	params := u.outcomeParams(req)
	var out db.KeyOutcomeRow
	var err error
	if u.out != nil {
		out = *u.out
	} else {
		out, err = r.q.KeyOutcome(sctx, params)
	}
	waited := false
	if err == nil && out.Status == "in progress" {
		// Still running on the server (statements fn left queued behind a
		// slow one, or a prepared transaction): it holds the key's lock
		// until it ends. Wait for that, and look again.
		waited = true
		err = r.underKeyLock(ctx, req, func(lctx context.Context, q *db.Queries) error {
			out, err = q.KeyOutcome(lctx, params)
			return err
		})
	}
	switch {
	case err != nil && waited && (pgerr.IsConnection(u.err) || pgerr.IsConnection(err)):
		// The run lost its connection (or the wait for its lock did): the
		// server has yet to notice, and nothing of the run's asked it to
		// commit. The retry finds out.
		return false, false
	case err != nil && waited:
		// Still not ended (a prepared transaction keeps its locks): it may
		// commit, so the key is failed, to be safe.
		r.log.ErrorContext(ctx, "the operation's transaction did not end when the library left it: its key is failed "+
			"in case it commits (a statement still queued, or PREPARE TRANSACTION)",
			"scope", req.key.Scope, "key", req.key.Value, "workflow", workflow, "error", err)
		r.failUnstoredKey(ctx, req, workflow, id)
		return false, true
	case err != nil:
		if errors.Is(u.err, errEndedBySQL) {
			r.logEndedKey(ctx, req, workflow, 0, err)
		}
		return false, false
	case out.Status == "committed" && out.Stored:
		// fn committed, and a twin took the key after that COMMIT freed it.
		r.logRanTwice(ctx, req, workflow)
		return false, true
	case out.Status == "committed":
		r.failUnstoredKey(ctx, req, workflow, id)
		return false, true
	default:
		// Aborted, or unknown (the server that ran it is gone: what it did
		// not replicate is lost with it).
		return out.Stored, false
	}
}

func (u errUnsure) outcomeParams(req request) db.KeyOutcomeParams {
	return db.KeyOutcomeParams{Scope: req.key.Scope, Key: req.key.Value, ServerStarted: u.started, TxID: u.xid}
}

// rollbackAndReadOutcome rolls back a run that is to be settled
// (settleUnsure) and reads KeyOutcome in the same round trip, on the run's
// connection: by then the server has run every statement the function
// left queued on it, so the transaction's status is final (short of a
// PREPARE TRANSACTION, which settleUnsure waits for as before). It returns
// nil when the read could not ride (no transaction began, the connection
// is gone, or the round trip failed): the run's deferred rollback then
// ends the transaction and settleUnsure reads on the pool, once the
// connection is back. Bounded by ReleaseTimeout, not by the caller's
// context: the outcome must be found when the caller has gone too.
func (r *Runner) rollbackAndReadOutcome(ctx context.Context, tx *lazyTx, req request, u errUnsure) *db.KeyOutcomeRow {
	if tx == nil || u.xid == 0 {
		return nil
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	params := u.outcomeParams(req)
	var out db.KeyOutcomeRow
	ok, err := tx.rollbackAndQuery(rctx, func(b *pgx.Batch) {
		_, _ = db.New(pgbatch.Queue{B: b}).KeyOutcome(rctx, params)
	}, func(row pgx.Row) (err error) {
		out, err = db.New(pgbatch.Row{R: row}).KeyOutcome(rctx, params)
		return err
	})
	if !ok || err != nil {
		return nil
	}
	return &out
}
