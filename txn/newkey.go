package txn

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/pgbatch"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/txnhook"
)

// A workflow's first attempt does not insert its key on its own: the key
// goes into the transaction of the first commit the workflow makes (an
// Atomic phase, Finish, or a terminal response), so that a workflow of
// Atomic, Foreign and Finish commits twice. Only a Foreign phase that
// comes first inserts the key by itself, since the lease must be held
// before the call. Until then the attempt holds nothing: a concurrent
// attempt's insert makes ours insert no row (errRaced), and the caller
// looks at the key again.

// insertParams is the key's insert, with the lease this attempt will hold
// and the id and foreign-key seed its lookup allotted. mustInsert: it goes
// out with a phase's first statement, and must fail, not insert nothing,
// when the key is taken (see InsertKey).
func (a *Attempt) insertParams(mustInsert bool) db.InsertKeyParams {
	return db.InsertKeyParams{
		MustInsert: mustInsert, ID: a.newID, Scope: a.req.key.Scope, Key: a.req.key.Value, Fingerprint: a.req.fingerprint,
		RequestMethod: a.req.key.Method, RequestPath: a.req.key.Path, RequestParams: a.req.params,
		Workflow: a.workflow, LeaseToken: a.token, LeaseSeconds: a.r.cfg.LeaseDuration.Seconds(),
		Seed: a.seed, RejectExpired: a.r.cfg.ExpiredKeyPolicy == ExpiredKeyReject,
	}
}

// inserted notes the key row this attempt's insert returned: the row
// addressed by the attempt's later commits. It is the attempt's only once
// the insert commits (stored).
func (a *Attempt) inserted(ins db.InsertKeyRow) {
	a.id, a.tid = ins.ID, ins.Ctid
	a.reusedExpired = ins.ReusedExpired
}

// committedKey marks the key stored by a commit whose transaction began
// (and set the lease) no earlier than sent.
func (a *Attempt) committedKey(ctx context.Context, sent time.Time) {
	a.stored = true
	a.leaseAt = sent
	if a.reusedExpired {
		a.r.noteExpiredReuse(ctx, a.req, a.workflow)
	}
}

// insertFailed interprets an insert that returned no row or an error.
func (a *Attempt) insertFailed(ctx context.Context, err error) error {
	if errors.Is(err, pgx.ErrNoRows) || pgerr.Code(err) == pgerr.DivisionByZero {
		// Held by an uncommitted attempt, or committed since our lookup.
		a.raced = true
		return errRaced
	}
	if pgerr.IsRetryable(err) {
		// A key committed after the transaction's snapshot fails the
		// insert with a serialization failure: the transaction runs again
		// (Runner.retryTx), and its insert goes first, so that the phase
		// does not run again only to lose the key once more.
		a.eager = true
	}
	return fmt.Errorf("insert key: %w", a.r.keyExpired(ctx, a.req, a.workflow, err))
}

// insertKey inserts the key on its own, holding the lease: before a Foreign
// phase that comes first.
func (a *Attempt) insertKey(ctx context.Context) error {
	a.at(txnhook.BeforeCommit, txnhook.CommitKey, "", "")
	sent := time.Now()
	ins, err := a.r.q.InsertKey(ctx, a.insertParams(false))
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return a.insertFailed(ctx, err)
	case err != nil && !pgerr.IsServerRejection(err):
		// The insert may have committed unseen, holding the key for a
		// whole lease: remove it, so that a retry runs.
		err = errors.Join(err, cleanupFailed(a.r.removeUnseenInsert(ctx, a.req, a.token)))
		return fmt.Errorf("insert key: %w", err)
	case err != nil:
		return a.insertFailed(ctx, err)
	}
	a.inserted(ins)
	a.committedKey(ctx, sent)
	a.at(txnhook.AfterCommit, txnhook.CommitKey, "", "")
	return nil
}

// inTx runs body in a SERIALIZABLE transaction on a connection of its own
// and commits it with the statement body returns (the key row's fenced
// update), sent with COMMIT in one round trip. If the key is not stored
// yet, the transaction inserts it first, sent with BEGIN: with body's first
// statement when lazy (body runs user code, and must call tx.start once it
// ran, for the insert's outcome), else before body runs. The inserted row
// is then the attempt's (a.id, a.tid). Serialization failures
// and deadlocks run the whole transaction again (Runner.retryTx); so does a
// key row found moved, once, after locating it (Attempt.relocate).
func (a *Attempt) inTx(ctx context.Context, lazy bool, body func(tx *lazyTx) (commit func(q *db.Queries) error, err error)) error {
	var sent time.Time
	relocated := false
	err := a.r.retryTx(ctx, func() error {
		for {
			sent = time.Now()
			err := a.txOnce(ctx, lazy && !a.eager, body)
			if errors.Is(err, errRunAgain) {
				a.noPrepare = true // once per attempt
				continue
			}
			if !errors.Is(err, errRowMoved) || !a.stored {
				return err
			}
			// Located where it is now: the lease lost, a lost commit, or
			// the row moved (once; again is the function's doing).
			if rerr := a.relocate(ctx); rerr != nil || relocated {
				return cmp.Or(rerr, err)
			}
			relocated = true
		}
	})
	if err != nil {
		return err
	}
	if !a.stored {
		a.committedKey(ctx, sent)
	}
	a.leaseAt = sent
	return nil
}

