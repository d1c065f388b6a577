package txn

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/pgbatch"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/phasectx"
	"github.com/atomicphase/atomicphase/internal/telemetry"
)

// Func is the body of a single-phase operation: it writes through tx and
// returns the terminal response, or an error to roll everything back.
type Func func(ctx context.Context, tx pgx.Tx) (Response, error)

// Run runs fn for key. The key row, fn's writes and the stored response
// commit together in one SERIALIZABLE transaction, so a single-phase Run
// costs one commit, like the bare business transaction, and two round
// trips besides fn's statements: a read of the key, and the key row (with
// the response) with COMMIT. BEGIN and the key's lock go out with fn's
// first statement; the key row is written once, at the end.
//
// So the key is taken by fn's first statement, not before fn runs. A
// concurrent call with the same key that takes it first wins: fn's first
// statement then does not run (the transaction is aborted before it), and
// Run answers as a retry would, ErrKeyInUse or the winner's replayed
// response, whatever fn returned. A call whose read of the key came just
// before the winner committed runs fn in a transaction that is then rolled
// back (its key's insert meets the winner's row), and replays.
//
// fn may run more than once: when the transaction fails with a
// serialization failure or a deadlock, it is rolled back and fn runs again,
// up to Config.MaxRetries times (then ErrConflict). Only one run's writes
// ever commit. So fn must do nothing outside tx: a call to another system
// (a payment provider, an e-mail service) belongs in a workflow's Foreign
// phase, which runs outside any transaction under a stable foreign key. A
// serialization failure that fn's statements met is retried even if fn
// swallowed it and returned a response. tx cannot be committed or rolled
// back by fn (ErrInvalidUse); return an error to roll back.
//
// A retry of a finished key returns the stored response (Replayed set) with
// one read and runs nothing. A key held by a concurrent attempt gives
// ErrKeyInUse (unless Config.WaitWhenInUse), a key stored for a different
// request ErrKeyReused. If fn returns an error, nothing is stored and the
// error is returned (a retry runs fn again), unless a twin stored the key
// meanwhile: then its response is replayed, as a retry would get it. A response that Config.Store
// does not store (by default a client-correctable 4xx such as 400 or 422)
// is returned with fn's writes rolled back and no key left behind.
func (r *Runner) Run(ctx context.Context, key Key, fn Func) (Response, error) {
	ctx, span, start := r.startSpan(ctx, telemetry.SpanRun)
	resp, err := r.runPublic(ctx, key, fn)
	r.ended(ctx, span, start, "", key.Scope, resp, err)
	return resp, err
}

func (r *Runner) runPublic(ctx context.Context, key Key, fn Func) (Response, error) {
	if fn == nil {
		return Response{}, fmt.Errorf("txn: run: %w: nil func", ErrInvalidUse)
	}
	req, err := prepare(key, r.cfg.MaxParamsBytes)
	if err != nil {
		return Response{}, fmt.Errorf("txn: run: %w", err)
	}
	resp, err := r.run(ctx, req, fn)
	if err != nil {
		r.logFailure(ctx, req, "", err, nil)
		return Response{}, markUnavailable(ctx, fmt.Errorf("txn: run: %w", err))
	}
	return resp, nil
}

