package scenarios

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
	"github.com/atomicphase/atomicphase/txn"
)

// How cost grows with the work: the same operations measured beside tables
// of growing size. For each size N the key table is filled with N finished
// keys in one scope, then Run on a new key, a replay of a finished key and
// Resume of a finished key (the library's read of a key by scope and value)
// are measured; the relay's drain of a large pending backlog is measured
// against a small one.

// The operations the scale mode measures.
const (
	ScaleRun    = "Run (new key)"
	ScaleReplay = "replay (Run on a finished key)"
	ScaleResume = "Resume (read a finished key)"
)

// ScaleOps lists the measured operations in report order.
var ScaleOps = []string{ScaleRun, ScaleReplay, ScaleResume}

// ScaleCell names one measured cell of a size: an operation at a concurrency.
type ScaleCell struct {
	Op string
	C  int
}

// ScalePoint is one table size and what was measured beside it.
type ScalePoint struct {
	Keys int
	// Insert is the generate_series INSERT of the keys; Maintain the
	// VACUUM ANALYZE and CHECKPOINT after it.
	Insert, Maintain time.Duration
	// HeapBytes is the table's size, KeyIndexBytes its (scope, key) unique
	// index's, IndexBytes all its indexes' together.
	HeapBytes, KeyIndexBytes, IndexBytes int64
	Results                              map[ScaleCell]harness.Result
	// Plans holds EXPLAIN (ANALYZE, BUFFERS) of the key lookup and the key
	// insert, run once each after the cells.
	Plans string
}

// DrainPoint is one relay drain of a pending backlog.
type DrainPoint struct {
	Messages int
	Insert   time.Duration // the generate_series INSERT, VACUUM ANALYZE and CHECKPOINT
	Took     time.Duration // relay start to the last JetStream acknowledgement
}

// Rate is messages drained per second.
func (d DrainPoint) Rate() float64 { return float64(d.Messages) / d.Took.Seconds() }

// ScaleReport is the result of RunScale.
type ScaleReport struct {
	Concurrency []int
	Timing      harness.Timing
	Points      []ScalePoint
	Drains      []DrainPoint
	Began       time.Time
	Took        time.Duration
}

// scaleScope is the one scope every key of the scale mode is in.
const scaleScope = "bench"

// ExistingKey is the value of the g-th key insertScaleKeys writes (1-based):
// a UUID made of the MD5 of g's decimal digits, as md5(g::text)::uuid::text
// spells it, so keys are spread over the whole index as random UUIDs are.
func ExistingKey(g int) string {
	sum := md5.Sum([]byte(strconv.Itoa(g)))
	return uuidString(sum[:])
}

func uuidString(b []byte) string {
	h := hex.EncodeToString(b)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// randomKey is a new key as clients make them: a random (version 4) UUID.
func randomKey() string {
	var b [16]byte
	for i := range 2 {
		v := rand.Uint64()
		for j := range 8 {
			b[i*8+j] = byte(v >> (8 * j))
		}
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return uuidString(b[:])
}

// insertScaleKeys fills the key table with n finished keys in one scope, in
// one statement: every column as a single-phase Run of orderKey writes it
// (copied from one such row, which is then deleted), keys ExistingKey(1..n),
// finished one millisecond apart up to now (well inside any TTL). Then it
// vacuums and analyzes the table, as autovacuum would have, and checkpoints.
func insertScaleKeys(ctx context.Context, pool *pgxpool.Pool, r *txn.Runner, n int) (insert, maintain time.Duration, err error) {
	const template = "scale-template"
	if _, err := r.Run(ctx, orderKey(template), func(context.Context, pgx.Tx) (txn.Response, error) {
		return txn.Response{Status: 201, Body: createdBody}, nil
	}); err != nil {
		return 0, 0, fmt.Errorf("template key: %w", err)
	}
	t0 := time.Now()
	// One transaction: the template row is replaced by the n copies.
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, 0, err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit it is a no-op
	tag, err := tx.Exec(ctx, `
		INSERT INTO idempotency_keys (
		    scope, key, fingerprint, request_method, request_path, request_params, request_params_raw,
		    workflow, recovery_point, phase_results, phase_results_raw, status, attempts,
		    created_at, last_run_at, finished_at,
		    response_status, response_headers, response_body, foreign_key_seed)
		SELECT t.scope, md5(g::text)::uuid::text, t.fingerprint, t.request_method, t.request_path, t.request_params, t.request_params_raw,
		       t.workflow, t.recovery_point, t.phase_results, t.phase_results_raw, t.status, t.attempts,
		       now() - ($1::int - g) * interval '1 millisecond' - interval '5 milliseconds',
		       now() - ($1::int - g) * interval '1 millisecond' - interval '5 milliseconds',
		       now() - ($1::int - g) * interval '1 millisecond',
		       t.response_status, t.response_headers, t.response_body, t.foreign_key_seed
		FROM idempotency_keys AS t CROSS JOIN generate_series(1, $1::int) AS g
		WHERE t.scope = $2 AND t.key = $3`, n, scaleScope, template)
	if err != nil {
		return 0, 0, fmt.Errorf("insert keys: %w", err)
	}
	if tag.RowsAffected() != int64(n) {
		return 0, 0, fmt.Errorf("insert keys: %d rows, want %d", tag.RowsAffected(), n)
	}
	if _, err := tx.Exec(ctx, `DELETE FROM idempotency_keys WHERE scope = $1 AND key = $2`, scaleScope, template); err != nil {
		return 0, 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, 0, err
	}
	insert = time.Since(t0)
	t1 := time.Now()
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE idempotency_keys"); err != nil {
		return 0, 0, err
	}
	if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
		return 0, 0, err
	}
	return insert, time.Since(t1), nil
}

