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
// Atomic, Foreign and Finish commits twice. A first Atomic phase or Finish
// takes the key's lock with its first statement and inserts the key row
// with its COMMIT, at the phase's recovery point (or finished), so the
// row is written once (insertAtCommit). Only a Foreign phase that comes
// first inserts the key by itself, since the lease must be held before
// the call. Until then the attempt holds nothing: a concurrent attempt
// that holds the lock makes ours lose it (errRaced), and the caller looks
// at the key again.

// insertParams is the key's insert, with the lease this attempt will hold
// and the id and foreign-key seed its lookup allotted.
func (a *Attempt) insertParams() db.InsertKeyParams {
	return db.InsertKeyParams{
		ID: a.newID, Scope: a.req.key.Scope, Key: a.req.key.Value, Fingerprint: a.req.fingerprint,
		RequestMethod: a.req.key.Method, RequestPath: a.req.key.Path, RequestParams: a.req.params,
		Workflow: a.workflow, LeaseToken: a.token, LeaseSeconds: a.r.cfg.LeaseDuration.Seconds(),
		Seed: a.seed, RejectExpired: a.r.cfg.ExpiredKeyPolicy == ExpiredKeyReject,
	}
}

// insertAtPhaseParams is the key's insert with a first phase's commit
// (insertAtCommit), at the phase name with its member (see phaseStmt).
func (a *Attempt) insertAtPhaseParams(name string, member []byte) db.InsertKeyAtPhaseParams {
	return db.InsertKeyAtPhaseParams{
		ID: a.newID, Scope: a.req.key.Scope, Key: a.req.key.Value, Fingerprint: a.req.fingerprint,
		RequestMethod: a.req.key.Method, RequestPath: a.req.key.Path, RequestParams: a.req.params,
		Workflow: a.workflow, Phase: name, Member: member, LeaseToken: a.token,
		LeaseSeconds: a.r.cfg.LeaseDuration.Seconds(), Seed: a.seed,
		RejectExpired: a.r.cfg.ExpiredKeyPolicy == ExpiredKeyReject,
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
	if errors.Is(err, pgx.ErrNoRows) || pgerr.Code(err) == pgerr.DivisionByZero || pgerr.IsKeyTaken(err) ||
		(a.uncertain && pgerr.IsKeyIDTaken(err)) {
		// Held by an uncommitted attempt, or committed since our lookup (by
		// this attempt's first commit too, whose answer was lost: its row
		// has the id ours was to take).
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
	ins, err := a.r.q.InsertKey(ctx, a.insertParams())
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

// keyInsert says how a transaction of a key not stored yet inserts it.
type keyInsert int

const (
	// insertBefore: the key's insert (InsertKey) goes out with BEGIN,
	// before the body runs: a terminal response stored without Finish, and
	// an eager attempt's phases.
	insertBefore keyInsert = iota
	// insertAtCommit: the key's lock goes out with BEGIN and the body's
	// first statement (TakeKeyLock), and the key row with COMMIT, at the
	// body's phase (InsertKeyAtPhase) or finished (InsertFinishedKey),
	// written once: a first Atomic phase's, or Finish's.
	insertAtCommit
)

// inTx runs body in a SERIALIZABLE transaction on a connection of its own
// and commits it with the statement body returns (the key row's fenced
// update, or for insertAtCommit its insert), sent with COMMIT in one round
// trip. If the key is not stored yet, the transaction inserts it as insert
// says (insertBefore if the attempt is eager); with insertAtCommit, the
// body runs user code and must call tx.start once it ran, for the lock's
// outcome. The inserted row is then the attempt's (a.id,
// a.tid). Serialization failures and deadlocks run the whole transaction
// again (Runner.retryTx); so does a key row found moved, once, after
// locating it (Attempt.relocate).
func (a *Attempt) inTx(ctx context.Context, insert keyInsert, body func(tx *lazyTx) (commit func(q *db.Queries) error, err error)) error {
	var sent time.Time
	relocated := false
	err := a.r.retryTx(ctx, func() error {
		for {
			sent = time.Now()
			mode := insert
			if a.eager {
				mode = insertBefore
			}
			err := a.txOnce(ctx, mode, body)
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

// txOnce runs body's transaction once (txOnConn), then, with the
// connection back in the pool, settles what the function may have left
// behind: a transaction it ended through SQL fails the key; and a first
// phase that was to insert its key at its commit (insertAtCommit), and
// ended with an error of its function's, may have run on a snapshot taken
// before a twin committed the key (see Runner.settleUnsure): the twin's
// key is then the answer (errRaced), not that error.
func (a *Attempt) txOnce(ctx context.Context, insert keyInsert, body func(tx *lazyTx) (func(q *db.Queries) error, error)) error {
	a.atCommit = !a.stored && insert == insertAtCommit
	a.xid, a.started, a.outcome = 0, time.Time{}, nil
	err, fromBody := a.txOnConn(ctx, insert, body)
	unsure := errUnsure{err: err, xid: a.xid, started: a.started, out: a.outcome}
	switch {
	case errors.Is(err, errEndedBySQL):
		// What fn wrote before may have committed (with the key's insert,
		// for a key inserted with the first statement): the operation must
		// not run again.
		a.endedBySQL = true
		if !a.atCommit {
			a.r.failEndedKey(ctx, a.req, a.workflow, a.keyID(), a.nullToken())
		} else {
			a.r.settleUnsure(ctx, a.req, a.workflow, a.newID, unsure)
		}
	case fromBody && a.atCommit && unsettled(err):
		replay, committed := a.r.settleUnsure(ctx, a.req, a.workflow, a.newID, unsure)
		switch {
		case replay:
			a.raced = true
			return errRaced
		case committed:
			a.endedBySQL = true
			return fmt.Errorf("%w: %w", errEndedBySQL, errCommittedByFunction)
		}
	}
	return err
}

// unsettled reports whether a first phase that was to insert its key at
// its commit, and ended with err from its body, may have run on a
// snapshot taken before a twin committed the key (or committed itself):
// txOnce then settles it. Lost keys, runs to go again and serialization
// failures are answered by the retry's own lookup.
func unsettled(err error) bool {
	return !errors.Is(err, errRaced) && !errors.Is(err, errRunAgain) && !pgerr.IsRetryable(err)
}

// txOnConn runs body's transaction once on a connection of its own;
// fromBody: the error is the body's (or BEGIN's), not the commit's.
func (a *Attempt) txOnConn(ctx context.Context, insert keyInsert, body func(tx *lazyTx) (func(q *db.Queries) error, error)) (err error, fromBody bool) {
	conn, err := a.r.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("acquire: %w", err), false
	}
	defer conn.Release()
	tx := a.newTx(ctx, conn.Conn(), insert)
	idBefore := a.id // an uncertain first commit's, kept for the release
	committed := false
	defer func() {
		if !committed {
			a.r.rollback(ctx, tx) // a no-op when the batch ended the transaction or none began
		}
	}()
	if !a.stored && insert == insertBefore {
		// The key's insert, before the phase runs.
		if err := tx.start(ctx); err != nil {
			return err, false
		}
	}
	commit, err := body(tx)
	if serr := tx.start(ctx); serr != nil {
		err = serr // BEGIN failed: that is what the phase met, whatever it made of it
	}
	if err != nil {
		if !a.stored {
			a.id = idBefore // rolled back: nothing of this insert is left to release
		}
		if a.atCommit && unsettled(err) {
			// txOnce settles it: read what that needs with the ROLLBACK.
			a.outcome = a.r.rollbackAndReadOutcome(ctx, tx, a.req, errUnsure{xid: a.xid, started: a.started})
		}
		return err, true
	}
	// On an error here the COMMIT may have taken effect unseen: a.id stays,
	// for the release.
	err = commitWith(ctx, tx, commit)
	committed = err == nil
	switch {
	case err != nil && !a.stored && !pgerr.IsServerRejection(err):
		a.uncertain = true
	case err != nil && a.atCommit:
		// The key's insert met a key committed since the lookup, or a
		// tombstone; or the transaction a serialization failure.
		a.id = idBefore
		err = a.insertFailed(ctx, err)
	}
	return err, false
}

// newTx returns the phase's transaction. For a stored key, BEGIN goes out
// with the phase's first statement (see lazyTx); for a key not stored yet,
// with the key's lock and the phase's first statement (insertAtCommit), or
// with the key's insert, which txOnConn sends before the phase runs.
func (a *Attempt) newTx(ctx context.Context, conn *pgx.Conn, insert keyInsert) *lazyTx {
	opts := pgx.TxOptions{IsoLevel: pgx.Serializable}
	var open opener
	switch {
	case a.stored:
	case a.atCommit:
		take := db.TakeKeyLockParams{MustTake: true, Scope: a.req.key.Scope, Key: a.req.key.Value}
		open = opener{
			queue: func(b *pgx.Batch) { _, _ = db.New(pgbatch.Queue{B: b}).TakeKeyLock(ctx, take) },
			read: func(br pgx.BatchResults) error {
				row, err := db.New(pgbatch.Results{BR: br}).TakeKeyLock(ctx, take)
				a.xid, a.started = row.Xid, row.ServerStarted
				if err == nil && !row.Taken {
					err = pgx.ErrNoRows
				}
				if err != nil {
					return a.insertFailed(ctx, err)
				}
				return nil
			},
		}
	default:
		params := a.insertParams()
		open = opener{
			queue: func(b *pgx.Batch) { _, _ = db.New(pgbatch.Queue{B: b}).InsertKey(ctx, params) },
			read: func(br pgx.BatchResults) error {
				ins, err := db.New(pgbatch.Results{BR: br}).InsertKey(ctx, params)
				if err != nil {
					return a.insertFailed(ctx, err)
				}
				a.inserted(ins)
				return nil
			},
		}
	}
	tx := newLazyTx(ctx, conn, opts, open, a.r.connExecMode(conn))
	if !a.stored {
		tx.prep = tx.prep && !a.noPrepare
	}
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
		err = a.inTx(ctx, insertBefore, func(*lazyTx) (func(q *db.Queries) error, error) { return a.storeStmt(ctx, resp, point) })
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