func (r *Runner) run(ctx context.Context, req request, fn Func) (Response, error) {
	tries := 0
	raced := false     // the last insert lost to a concurrent attempt
	contended := false // an insert lost: from then on, insert before fn runs
	waited := false    // the call waited for the key's holder (Config.WaitWhenInUse)
	prepare := true    // a run may prepare fn's first statement (see errRunAgain)
	for {
		if err := ctx.Err(); err != nil {
			return Response{}, err
		}
		row, err := r.q.LookupKey(ctx, db.LookupKeyParams{
			Scope: req.key.Scope, Key: req.key.Value, RejectExpired: r.cfg.ExpiredKeyPolicy == ExpiredKeyReject,
		})
		if err != nil {
			return Response{}, fmt.Errorf("look up key: %w", err)
		}
		if row.Expired {
			return Response{}, r.expiredKey(ctx, req, "")
		}
		if row.ID.Valid {
			resp, err := r.existing(ctx, req, "", row)
			if errors.Is(err, errWait) {
				waited = r.noteWait(ctx, req, "", waited)
				continue
			}
			return resp, err
		}
		if raced {
			// Lost the insert, yet no committed row: the other attempt's
			// transaction is still open.
			raced = false
			if err := r.inFlight(ctx, req); err != nil {
				return Response{}, err
			}
			waited = r.noteWait(ctx, req, "", waited)
			continue
		}

		resp, stored, err := r.runSingle(ctx, req, row.NewID, contended, prepare, fn)
		if unsure, ok := errors.AsType[errUnsure](err); ok {
			replay, committed := r.settleUnsure(ctx, req, "", row.NewID, unsure)
			if replay {
				raced, contended = true, true // a twin committed the key: the next lookup replays it
				continue
			}
			err = unsure.err
			if committed {
				err = cmp.Or(err, errCommittedByFunction)
			}
		}
		switch {
		case err == nil && !stored:
			r.logNotStored(ctx, req, "", resp.Status)
			return resp, nil
		case err == nil:
			r.executed.Add(1)
			return resp, nil
		case errors.Is(err, errRaced):
			// Another attempt inserted the key after our lookup: committed
			// (the next lookup sees it) or still in flight.
			raced, contended = true, true
			continue
		case errors.Is(err, errRunAgain):
			prepare = false // once per call
			continue
		case pgerr.IsRetryable(err):
			if tries >= r.cfg.MaxRetries {
				r.conflicts.Add(1)
				return Response{}, fmt.Errorf("%w (%d retries): %w", ErrConflict, tries, err)
			}
			r.retries.Add(1)
			r.tel.Retried(ctx, "")
			if err := r.backoff(ctx, tries); err != nil {
				return Response{}, err
			}
			tries++
			continue
		default:
			return Response{}, err
		}
	}
}

// errRaced reports that the key appeared (or is being inserted) between our
// lookup and our insert; the caller looks again.
var errRaced = errors.New("key inserted concurrently")

