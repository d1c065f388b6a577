package scenarios

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
)

// The hand-written baselines: what an engineer who stores a key with its
// response would write by hand against the library's own table (same
// columns, same indexes), as tight as it gets. They are the physical limit
// of any design that does what Run and a workflow do; our figures are
// reported as a ratio to them as well as to the bare transaction. They
// handle a fresh key and a conflict (look up and return the stored row),
// and retry a transaction that fails to serialize, as anyone must under
// SERIALIZABLE; nothing else: no fencing, no recovery.

// handKeyInsert inserts a key row with a terminal response, or nothing when
// (scope, key) exists.
const handKeyInsert = `INSERT INTO idempotency_keys (
    scope, key, fingerprint, request_method, request_path, request_params_raw,
    workflow, recovery_point, phase_results, status, attempts, created_at,
    last_run_at, finished_at, response_status, response_headers, response_body)
VALUES ($1, $2, $3, 'POST', '/orders', $4, '', 'finished', '{}'::jsonb, 'finished', 1, now(), now(), now(), 201, '{}'::jsonb, $5)
ON CONFLICT (scope, key) DO NOTHING
RETURNING id`

// handKeyLookup reads a stored response, after a conflict.
const handKeyLookup = `SELECT response_status, response_body FROM idempotency_keys WHERE scope = $1 AND key = $2`

var handFingerprint = sha256.Sum256([]byte("POST /orders " + string(orderParams)))

// handKeyed: one SERIALIZABLE transaction with the key row (its response
// inline), the business row and COMMIT in 3 round trips: BEGIN pipelined
// with the key insert, the business insert, COMMIT. On a conflict it rolls
// back and returns the stored row.
var handKeyed = subject{name: "hand-written keyed tx", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	return func(ctx context.Context, _ int, seq int64) error {
		key := opKey("hand", seq)
		return retrySerialization(func() error { return handKeyedOnce(ctx, cl.pool, key) })
	}, func() {}, nil
}}

// retrySerialization runs tx again while it fails to serialize (40001) or
// deadlocks (40P01), up to 20 times.
func retrySerialization(tx func() error) error {
	for i := 0; ; i++ {
		err := tx()
		var pgErr *pgconn.PgError
		if i == 20 || !errors.As(err, &pgErr) || (pgErr.Code != "40001" && pgErr.Code != "40P01") {
			return err
		}
	}
}

func handKeyedOnce(ctx context.Context, pool *pgxpool.Pool, key string) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	var id int64
	inserted, err := beginWithKey(ctx, conn, &id, handKeyInsert, "bench", key, handFingerprint[:], orderParams, createdBody)
	if err != nil {
		return err
	}
	if !inserted {
		return replayStored(ctx, conn, key)
	}
	if _, err := conn.Exec(ctx, insertRow, key, 1, 100); err != nil {
		_, _ = conn.Exec(ctx, "ROLLBACK")
		return err
	}
	_, err = conn.Exec(ctx, "COMMIT")
	return err
}

// beginWithKey sends BEGIN ISOLATION LEVEL SERIALIZABLE and the key insert
// in one round trip, scanning the returned column into dest; inserted is
// false (and the transaction rolled back) when the key existed.
func beginWithKey(ctx context.Context, conn *pgxpool.Conn, dest any, insert string, args ...any) (inserted bool, err error) {
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL SERIALIZABLE")
	b.Queue(insert, args...)
	br := conn.SendBatch(ctx, b)
	_, err = br.Exec()
	if err == nil {
		err = br.QueryRow().Scan(dest)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_, _ = conn.Exec(ctx, "ROLLBACK")
		if errors.Is(err, pgx.ErrNoRows) {
			return false, nil
		}
		return false, err
	}
	return true, nil
}

func replayStored(ctx context.Context, conn *pgxpool.Conn, key string) error {
	var status int32
	var body []byte
	if err := conn.QueryRow(ctx, handKeyLookup, "bench", key).Scan(&status, &body); err != nil {
		return fmt.Errorf("stored row: %w", err)
	}
	return errors.New("fresh key replayed")
}

// handWorkflowKeyInsert inserts a running key row for the 2-tx workflow.
const handWorkflowKeyInsert = `INSERT INTO idempotency_keys (
    scope, key, fingerprint, request_method, request_path, request_params_raw,
    workflow, recovery_point, phase_results, status, attempts, created_at, last_run_at)
VALUES ($1, $2, $3, 'POST', '/orders', $4, 'hand', 'started', '{}'::jsonb, 'running', 1, now(), now())
ON CONFLICT (scope, key) DO NOTHING
RETURNING ctid`

// handFinish stores the response and ends the key, with the second write.
// It addresses the row by ctid: under SERIALIZABLE, an index scan by id
// would take a predicate lock on a primary-key page that concurrent
// inserts share, and fail to serialize with them.
const handFinish = `UPDATE idempotency_keys
SET status = 'finished', recovery_point = 'finished', response_status = 201, response_headers = '{}'::jsonb,
    response_body = $2, finished_at = now(), last_run_at = now()
WHERE ctid = $1`

// handTwoTx: the three-step operation in 2 commits. tx1: BEGIN with the key
// insert, then the first write with COMMIT (2 round trips); the foreign
// no-op; tx2: BEGIN, the second write, the response and COMMIT in one
// round trip. SERIALIZABLE, like ours.
var handTwoTx = subject{name: "hand-written 2-tx workflow", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	return func(ctx context.Context, _ int, seq int64) error {
		return handTwoTxOnce(ctx, cl.pool, opKey("hand2", seq))
	}, func() {}, nil
}}

func handTwoTxOnce(ctx context.Context, pool *pgxpool.Pool, key string) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	var tid pgtype.TID
	err = retrySerialization(func() error {
		inserted, err := beginWithKey(ctx, conn, &tid, handWorkflowKeyInsert, "bench", key, handFingerprint[:], orderParams)
		if err != nil {
			return err
		}
		if !inserted {
			return replayStored(ctx, conn, key)
		}
		b := &pgx.Batch{}
		b.Queue(insertRow, key, 1, 100)
		b.Queue("COMMIT")
		if err := conn.SendBatch(ctx, b).Close(); err != nil {
			_, _ = conn.Exec(ctx, "ROLLBACK")
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	if _, err := foreignNoop(ctx, key); err != nil {
		return err
	}
	return retrySerialization(func() error {
		b := &pgx.Batch{}
		b.Queue("BEGIN ISOLATION LEVEL SERIALIZABLE")
		b.Queue(insertRow, key, 3, 100)
		b.Queue(handFinish, tid, createdBody)
		b.Queue("COMMIT")
		if err := conn.SendBatch(ctx, b).Close(); err != nil {
			_, _ = conn.Exec(ctx, "ROLLBACK")
			return err
		}
		return nil
	})
}

// foreignNoop is the foreign call of every three-step subject: nothing.
func foreignNoop(context.Context, string) (string, error) { return "ok", nil }