// scaleOp returns the operation op of the scale mode on a table of n keys.
func scaleOp(r *txn.Runner, op string, n int) harness.Op {
	switch op {
	case ScaleRun:
		return func(ctx context.Context, _ int, _ int64) error {
			key := randomKey()
			resp, err := r.Run(ctx, orderKey(key), runFunc(key))
			if err == nil && resp.Replayed {
				err = errors.New("fresh key replayed")
			}
			return err
		}
	case ScaleReplay:
		return func(ctx context.Context, _ int, _ int64) error {
			key := ExistingKey(1 + rand.IntN(n))
			resp, err := r.Run(ctx, orderKey(key), runFunc(key))
			if err == nil && (!resp.Replayed || resp.Status != 201) {
				err = fmt.Errorf("finished key %s not replayed (status %d)", key, resp.Status)
			}
			return err
		}
	default: // ScaleResume
		return func(ctx context.Context, _ int, _ int64) error {
			key := ExistingKey(1 + rand.IntN(n))
			resp, err := r.Resume(ctx, scaleScope, key)
			if err == nil && (!resp.Replayed || resp.Status != 201) {
				err = fmt.Errorf("finished key %s not replayed by Resume (status %d)", key, resp.Status)
			}
			return err
		}
	}
}

// RunScale measures, for each size in sizes, Run on new keys, replays and
// Resume of finished keys beside that many finished keys, at each of the
// suite's concurrencies; then the relay's drain of drain pending messages
// (and of the suite's DrainMessages, the small backlog it is compared with).
func (s *Suite) RunScale(ctx context.Context, sizes []int, drain int) (*ScaleReport, error) {
	rep := &ScaleReport{Concurrency: s.Concurrency, Timing: s.Timing, Began: time.Now()}
	maxC := 1
	for _, c := range s.Concurrency {
		maxC = max(maxC, c)
	}
	for _, n := range sizes {
		p, err := s.scalePoint(ctx, n, maxC)
		if err != nil {
			return nil, fmt.Errorf("scale %d keys: %w", n, err)
		}
		rep.Points = append(rep.Points, p)
	}
	var backlogs []int
	if s.DrainMessages > 0 && s.DrainMessages < drain {
		backlogs = append(backlogs, s.DrainMessages)
	}
	if drain > 0 {
		backlogs = append(backlogs, drain)
	}
	for _, n := range backlogs {
		d, err := s.drainBacklog(ctx, n)
		if err != nil {
			return nil, fmt.Errorf("drain %d: %w", n, err)
		}
		rep.Drains = append(rep.Drains, d)
	}
	rep.Took = time.Since(rep.Began)
	return rep, nil
}

func (s *Suite) scalePoint(ctx context.Context, n, maxC int) (p ScalePoint, err error) {
	p = ScalePoint{Keys: n, Results: map[ScaleCell]harness.Result{}}
	cl, err := s.newCell(ctx, maxC)
	if err != nil {
		return p, err
	}
	defer cl.pool.Close()
	r, err := newRunner(cl.pool, nil)
	if err != nil {
		return p, err
	}
	s.Progress("scale: inserting %d finished keys", n)
	p.Insert, p.Maintain, err = insertScaleKeys(ctx, cl.pool, r, n)
	if err != nil {
		return p, err
	}
	if err := cl.pool.QueryRow(ctx, `SELECT pg_relation_size('idempotency_keys'),
		       pg_relation_size('idempotency_keys_scope_key_uniq'), pg_indexes_size('idempotency_keys')`).
		Scan(&p.HeapBytes, &p.KeyIndexBytes, &p.IndexBytes); err != nil {
		return p, err
	}
	s.Progress("scale: %d keys inserted in %v, VACUUM ANALYZE + CHECKPOINT %v; table %s, key index %s, all indexes %s",
		n, p.Insert.Round(time.Millisecond), p.Maintain.Round(time.Millisecond), mib(p.HeapBytes), mib(p.KeyIndexBytes), mib(p.IndexBytes))
	for _, c := range s.Concurrency {
		for _, op := range []string{ScaleReplay, ScaleResume, ScaleRun} {
			res := harness.Drive(ctx, c, s.Timing, cl.ctr, scaleOp(r, op, n))
			s.Progress("scale %9d keys  %-32s c=%-3d %8.0f ops/s  p50 %6s ms  p99 %6s ms  rt/op %.1f  errors %d",
				n, op, c, res.Throughput(), harness.FormatMs(res.Percentile(50)), harness.FormatMs(res.Percentile(99)), res.RoundTrips, res.Errors)
			if res.FirstError != nil {
				if res.Ops == 0 {
					return p, fmt.Errorf("%s: no operation succeeded: %w", op, res.FirstError)
				}
				s.Progress("%s: first error: %v", op, res.FirstError)
			}
			p.Results[ScaleCell{Op: op, C: c}] = res
			if err := ctx.Err(); err != nil {
				return p, err
			}
		}
	}
	p.Plans, err = explainKeyPath(ctx, cl.pool, n)
	return p, err
}

