package recovery_test

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

// newResumer returns a Resumer over a runner with registry and the
// default MaxAge.
func newResumer(t *testing.T, f *fixture, registry *txn.Registry, cfg recovery.Config) *recovery.Resumer {
	t.Helper()
	return newResumerWith(t, f.d.Pool, &txn.Config{Workflows: registry}, cfg)
}

// newResumerWith returns a Resumer over a new runner on pool with rc.
func newResumerWith(t *testing.T, pool *pgxpool.Pool, rc *txn.Config, cfg recovery.Config) *recovery.Resumer {
	t.Helper()
	rc.Logger = quiet
	runner, err := txn.New(pool, rc)
	require.NoError(t, err)
	cfg.Logger = quiet
	r, err := recovery.New(runner, &cfg)
	require.NoError(t, err)
	return r
}

func TestResumerResumesStalledKeyAtEachRecoveryPoint(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		failPhase string // the phase that fails on the first attempt
		point     string // the recovery point the key is left at
		crash     bool   // leave an expired lease behind, as a crashed process does
		ran       map[string]int
	}{
		{name: "after_phase_1_released", failPhase: "charge", point: "reserve",
			ran: map[string]int{"reserve": 1, "charge": 1, "finish": 1}},
		{name: "after_phase_2_crashed_with_expired_lease", failPhase: "finish", point: "charge", crash: true,
			ran: map[string]int{"reserve": 1, "charge": 1, "finish": 1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := newFixture(t)

			// An uninterrupted run of the same request, for comparison.
			want, err := f.runner.RunWorkflow(ctx, f.chargeKey("uninterrupted", 500), f.wf)
			require.NoError(t, err)

			f.failOnce("k1", tc.failPhase)
			_, err = f.runner.RunWorkflow(ctx, f.chargeKey("k1", 500), f.wf)
			require.ErrorIs(t, err, errTransient)
			require.Equal(t, tc.point, f.row(t, "k1").RecoveryPoint)
			f.stall(t, "k1")
			if tc.crash {
				f.exec(t, `UPDATE idempotency_keys SET lease_token = gen_random_uuid(),
					leased_until = now() - interval '1 second' WHERE key = 'k1'`)
			}
			callsBefore := f.calls.Load()

			rep, err := newResumer(t, f, f.registry, recovery.Config{}).RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, recovery.Report{Resumed: 1}, rep)
			require.Equal(t, callsBefore+1, f.calls.Load())

			row := f.row(t, "k1")
			require.Equal(t, "finished", row.Status)
			require.Equal(t, 2, row.Attempts)
			require.False(t, row.Leased)
			require.Equal(t, tc.ran, f.effects(t, "k1"), "each phase ran exactly once")

			// A client retry replays what an uninterrupted run stored.
			got, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 500), f.wf)
			require.NoError(t, err)
			require.True(t, got.Replayed)
			want.Replayed = true
			require.Equal(t, want, got)
			require.Equal(t, callsBefore+1, f.calls.Load(), "the retry ran nothing")
		})
	}
}

