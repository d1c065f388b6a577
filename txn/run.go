package txn

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/phasectx"
)

// Func is the body of a single-phase operation: it writes through tx and
// returns the terminal response, or an error to roll everything back.
type Func func(ctx context.Context, tx pgx.Tx) (Response, error)

// Run runs fn exactly once for key. The key row, fn's writes and the stored
// response commit together in one SERIALIZABLE transaction, so a single-phase
// Run costs one commit, like the bare business transaction.
//
// A retry of a finished key returns the stored response (Replayed set) with
// one read and runs nothing. A key held by a concurrent attempt gives
// ErrKeyInUse (unless Config.WaitWhenInUse), a key stored for a different
// request ErrKeyReused. If fn returns an error, nothing is stored and the
// error is returned: a retry runs fn again. Serialization failures and
// deadlocks are retried up to Config.MaxRetries, then ErrConflict.
func (r *Runner) Run(ctx context.Context, key Key, fn Func) (Response, error) {
	if fn == nil {
		return Response{}, fmt.Errorf("txn: run: %w: nil func", ErrInvalidUse)
	}
	req, err := prepare(key, r.cfg.MaxParamsBytes)
	if err != nil {
		return Response{}, fmt.Errorf("txn: run: %w", err)
	}
	tries := 0
	raced := false // the last insert lost to a concurrent attempt
	for {
		if err := ctx.Err(); err != nil {
			return Response{}, fmt.Errorf("txn: run: %w", err)
		}
		row, err := r.q.LookupKey(ctx, db.LookupKeyParams{Scope: key.Scope, Key: key.Value})
		switch {
		case err == nil:
			resp, err := r.existing(ctx, req, "", row)
			if errors.Is(err, errWait) {
				continue
			}
			return resp, err
		case !errors.Is(err, pgx.ErrNoRows):
			return Response{}, fmt.Errorf("txn: run: look up key: %w", err)
		}
		if raced {
			// Lost the insert, yet no committed row: the other attempt's
			// transaction is still open.
			raced = false
			if err := r.inFlight(ctx, req); err != nil {
				return Response{}, err
			}
			continue
		}

		resp, err := r.runSingle(ctx, req, fn)
		switch {
		case err == nil:
			r.executed.Add(1)
			return resp, nil
		case errors.Is(err, errRaced):
			// Another attempt inserted the key after our lookup: committed
			// (the next lookup sees it) or still in flight.
			raced = true
			continue
		case pgerr.IsRetryable(err):
			if tries >= r.cfg.MaxRetries {
				r.conflicts.Add(1)
				r.log.WarnContext(ctx, "serialization conflict persisted", "scope", key.Scope, "key", key.Value, "retries", tries, "error", err)
				return Response{}, fmt.Errorf("txn: run: %w: %w", ErrConflict, err)
			}
			r.retries.Add(1)
			if err := r.backoff(ctx, tries); err != nil {
				return Response{}, fmt.Errorf("txn: run: %w", err)
			}
			tries++
			continue
		default:
			r.logTransient(ctx, req, "", err)
			return Response{}, fmt.Errorf("txn: run: %w", err)
		}
	}
}

// errRaced reports that the key appeared (or is being inserted) between our
// lookup and our insert; the caller looks again.
var errRaced = errors.New("txn: key inserted concurrently")

func (r *Runner) runSingle(ctx context.Context, req request, fn Func) (resp Response, err error) {
	// The connection is acquired explicitly so that the last statement and
	// COMMIT can go out in one round trip (see commitWith).
	conn, err := r.pool.Acquire(ctx)
	if err != nil {
		return Response{}, fmt.Errorf("acquire: %w", err)
	}
	defer conn.Release()
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	if err != nil {
		return Response{}, fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			r.rollback(ctx, tx)
		}
	}()
	q := r.q.WithTx(tx)
	ins, err := q.InsertSingleKey(ctx, db.InsertSingleKeyParams{
		Scope: req.key.Scope, Key: req.key.Value, Fingerprint: req.fingerprint,
		RequestMethod: req.key.Method, RequestPath: req.key.Path, RequestParams: req.params,
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return Response{}, errRaced // held by an uncommitted attempt, or committed since our lookup
	}
	if err != nil {
		return Response{}, fmt.Errorf("insert key: %w", err)
	}
	resp, err = guard(func() (Response, error) { return fn(phasectx.WithKeyID(ctx, ins.ID), tx) })
	if err != nil {
		return Response{}, err
	}
	if err := resp.validate(); err != nil {
		return Response{}, err
	}
	header, err := resp.encodedHeader()
	if err != nil {
		return Response{}, err
	}
	// By ctid: a TID scan takes no predicate lock on shared index pages.
	err = commitWith(ctx, tx, func(q *db.Queries) error {
		return q.FinishSingleKey(ctx, db.FinishSingleKeyParams{
			Tid: ins.Ctid, ID: ins.ID,
			ResponseStatus: int4(resp.Status), ResponseHeaders: header, ResponseBody: resp.Body,
		})
	})
	if err != nil {
		return Response{}, err
	}
	resp.Replayed = false
	return resp, nil
}

// commitWith sends the statement queue issues, then COMMIT, in one round
// trip. The statement must fail (not match nothing) when its precondition
// does not hold, since the COMMIT is already on its way: an error aborts the
// transaction and turns the COMMIT into a no-op. tx must run on a connection
// the caller acquired (not a pool transaction, which would wait for its own
// Commit to release the connection); on success tx is committed and must not
// be used again.
func commitWith(ctx context.Context, tx pgx.Tx, queue func(q *db.Queries) error) error {
	b := &pgx.Batch{}
	if err := queue(db.New(batchQueue{b})); err != nil {
		return err
	}
	b.Queue("commit")
	br := tx.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		if pgerr.Code(err) == pgerr.DivisionByZero {
			return fmt.Errorf("store response: the key row changed under the run (was it written by the function?): %w", err)
		}
		return fmt.Errorf("store response: %w", err)
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
	return nil
}

// batchQueue is a db.DBTX that queues statements in a batch instead of
// running them, so generated queries can be pipelined.
type batchQueue struct{ b *pgx.Batch }

func (q batchQueue) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	q.b.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

func (q batchQueue) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	q.b.Queue(sql, args...)
	return nil, errors.New("txn: a queued query has no rows yet")
}

func (q batchQueue) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	q.b.Queue(sql, args...)
	return queuedRow{}
}

type queuedRow struct{}

func (queuedRow) Scan(...any) error { return nil }