// runSingle runs fn once in a new transaction that takes the key, id, and
// inserts it at the end with the response. stored is false when
// Config.Store rejected fn's response: the transaction was rolled back and
// the response is returned as it is.
//
// The key is taken (TakeKeyLock's lock) by a statement that goes out
// with fn's first statement, so a twin that comes first costs fn's run up
// to that statement. eager (the run lost the key to a twin already, and
// may be waiting for it in a loop) takes it before fn runs instead, so
// that a run that keeps losing runs nothing of fn. An error of fn's, or a
// response not stored, comes back as errUnsure. prepare false: fn's
// first statement is not prepared by the run (see errRunAgain).
func (r *Runner) runSingle(ctx context.Context, req request, id int64, eager, prepare bool, fn Func) (resp Response, stored bool, err error) {
	// The connection is acquired explicitly so that the last statement and
	// COMMIT can go out in one round trip (see commitWith).
	conn, err := r.pool.Acquire(ctx)
	if err != nil {
		return Response{}, false, fmt.Errorf("acquire: %w", err)
	}
	defer conn.Release()
	// BEGIN and the key's lock go out with fn's first statement, in one
	// round trip (see lazyTx).
	take := db.TakeKeyLockParams{MustTake: !eager, Scope: req.key.Scope, Key: req.key.Value}
	var xid int64         // the transaction's id, once the key's lock is taken
	var started time.Time // and the server's start, which tells whose id it is
	var tx *lazyTx
	unsure := func(err error) error {
		u := errUnsure{err: err, xid: xid, started: started}
		u.out = r.rollbackAndReadOutcome(ctx, tx, req, u)
		return u
	}
	tx = newLazyTx(ctx, conn.Conn(), pgx.TxOptions{IsoLevel: pgx.Serializable}, opener{
		queue: func(b *pgx.Batch) { _, _ = db.New(pgbatch.Queue{B: b}).TakeKeyLock(ctx, take) },
		read: func(br pgx.BatchResults) error {
			row, err := db.New(pgbatch.Results{BR: br}).TakeKeyLock(ctx, take)
			xid, started = row.Xid, row.ServerStarted
			switch {
			case err == nil && !row.Taken, pgerr.Code(err) == pgerr.DivisionByZero:
				return errRaced // held by an uncommitted attempt
			case err != nil:
				return fmt.Errorf("take key: %w", err)
			}
			return nil
		},
	}, r.connExecMode(conn.Conn()))
	tx.prep = tx.prep && prepare
	committed := false
	defer func() {
		if !committed {
			r.rollback(ctx, tx) // a no-op when the batch ended the transaction or none began
		}
	}()
	if eager {
		if err := tx.start(ctx); err != nil {
			return Response{}, false, err
		}
	}
	utx := newUserTx(tx)
	resp, err = guard(func() (Response, error) { return fn(phasectx.WithKeyID(ctx, id), utx) })
	if serr := utx.settle(ctx); serr != nil {
		if errors.Is(serr, errEndedBySQL) {
			// What fn wrote before may have committed, without the key:
			// Runner.run asks, once this connection is back.
			return Response{}, false, unsure(serr)
		}
		return Response{}, false, serr
	}
	if rerr := utx.retry(); rerr != nil {
		return Response{}, false, unsure(rerr) // whatever fn made of it
	}
	if err != nil {
		return Response{}, false, unsure(err)
	}
	if err := resp.validate(); err != nil {
		return Response{}, false, unsure(err)
	}
	if err := utx.usable(); err != nil {
		return Response{}, false, unsure(err)
	}
	if !r.cfg.Store(resp.Status) {
		resp.Replayed = false
		return resp, false, unsure(nil) // rolled back with the outcome's read, or by the deferred rollback
	}
	header, err := resp.encodedHeader()
	if err != nil {
		return Response{}, false, unsure(err)
	}
	var reusedExpired bool
	err = commitWith(ctx, tx, func(q *db.Queries) (err error) {
		reusedExpired, err = q.InsertFinishedKey(ctx, db.InsertFinishedKeyParams{
			ID: id, Scope: req.key.Scope, Key: req.key.Value, Fingerprint: req.fingerprint,
			RequestMethod: req.key.Method, RequestPath: req.key.Path, RequestParams: req.params,
			ResponseStatus: int32(resp.Status), ResponseHeaders: string(header), ResponseBody: resp.Body,
			RejectExpired: r.cfg.ExpiredKeyPolicy == ExpiredKeyReject,
		})
		return err
	})
	committed = err == nil // on success tx is committed and must not be used again
	switch {
	case pgerr.IsKeyTaken(err):
		return Response{}, false, errRaced // committed since our lookup: the next one sees it
	case err != nil:
		return Response{}, false, r.keyExpired(ctx, req, "", utx.explain(err))
	}
	if reusedExpired {
		r.noteExpiredReuse(ctx, req, "")
	}
	resp.Replayed = false
	return resp, true, nil
}

// commitWith sends stmt's statement, then COMMIT, in one round trip. stmt
// runs twice: on a queue (its results are zero; see pgbatch.Queue), then
// on the batch's results (it reads the statement's). The statement must
// fail (not match nothing) when its precondition does not hold, since the
// COMMIT is already on its way: an error aborts the transaction and turns
// the COMMIT into a no-op. A statement that failed with division_by_zero,
// the way the key row's fenced updates fail when the row is not where the
// attempt left it, gives errRowMoved. tx must run on a connection the
// caller acquired (not a pool transaction, which would wait for its own
// Commit to release the connection); on success tx is committed and
// refuses every statement (lazyTx.end).
func commitWith(ctx context.Context, tx *lazyTx, stmt func(q *db.Queries) error) error {
	b := &pgx.Batch{}
	if err := stmt(db.New(pgbatch.Queue{B: b})); err != nil {
		return err
	}
	b.Queue("commit")
	br := tx.SendBatch(ctx, b)
	if err := stmt(db.New(pgbatch.Results{BR: br})); err != nil {
		_ = br.Close()
		if pgerr.Code(err) == pgerr.DivisionByZero {
			return fmt.Errorf("record: %w (was it written by the function?): %w", errRowMoved, err)
		}
		return fmt.Errorf("record: %w", err)
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	if tag.String() == "ROLLBACK" {
		return fmt.Errorf("commit: %w", pgx.ErrTxCommitRollback)
	}
	tx.end()
	return nil
}

// errRowMoved: a fenced update of the key row found it neither where the
// attempt left it nor gone with the lease (see Attempt.relocate).
var errRowMoved = errors.New("the key row is not where the attempt left it")