func TestResumerLeavesFreshRecentlyRunLeasedAndFinishedKeysAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)

	// Finished, long ago.
	_, err := f.runner.RunWorkflow(ctx, f.chargeKey("finished", 1), f.wf)
	require.NoError(t, err)
	f.exec(t, `UPDATE idempotency_keys SET last_run_at = now() - interval '2 hours',
		created_at = now() - interval '20 hours' WHERE key = 'finished'`)

	// Recently run: released after a transient error a moment ago.
	f.failOnce("recent", "charge")
	_, err = f.runner.RunWorkflow(ctx, f.chargeKey("recent", 2), f.wf)
	require.ErrorIs(t, err, errTransient)

	// Held by a live lease although it last ran long ago, and past every
	// failure rule: a live holder is never raced.
	f.failOnce("leased", "charge")
	_, err = f.runner.RunWorkflow(ctx, f.chargeKey("leased", 3), f.wf)
	require.ErrorIs(t, err, errTransient)
	f.exec(t, `UPDATE idempotency_keys SET lease_token = gen_random_uuid(), leased_until = now() + interval '1 hour',
		last_run_at = now() - interval '2 hours', created_at = now() - interval '20 hours', attempts = 99
		WHERE key = 'leased'`)

	// Fresh: its first attempt is in progress, waiting on the provider.
	release := f.blockForeign("fresh")
	defer release()
	var wg sync.WaitGroup
	var freshResp txn.Response
	var freshErr error
	wg.Go(func() { freshResp, freshErr = f.runner.RunWorkflow(ctx, f.chargeKey("fresh", 4), f.wf) })
	require.Equal(t, "fresh", <-f.waits)

	before := f.snapshot(t)
	r := newResumerWith(t, f.d.Pool, &txn.Config{Workflows: f.registry, MaxAge: time.Hour}, recovery.Config{MaxAttempts: 2})
	rep, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{}, rep)
	dry, err := r.DryRun(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{}, dry)
	require.Equal(t, before, f.snapshot(t), "no key row changed")

	release()
	wg.Wait()
	require.NoError(t, freshErr)
	require.Equal(t, 201, freshResp.Status)
	require.Equal(t, 1, f.row(t, "fresh").Attempts)
}

func TestConcurrentResumersResumeEachKeyExactlyOnce(t *testing.T) {
	t.Parallel()
	const keys, expired, resumers = 1000, 200, 4
	ctx := context.Background()
	f := newFixture(t)

	// Stalled keys of the registered workflow, created in bulk as a crashed
	// fleet would leave them: running, at "started", lease free or expired.
	f.exec(t, `
		INSERT INTO idempotency_keys (scope, key, fingerprint, request_method, request_path, request_params,
			workflow, recovery_point, status, lease_token, leased_until, attempts, created_at, last_run_at)
		SELECT current_schema(), 'bulk-' || i, sha256(convert_to('bulk-' || i, 'UTF8')), 'POST', '/charges',
			jsonb_build_object('amount', i), 'charge', 'started', 'running',
			CASE WHEN i % 2 = 0 THEN gen_random_uuid() END,
			CASE WHEN i % 2 = 0 THEN now() - interval '5 minutes' END,
			1, now() - interval '10 minutes', now() - interval '10 minutes'
		FROM generate_series(1, $1::int) AS i`, keys)
	// And some past MaxAge, which must be failed exactly once each.
	f.exec(t, `
		INSERT INTO idempotency_keys (scope, key, fingerprint, request_method, request_path, workflow,
			status, attempts, created_at, last_run_at)
		SELECT current_schema(), 'old-' || i, sha256(convert_to('old-' || i, 'UTF8')), 'POST', '/charges', 'charge',
			'running', 1, now() - interval '13 hours', now() - interval '10 minutes'
		FROM generate_series(1, $1::int) AS i`, expired)

	reports := make([]recovery.Report, resumers)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range resumers {
		// Each resumer has its own pool, as separate processes would.
		pool := f.d.NewPool(t, func(c *pgxpool.Config) { c.MaxConns = 6 })
		r := newResumerWith(t, pool, &txn.Config{Workflows: f.registry}, recovery.Config{BatchSize: 50})
		wg.Go(func() {
			<-start
			rep, err := r.RunOnce(ctx)
			require.NoError(t, err)
			reports[i] = rep
		})
	}
	began := time.Now()
	close(start)
	wg.Wait()
	elapsed := time.Since(began)

	var total recovery.Report
	for i, rep := range reports {
		t.Logf("resumer %d: %+v", i, rep)
		total.Resumed += rep.Resumed
		total.FailedMaxAge += rep.FailedMaxAge
		total.Errors += rep.Errors
		total.Skipped += rep.Skipped
	}
	t.Logf("%d keys resumed by %d resumers in %v (%.0f keys/s)", total.Resumed, resumers, elapsed,
		float64(total.Resumed)/elapsed.Seconds())
	require.Equal(t, expired, total.FailedMaxAge, "every expired key failed once")
	require.Zero(t, total.Skipped, "no resumer was handed a key another one had claimed")

	require.Zero(t, total.Errors, "no resume failed (unrelated keys do not conflict)")
	require.Equal(t, keys, total.Resumed, "every key resumed, none missed")
	require.Equal(t, keys, f.d.Count(t, `SELECT count(*) FROM idempotency_keys
		WHERE key LIKE 'bulk-%' AND status = 'finished' AND attempts = 2`), "each key taken over exactly once")
	require.Equal(t, 3*keys, f.d.Count(t, `SELECT count(*) FROM effects`))
	require.Zero(t, f.d.Count(t, `SELECT count(*) FROM (SELECT key, phase FROM effects
		GROUP BY key, phase HAVING count(*) <> 1) AS dup`), "no phase ran twice for a key")
	require.Equal(t, keys, f.d.Count(t, `SELECT count(DISTINCT key) FROM effects WHERE phase = 'finish'`))
}