func (a *Attempt) txOnce(ctx context.Context, lazy bool, body func(tx *lazyTx) (func(q *db.Queries) error, error)) error {
	conn, err := a.r.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("acquire: %w", err)
	}
	defer conn.Release()
	tx := a.newTx(ctx, conn.Conn(), lazy)
	idBefore := a.id // an uncertain first commit's, kept for the release
	committed := false
	defer func() {
		if !committed {
			a.r.rollback(ctx, tx) // a no-op when the batch ended the transaction or none began
		}
	}()
	if !a.stored && !lazy {
		// The key's insert, before the phase runs.
		if err := tx.start(ctx); err != nil {
			return err
		}
	}
	commit, err := body(tx)
	if serr := tx.start(ctx); serr != nil {
		err = serr // BEGIN failed: that is what the phase met, whatever it made of it
	}
	if errors.Is(err, errEndedBySQL) {
		// What fn wrote before may have committed (with the key's insert,
		// for a key not stored yet): the operation must not run again.
		a.endedBySQL = true
		a.r.failEndedKey(ctx, a.req, a.workflow, a.keyID(), a.nullToken())
	}
	if err != nil {
		if !a.stored {
			a.id = idBefore // rolled back: nothing of this insert is left to release
		}
		return err
	}
	// On an error here the COMMIT may have taken effect unseen: a.id stays,
	// for the release.
	err = commitWith(ctx, tx, commit)
	committed = err == nil
	if err != nil && !a.stored && !pgerr.IsServerRejection(err) {
		a.uncertain = true
	}
	return err
}

// newTx returns the phase's transaction. For a stored key, BEGIN goes out
// with the phase's first statement (see lazyTx); for a key not stored yet,
// with the key's insert, and when lazy, the phase's first statement after
// it (else txOnce sends the insert before the phase runs).
func (a *Attempt) newTx(ctx context.Context, conn *pgx.Conn, lazy bool) *lazyTx {
	opts := pgx.TxOptions{IsoLevel: pgx.Serializable}
	if a.stored {
		return newLazyTx(ctx, conn, opts, opener{}, a.r.connExecMode(conn))
	}
	params := a.insertParams(lazy)
	tx := newLazyTx(ctx, conn, opts, opener{
		queue: func(b *pgx.Batch) { _, _ = db.New(pgbatch.Queue{B: b}).InsertKey(ctx, params) },
		read: func(br pgx.BatchResults) error {
			ins, err := db.New(pgbatch.Results{BR: br}).InsertKey(ctx, params)
			if err != nil {
				return a.insertFailed(ctx, err)
			}
			a.inserted(ins)
			return nil
		},
	}, a.r.connExecMode(conn))
	tx.prep = tx.prep && !a.noPrepare
	return tx
}

// storeTerminal stores a terminal response the workflow returned without
// Finish, fenced, where the workflow stopped: in a transaction that inserts
// the key if nothing stored it yet.
func (a *Attempt) storeTerminal(ctx context.Context, resp Response) error {
	point := a.point
	if a.pendingPoint != "" {
		point = a.pendingPoint
	}
	a.at(txnhook.BeforeCommit, txnhook.CommitResponse, point, "")
	var err error
	if a.stored {
		err = a.storeAlone(ctx, resp, point)
	} else {
		err = a.inTx(ctx, false, func(*lazyTx) (func(q *db.Queries) error, error) { return a.storeStmt(ctx, resp, point) })
		if err != nil && !errors.Is(err, ErrLeaseLost) {
			err = fmt.Errorf("store response: %w", err)
		}
	}
	if err != nil {
		return err
	}
	a.at(txnhook.AfterCommit, txnhook.CommitResponse, point, "")
	return nil
}

// removeUnseenInsert deletes the key this attempt's insert may have created
// although the caller saw an error (the connection failed around its
// commit), on a fresh context bounded by Config.ReleaseTimeout. Nothing ran
// under it. It first waits on the key's advisory lock, which the insert's
// transaction holds until it ends, so that an insert still committing on
// the server is seen (read committed: the DELETE's snapshot follows the
// lock). It returns an error only if the removal failed.
func (r *Runner) removeUnseenInsert(ctx context.Context, req request, token uuid.UUID) error {
	err := r.underKeyLock(ctx, req, func(rctx context.Context, q *db.Queries) error {
		n, err := q.DeleteUnstartedKey(rctx, db.DeleteUnstartedKeyParams{
			Scope: req.key.Scope, Key: req.key.Value, LeaseToken: token,
		})
		if n == 1 {
			r.released.Add(1)
			r.tel.Released(ctx, workflowOf(ctx))
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("remove the key the insert may have created (it becomes free when its lease of %v expires): %w",
			r.cfg.LeaseDuration, err)
	}
	return nil
}

// underKeyLock runs fn in a READ COMMITTED transaction, on a fresh context
// bounded by Config.ReleaseTimeout, after waiting for the key's advisory
// lock: the one a key insert holds until its transaction ends, so that fn
// sees the outcome of an insert still committing on the server.
func (r *Runner) underKeyLock(ctx context.Context, req request, fn func(ctx context.Context, q *db.Queries) error) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	return pgx.BeginTxFunc(rctx, r.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		q := r.q.WithTx(tx)
		if err := q.LockKey(rctx, db.LockKeyParams{Scope: req.key.Scope, Key: req.key.Value}); err != nil {
			return fmt.Errorf("wait for the key's insert: %w", err)
		}
		return fn(rctx, q)
	})
}
