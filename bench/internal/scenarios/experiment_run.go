package scenarios

import (
	"context"
	"crypto/sha256"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
)

// leanRun is an experiment, not a supported configuration: the single-phase
// operation written by hand against the library's schema the way we propose
// Runner.Run should work, to measure what that would gain. It is a
// fresh-key path only (a key that exists, or is held, is an error here).
//
//  1. One round trip: BEGIN ISOLATION LEVEL SERIALIZABLE pipelined with the
//     key insert (advisory trylock, ON CONFLICT DO NOTHING), the row inserted
//     already terminal with a provisional response: no pre-lookup, since
//     a conflict returns no row and only then is the key looked up.
//  2. The operation's own statements.
//  3. One round trip: the response stored with an UPDATE of unindexed
//     columns only (a HOT update: no index entries), pipelined with COMMIT.
//
// Three round trips, like the bare transaction, and the key row costs one
// heap tuple and its index entries once.
var leanRun = subject{name: "experiment: lean single phase", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	const insertKey = `INSERT INTO idempotency_keys (
	    scope, key, fingerprint, request_method, request_path, request_params,
	    workflow, recovery_point, phase_results, status, attempts,
	    created_at, last_run_at, finished_at, response_status)
	SELECT $1, $2, $3, 'POST', '/orders', $4, '', 'finished', '{}'::jsonb, 'finished', 1, now(), now(), now(), 500
	WHERE pg_try_advisory_xact_lock(hashtextextended(length($1::text)::text || ':' || $1::text || $2::text,
	                                                 'idempotency_keys'::regclass::oid::bigint))
	ON CONFLICT (scope, key) DO NOTHING
	RETURNING ctid`
	const storeResponse = `UPDATE idempotency_keys SET response_status = $2, response_headers = '{}'::jsonb, response_body = $3 WHERE ctid = $1`
	return func(ctx context.Context, _ int, seq int64) error {
		key := opKey("lean", seq)
		fp := sha256.Sum256([]byte("POST /orders " + string(orderParams)))
		conn, err := cl.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		defer conn.Release()
		b := &pgx.Batch{}
		b.Queue("BEGIN ISOLATION LEVEL SERIALIZABLE")
		b.Queue(insertKey, "bench", key, fp[:], string(orderParams))
		br := conn.SendBatch(ctx, b)
		_, err = br.Exec()
		var tid pgtype.TID
		if err == nil {
			err = br.QueryRow().Scan(&tid)
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			_, _ = conn.Exec(ctx, "ROLLBACK")
			if errors.Is(err, pgx.ErrNoRows) {
				return errors.New("key exists or is held")
			}
			return err
		}
		if _, err := conn.Exec(ctx, insertRow, key, 1, 100); err != nil {
			_, _ = conn.Exec(ctx, "ROLLBACK")
			return err
		}
		b = &pgx.Batch{}
		b.Queue(storeResponse, tid, 201, createdBody)
		b.Queue("COMMIT")
		if err := conn.SendBatch(ctx, b).Close(); err != nil {
			_, _ = conn.Exec(ctx, "ROLLBACK")
			return err
		}
		return nil
	}, func() {}, nil
}}