// requireFailure checks that resp is the stored failure for reason.
func requireFailure(t *testing.T, resp txn.Response, reason string) {
	t.Helper()
	require.True(t, resp.Replayed)
	require.Equal(t, recovery.FailureStatus, resp.Status)
	require.Equal(t, "application/problem+json", resp.Header.Get("Content-Type"))
	var body struct {
		Title, Detail, Reason string
		Status                int
	}
	require.NoError(t, json.Unmarshal(resp.Body, &body))
	require.Equal(t, reason, body.Reason)
	require.Equal(t, recovery.FailureStatus, body.Status)
	require.Contains(t, body.Detail, "could not be completed")
	require.NotEmpty(t, body.Title)
}

func TestResumerFailsKeyAtMaxAttemptsAndRetryReplaysFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	r := newResumer(t, f, f.registry, recovery.Config{MaxAttempts: 2})

	f.failOnce("k1", "charge")
	_, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 7), f.wf) // attempt 1
	require.ErrorIs(t, err, errTransient)
	f.stall(t, "k1")
	f.failOnce("k1", "charge")
	rep, err := r.RunOnce(ctx) // attempt 2, fails again
	require.NoError(t, err)
	require.Equal(t, recovery.Report{Errors: 1}, rep)
	f.stall(t, "k1")

	rep, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{FailedMaxAttempts: 1}, rep)
	row := f.row(t, "k1")
	require.Equal(t, keyRow{Status: "failed", RecoveryPoint: "reserve", FailureReason: recovery.ReasonMaxAttempts,
		Attempts: 2, ResponseStatus: recovery.FailureStatus}, row)

	calls := f.calls.Load()
	resp, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 7), f.wf)
	require.NoError(t, err)
	requireFailure(t, resp, recovery.ReasonMaxAttempts)
	require.Equal(t, calls, f.calls.Load(), "the workflow did not run again")
	require.Equal(t, map[string]int{"reserve": 1}, f.effects(t, "k1"))
}

func TestResumerFailsKeyPastMaxAgeAndRetryReplaysFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)

	f.failOnce("k1", "charge")
	_, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 7), f.wf)
	require.ErrorIs(t, err, errTransient)
	f.exec(t, `UPDATE idempotency_keys SET created_at = now() - interval '12 hours 1 minute',
		last_run_at = now() - interval '1 hour' WHERE key = 'k1'`)

	rep, err := newResumer(t, f, f.registry, recovery.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{FailedMaxAge: 1}, rep)
	require.Equal(t, recovery.ReasonMaxAge, f.row(t, "k1").FailureReason)

	calls := f.calls.Load()
	resp, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 7), f.wf)
	require.NoError(t, err)
	requireFailure(t, resp, recovery.ReasonMaxAge)
	require.Equal(t, calls, f.calls.Load(), "the workflow did not run again")
	require.Equal(t, map[string]int{"reserve": 1}, f.effects(t, "k1"), "the charge was never made")
}

