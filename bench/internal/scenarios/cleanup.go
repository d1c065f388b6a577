package scenarios

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
	"github.com/atomicphase/atomicphase/cleanup"
)

// insertExpired fills idempotency_keys with n finished keys that expired
// two days ago (older than the 24 h minimum TTL), in one statement, then
// analyzes the table as autovacuum would have and checkpoints.
func insertExpired(ctx context.Context, pool *pgxpool.Pool, n int) error {
	if _, err := pool.Exec(ctx, `
		INSERT INTO idempotency_keys (
		    scope, key, fingerprint, request_method, request_path, request_params,
		    workflow, recovery_point, phase_results, status, attempts,
		    created_at, last_run_at, finished_at,
		    response_status, response_headers, response_body)
		SELECT 'bench', 'expired-' || lpad(g::text, 9, '0'), sha256(g::text::bytea), 'POST', '/orders', '{"amount":100,"currency":"usd"}',
		       '', 'finished', '{}', 'finished', 1,
		       now() - interval '3 days', now() - interval '3 days',
		       now() - interval '2 days' - g * interval '1 millisecond',
		       201, '{}', '{"status":"created"}'::bytea
		FROM generate_series(1, $1::int) AS g`, n); err != nil {
		return fmt.Errorf("insert expired keys: %w", err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE idempotency_keys"); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, "CHECKPOINT")
	return err
}

// insertExpiredTombstones adds n tombstones that expired a day ago, one
// millisecond apart, in one statement, then analyzes the table and
// checkpoints.
func insertExpiredTombstones(ctx context.Context, pool *pgxpool.Pool, n int) error {
	if _, err := pool.Exec(ctx, `
		INSERT INTO idempotency_key_tombstones (scope, key_hash, fingerprint, finished_at, response_status, expires_at)
		SELECT 'bench', sha256(convert_to('gone-' || lpad(g::text, 9, '0'), 'UTF8')), sha256(g::text::bytea),
		       now() - interval '31 days', 201, now() - interval '1 day' - g * interval '1 millisecond'
		FROM generate_series(1, $1::int) AS g`, n); err != nil {
		return fmt.Errorf("insert expired tombstones: %w", err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE idempotency_key_tombstones"); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, "CHECKPOINT")
	return err
}

// RunCleanup runs scenario 5: the cleaner alone on n expired keys, then
// Run's latency at c=8 with the same n expired keys present, without and
// then with the cleaner deleting them.
func (s *Suite) RunCleanup(ctx context.Context) error {
	n := s.CleanupRows
	const c = 8
	t := &Table{
		Title:    fmt.Sprintf("5. Cleanup: deleting %d expired keys, and Run at c=%d while it runs", n, c),
		Unit:     "ops/s",
		RatioCol: "p99 ratio vs no cleanup",
	}
	cl, err := s.newCell(ctx, c)
	if err != nil {
		return err
	}
	defer cl.pool.Close()
	cleanerCfg := &cleanup.Config{Logger: harness.Discard, BatchSize: s.CleanupBatch, BatchPause: s.CleanupPause}
	batch := s.CleanupBatch
	if batch == 0 {
		batch = 1000
	}

	// (a) The cleaner alone.
	s.Progress("cleanup: inserting %d expired keys", n)
	tIns := time.Now()
	if err := insertExpired(ctx, cl.pool, n); err != nil {
		return err
	}
	s.Progress("cleanup: inserted, analyzed and checkpointed in %v", time.Since(tIns).Round(time.Millisecond))
	cleaner, err := cleanup.New(cl.pool, cleanerCfg)
	if err != nil {
		return err
	}
	t0 := time.Now()
	rep, err := cleaner.RunOnce(ctx)
	alone := time.Since(t0)
	if err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	rate := float64(rep.KeysDeleted) / alone.Seconds()
	s.Progress("cleanup alone: %d keys in %v (%.0f rows/s, %d batches)", rep.KeysDeleted, alone.Round(time.Millisecond), rate, rep.Batches)
	pace := ""
	if s.CleanupPause > 0 {
		pace = fmt.Sprintf(", pause %v", s.CleanupPause)
	}
	t.Rows = append(t.Rows, Row{System: fmt.Sprintf("cleaner alone, rows/s (batch %d%s, %d batches, %.1f s)", batch, pace, rep.Batches, alone.Seconds()),
		Throughput: rate, Ratio: math.NaN()})

	// (a2) The cleaner alone on n expired tombstones, beside the n live
	// ones (a) left: a steady state deletes as many tombstones a day as
	// keys, 30 days later.
	s.Progress("cleanup: inserting %d expired tombstones", n)
	if err := insertExpiredTombstones(ctx, cl.pool, n); err != nil {
		return err
	}
	t0 = time.Now()
	repT, err := cleaner.RunOnce(ctx)
	aloneT := time.Since(t0)
	if err != nil {
		return fmt.Errorf("cleanup of tombstones: %w", err)
	}
	rateT := float64(repT.TombstonesDeleted) / aloneT.Seconds()
	s.Progress("cleanup alone: %d expired tombstones in %v (%.0f rows/s, %d batches)", repT.TombstonesDeleted, aloneT.Round(time.Millisecond), rateT, repT.Batches)
	t.Rows = append(t.Rows, Row{System: fmt.Sprintf("cleaner alone on expired tombstones, rows/s (batch %d%s, %d batches, %.1f s)", batch, pace, repT.Batches, aloneT.Seconds()),
		Throughput: rateT, Ratio: math.NaN()})

	// (b) Run's latency with the expired keys present, no cleaner.
	if err := reset(ctx, cl.pool); err != nil {
		return err
	}
	n2 := s.CleanupLoadRows
	if n2 <= 0 {
		n2 = n
	}
	s.Progress("cleanup: inserting %d expired keys", n2)
	tIns = time.Now()
	if err := insertExpired(ctx, cl.pool, n2); err != nil {
		return err
	}
	s.Progress("cleanup: inserted, analyzed and checkpointed in %v", time.Since(tIns).Round(time.Millisecond))
	op, _, err := singlePhase.setup(ctx, s, cl, c)
	if err != nil {
		return err
	}
	base := harness.Drive(ctx, c, s.Timing, cl.ctr, op)
	s.Progress("Run without cleanup: %.0f ops/s p99 %s ms", base.Throughput(), harness.FormatMs(base.Percentile(99)))
	t.Rows = append(t.Rows, rowFrom("atomicphase Run, no cleanup", c, base, 1))

	// (c) The same, while the cleaner deletes the expired keys.
	if _, err := cl.pool.Exec(ctx, "CHECKPOINT"); err != nil {
		return err
	}
	cleaner2, err := cleanup.New(cl.pool, cleanerCfg)
	if err != nil {
		return err
	}
	cleanCtx, stopCleaner := context.WithCancel(ctx)
	defer stopCleaner()
	done := make(chan struct{})
	var rep2 cleanup.Report
	var err2 error
	var during time.Duration
	start := make(chan struct{})
	go func() {
		defer close(done)
		<-start
		t0 := time.Now()
		rep2, err2 = cleaner2.RunOnce(cleanCtx)
		during = time.Since(t0)
	}()
	timing := s.Timing
	// The window ends when the cleaner finishes, or after 4 cell durations
	// (at least 20 s), when the cleaner is stopped after its batch in flight.
	timing.Duration = max(2*s.Timing.Duration, 10*time.Second)
	timing.Stop = done
	timing.OnMeasure = func() { close(start) }
	under := harness.Drive(ctx, c, timing, cl.ctr, op)
	stopCleaner()
	<-done
	if err2 != nil && !errors.Is(err2, context.Canceled) {
		return fmt.Errorf("cleanup under load: %w", err2)
	}
	q := ratio(float64(under.Percentile(99)), float64(base.Percentile(99)))
	s.Progress("Run during cleanup: %.0f ops/s p99 %s ms (ratio %.2f); cleaner deleted %d in %v", under.Throughput(), harness.FormatMs(under.Percentile(99)), q, rep2.KeysDeleted, during.Round(time.Millisecond))
	r := rowFrom("atomicphase Run, during cleanup", c, under, q)
	r.Note = fmt.Sprintf("window %.1f s", under.Elapsed.Seconds())
	t.Rows = append(t.Rows, r)
	t.Rows = append(t.Rows, Row{System: fmt.Sprintf("cleaner under Run load, rows/s (%.1f s)", during.Seconds()),
		Throughput: float64(rep2.KeysDeleted) / during.Seconds(), Ratio: math.NaN()})

	t.Goals = append(t.Goals,
		Goal{Text: "cleanup ≥ 100k rows/s", Met: rate >= 100_000, Got: fmt.Sprintf("%.0f rows/s", rate)},
		Goal{Text: "Run p99 during cleanup ≤ 1.5× without", Met: q <= 1.5, Got: fmt.Sprintf("%.2f×", q)})
	t.Notes = append(t.Notes,
		fmt.Sprintf("Expired keys: %d finished keys inserted with generate_series, finished two days ago (TTL 24 h), then ANALYZE and CHECKPOINT; cleanup.Cleaner.RunOnce with BatchSize %d and BatchPause %v (one DELETE statement per batch). The Run rows use a fresh table of %d expired keys.", n, batch, cleanerCfg.BatchPause, n2),
		fmt.Sprintf("Expired tombstones: %d inserted with generate_series beside the %d live ones the first round left, expired a day ago, then ANALYZE and CHECKPOINT; a second RunOnce of the same cleaner.", n, rep.KeysDeleted),
		"The 'during cleanup' window starts with the cleaner and ends when it finishes, or after two cell durations (at least 10 s), when the cleaner is stopped; every measured Run overlapped it.")
	s.Tables = append(s.Tables, t)
	return nil
}