func mib(b int64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

// explainKeyPath returns EXPLAIN (ANALYZE, BUFFERS) of the request path's
// key lookup (LookupKey's statement) for a random finished key, and of the
// single-phase key insert (InsertFinishedSingleKey's) of a new key, the
// latter in a transaction that is rolled back.
func explainKeyPath(ctx context.Context, pool *pgxpool.Pool, n int) (string, error) {
	lookup := `EXPLAIN (ANALYZE, BUFFERS)
SELECT id, fingerprint, workflow, recovery_point, status,
       (lease_token IS NOT NULL AND leased_until > now())::boolean AS lease_live,
       coalesce(greatest(extract(epoch FROM leased_until - now()), 0), 0)::float8 AS lease_remaining_seconds,
       attempts, response_status, response_headers, response_body
FROM idempotency_keys
WHERE scope = $1 AND key = $2`
	insert := `EXPLAIN (ANALYZE, BUFFERS)
INSERT INTO idempotency_keys (
    scope, key, fingerprint, request_method, request_path, request_params_raw,
    workflow, recovery_point, phase_results, status, attempts, created_at,
    last_run_at, finished_at, response_status, response_headers, response_body)
SELECT $1, $2, sha256('x'), 'POST', '/orders', '{}'::bytea,
       '', 'finished', '{}'::jsonb, 'finished', 1, now(), now(), now(), 201, '{}'::jsonb, '{}'::bytea
WHERE atomicphase_refuse_tombstoned($1, $2)
RETURNING id`
	out := fmt.Sprintf("#### %d keys: key lookup (LookupKey) of a random finished key\n\n```\n", n)
	plan, err := explain(ctx, pool, lookup, scaleScope, ExistingKey(1+rand.IntN(n)))
	if err != nil {
		return "", fmt.Errorf("explain lookup: %w", err)
	}
	out += plan + "```\n\n" + fmt.Sprintf("#### %d keys: single-phase key insert (InsertFinishedSingleKey) of a new key, rolled back\n\n```\n", n)
	tx, err := pool.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // rolled back on purpose
	plan, err = explain(ctx, tx, insert, scaleScope, randomKey())
	if err != nil {
		return "", fmt.Errorf("explain insert: %w", err)
	}
	return out + plan + "```\n", nil
}

// querier is a pool or a transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// explain runs an EXPLAIN statement and returns its lines.
func explain(ctx context.Context, q querier, sql string, args ...any) (string, error) {
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return "", err
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "", err
	}
	var out string
	for _, l := range lines {
		out += l + "\n"
	}
	return out, nil
}

// drainBacklog commits n pending messages with one generate_series INSERT,
// in the form outbox.Enqueue writes them (topic, an 8-byte payload, no
// headers, no ordering key, message id and times from the column defaults
// and the database clock), then times the relay draining them to JetStream.
func (s *Suite) drainBacklog(ctx context.Context, n int) (DrainPoint, error) {
	d := DrainPoint{Messages: n}
	cl, err := s.newCell(ctx, 4)
	if err != nil {
		return d, err
	}
	defer cl.pool.Close()
	s.Progress("scale: inserting %d pending outbox messages", n)
	t0 := time.Now()
	if _, err := cl.pool.Exec(ctx, `
		INSERT INTO outbox_messages (topic, payload, headers, created_at, available_at)
		SELECT 'orders', int8send(g::bigint), '{}'::jsonb, now(), now()
		FROM generate_series(0, $1::int - 1) AS g`, n); err != nil {
		return d, fmt.Errorf("insert messages: %w", err)
	}
	if _, err := cl.pool.Exec(ctx, "VACUUM ANALYZE outbox_messages"); err != nil {
		return d, err
	}
	if _, err := cl.pool.Exec(ctx, "CHECKPOINT"); err != nil {
		return d, err
	}
	d.Insert = time.Since(t0)
	// The timeout allows for a slow relay: at least 1,000 messages a second.
	d.Took, err = s.relayDrain(ctx, cl, n, max(drainTimeout, time.Duration(n)*time.Millisecond))
	if err != nil {
		return d, err
	}
	s.Progress("scale: relay drained %d pending messages in %v (%.0f msg/s; inserted in %v)", n, d.Took.Round(time.Millisecond), d.Rate(), d.Insert.Round(time.Millisecond))
	return d, nil
}