// A workflow that fails before its first commit leaves no key (its key
// goes in with that commit): the Resumer has nothing to resume, and the
// client's retry runs the operation as a first attempt.
func TestResumerFindsNoKeyAfterAFailureBeforeTheFirstCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	f.failOnce("k1", "reserve")
	_, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 7), f.wf)
	require.ErrorIs(t, err, errTransient)
	require.Zero(t, f.d.Count(t, `SELECT count(*) FROM idempotency_keys`))

	rep, err := newResumer(t, f, f.registry, recovery.Config{ResumeDelay: time.Nanosecond}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{}, rep)

	resp, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 7), f.wf)
	require.NoError(t, err)
	require.False(t, resp.Replayed)
	require.Equal(t, 1, f.row(t, "k1").Attempts)
	require.Equal(t, map[string]int{"reserve": 1, "charge": 1, "finish": 1}, f.effects(t, "k1"))
}

func TestResumerFailsUnregisteredWorkflowAfterDelayAndRetryReplaysFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	// A process without the service's code: its registry is empty.
	generic := newResumer(t, f, txn.NewRegistry(), recovery.Config{})

	f.failOnce("k1", "charge")
	_, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 7), f.wf)
	require.ErrorIs(t, err, errTransient)
	f.stall(t, "k1")

	// Younger than UnknownWorkflowDelay: left for a resumer that has the workflow.
	before := f.snapshot(t)
	rep, err := generic.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{Left: 1}, rep)
	require.Equal(t, before, f.snapshot(t))

	f.exec(t, `UPDATE idempotency_keys SET created_at = now() - interval '61 minutes' WHERE key = 'k1'`)
	rep, err = generic.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{FailedUnknownWorkflow: 1}, rep)
	require.Equal(t, recovery.ReasonUnknownWorkflow, f.row(t, "k1").FailureReason)

	// The service's own retry replays the failure.
	calls := f.calls.Load()
	resp, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 7), f.wf)
	require.NoError(t, err)
	requireFailure(t, resp, recovery.ReasonUnknownWorkflow)
	require.Equal(t, calls, f.calls.Load(), "the workflow did not run again")
	require.Equal(t, map[string]int{"reserve": 1}, f.effects(t, "k1"))
}

func TestResumerFailsRunningSinglePhaseKeyAndRunReplaysFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	key := txn.Key{Scope: f.d.Schema, Value: "single", Method: "POST", Path: "/orders", Params: []byte(`{"n":1}`)}
	ran := 0
	fn := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		ran++
		return txn.JSON(201, map[string]int{"n": 1})
	}
	_, err := f.runner.Run(ctx, key, fn)
	require.NoError(t, err)
	// A single-phase key is never visible while running; make one anyway,
	// as a bug or a manual edit would, and let it age past the delay.
	f.exec(t, `UPDATE idempotency_keys SET status = 'running', finished_at = NULL, response_status = NULL,
		response_headers = NULL, response_body = NULL, created_at = now() - interval '2 hours',
		last_run_at = now() - interval '2 hours' WHERE key = 'single'`)

	rep, err := newResumer(t, f, f.registry, recovery.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{FailedUnknownWorkflow: 1}, rep)

	resp, err := f.runner.Run(ctx, key, fn)
	require.NoError(t, err)
	requireFailure(t, resp, recovery.ReasonUnknownWorkflow)
	require.Equal(t, 1, ran, "fn did not run again")
}

func TestResumeThatFailsTransientlyLeavesKeyResumableWithAttemptsIncremented(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	r := newResumer(t, f, f.registry, recovery.Config{})

	f.failOnce("k1", "charge")
	_, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 9), f.wf)
	require.ErrorIs(t, err, errTransient)
	f.stall(t, "k1")

	f.failOnce("k1", "charge")
	rep, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{Errors: 1}, rep)
	require.Equal(t, keyRow{Status: "running", RecoveryPoint: "reserve", Attempts: 2}, f.row(t, "k1"))

	// Just released, so not stalled yet: the next round leaves it alone.
	rep, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{}, rep)

	f.stall(t, "k1")
	rep, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{Resumed: 1}, rep)
	require.Equal(t, keyRow{Status: "finished", RecoveryPoint: "finished", Attempts: 3, ResponseStatus: 201}, f.row(t, "k1"))
	require.Equal(t, map[string]int{"reserve": 1, "charge": 1, "finish": 1}, f.effects(t, "k1"))
}

func TestResumerDryRunCountsWithoutChangingAnything(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	for _, k := range []string{"resume", "attempts", "age", "unknown", "young_unknown"} {
		f.failOnce(k, "charge")
		_, err := f.runner.RunWorkflow(ctx, f.chargeKey(k, 1), f.wf)
		require.ErrorIs(t, err, errTransient)
		f.stall(t, k)
	}
	f.exec(t, `UPDATE idempotency_keys SET attempts = 10 WHERE key = 'attempts'`)
	f.exec(t, `UPDATE idempotency_keys SET created_at = now() - interval '13 hours' WHERE key = 'age'`)
	f.exec(t, `UPDATE idempotency_keys SET workflow = 'gone', created_at = now() - interval '2 hours' WHERE key = 'unknown'`)
	f.exec(t, `UPDATE idempotency_keys SET workflow = 'gone' WHERE key = 'young_unknown'`)

	r := newResumer(t, f, f.registry, recovery.Config{})
	before := f.snapshot(t)
	dry, err := r.DryRun(ctx)
	require.NoError(t, err)
	want := recovery.Report{Resumed: 1, FailedMaxAttempts: 1, FailedMaxAge: 1, FailedUnknownWorkflow: 1, Left: 1}
	require.Equal(t, want, dry)
	require.Equal(t, before, f.snapshot(t))

	rep, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, want, rep, "a real round does what the dry run said")
}

func TestResumerStartRunsRoundsUntilStop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	r := newResumer(t, f, f.registry, recovery.Config{Interval: 20 * time.Millisecond})
	pgtest.WithLoopLabel(t, ctx, func(ctx context.Context) { require.NoError(t, r.Start(ctx)) })
	require.ErrorIs(t, r.Start(ctx), recovery.ErrAlreadyStarted)

	f.failOnce("k1", "charge")
	_, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 1), f.wf)
	require.ErrorIs(t, err, errTransient)
	f.stall(t, "k1")
	require.Eventually(t, func() bool { return f.row(t, "k1").Status == "finished" }, 10*time.Second, 10*time.Millisecond)

	require.Equal(t, 1, pgtest.LoopsRunning(t), "the loop runs")
	r.Stop()
	// Stop returned after the loop did: no round can start any more.
	require.Zero(t, pgtest.LoopsRunning(t), "no round runs after Stop")
	r.Stop() // idempotent
	f.failOnce("k2", "charge")
	_, err = f.runner.RunWorkflow(ctx, f.chargeKey("k2", 1), f.wf)
	require.ErrorIs(t, err, errTransient)
	f.stall(t, "k2")
	require.Equal(t, "running", f.row(t, "k2").Status)

	// Restartable; a cancelled context ends the loop too.
	cctx, cancel := context.WithCancel(ctx)
	require.NoError(t, r.Start(cctx))
	require.Eventually(t, func() bool { return f.row(t, "k2").Status == "finished" }, 10*time.Second, 10*time.Millisecond)
	cancel()
	r.Stop()
}

// A Resumer whose Start context ended is no longer running: it starts
// again without a Stop in between, and only a running one refuses.
func TestResumerWhoseContextEndedStartsAgain(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := newResumer(t, f, f.registry, recovery.Config{Interval: time.Hour})
	t.Cleanup(r.Stop)
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, r.Start(ctx))
	cancel()
	require.Eventually(t, func() bool { return r.Start(context.Background()) == nil }, 10*time.Second, 5*time.Millisecond,
		"Start still refuses after its context ended")
	require.ErrorIs(t, r.Start(context.Background()), recovery.ErrAlreadyStarted)
}

func TestResumerRunOnceReportsCancellation(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := newResumer(t, f, f.registry, recovery.Config{}).RunOnce(ctx)
	require.ErrorIs(t, err, context.Canceled)
}

// The Resumer takes MaxAge from the service's runner, so recovery and a
// client retry draw the line at the same age, and fail a key with the same
// stored response.
func TestResumerFollowsTheRunnersMaxAge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	runner, err := txn.New(f.d.Pool, &txn.Config{Workflows: f.registry, Logger: quiet, MaxAge: time.Hour})
	require.NoError(t, err)
	r, err := recovery.New(runner, &recovery.Config{Logger: quiet})
	require.NoError(t, err)

	for _, key := range []string{"old", "young", "retried"} {
		f.failOnce(key, "charge")
		_, err := runner.RunWorkflow(ctx, f.chargeKey(key, 7), f.wf)
		require.ErrorIs(t, err, errTransient)
	}
	f.exec(t, `UPDATE idempotency_keys SET created_at = now() - interval '2 hours', last_run_at = now() - interval '1 hour' WHERE key = 'old'`)
	f.exec(t, `UPDATE idempotency_keys SET created_at = now() - interval '30 minutes', last_run_at = now() - interval '10 minutes' WHERE key = 'young'`)
	// Last run a moment ago: the Resumer leaves it to the client.
	f.exec(t, `UPDATE idempotency_keys SET created_at = now() - interval '2 hours', last_run_at = now() WHERE key = 'retried'`)

	rep, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{Resumed: 1, FailedMaxAge: 1, Left: 0}, rep)
	require.Equal(t, recovery.ReasonMaxAge, f.row(t, "old").FailureReason)
	require.Equal(t, "finished", f.row(t, "young").Status)

	resp, err := runner.RunWorkflow(ctx, f.chargeKey("retried", 7), f.wf)
	require.NoError(t, err)
	require.Equal(t, recovery.FailureStatus, resp.Status)
	require.Equal(t, recovery.ReasonMaxAge, f.row(t, "retried").FailureReason)
	byResumer, err := runner.RunWorkflow(ctx, f.chargeKey("old", 7), f.wf)
	require.NoError(t, err)
	require.Equal(t, byResumer.Body, resp.Body, "one failure shape, whoever stored it")
	require.Contains(t, string(resp.Body), "1h0m0s")
	require.Empty(t, f.effects(t, "retried")["charge"], "no foreign call past MaxAge")
}

// A round is one span, the parent of the runner's span for each key it
// resumes, with the counts of the round.
func TestResumerRoundIsASpanOverItsResumes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t)
	f.failOnce("k1", "charge")
	_, err := f.runner.RunWorkflow(ctx, f.chargeKey("k1", 500), f.wf)
	require.ErrorIs(t, err, errTransient)
	f.stall(t, "k1")

	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	r := newResumerWith(t, f.d.Pool, &txn.Config{Workflows: f.registry, TracerProvider: tp},
		recovery.Config{TracerProvider: tp})
	rep, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{Resumed: 1}, rep)

	byName := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range spans.Ended() {
		byName[s.Name()] = s
	}
	round, resume := byName[telemetry.SpanRecovery], byName[telemetry.SpanResume]
	require.NotNil(t, round)
	require.NotNil(t, resume)
	require.Equal(t, round.SpanContext().SpanID(), resume.Parent().SpanID(), "the resume runs under the round")
	require.Contains(t, round.Attributes(), attribute.Int("atomicphase.resumed", 1))
}
