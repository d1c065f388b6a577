package txn_test

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/internal/phasectx"
	"github.com/atomicphase/atomicphase/internal/txnhook"
	"github.com/atomicphase/atomicphase/txn"
)

func TestKeyUsedByAnotherWorkflowIsKeyReused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	var calls atomic.Int64
	_, err := e.runner.Run(ctx, rideKey("k1"), insertCharge(&calls, "c1", 1))
	require.NoError(t, err)
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, txn.ErrKeyReused)
	require.Equal(t, int64(0), f.p1.Load())
}

func TestLiveWorkflowLeaseGivesKeyInUseWithRetryAfter(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{LeaseDuration: time.Minute})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	entered, release := make(chan struct{}), make(chan struct{})
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "after_p1" {
			close(entered)
			<-release
		}
	}
	done := make(chan error, 1)
	go func() { _, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf); done <- err }()
	<-entered

	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, txn.ErrKeyInUse)
	var kse *txn.KeyStateError
	require.ErrorAs(t, err, &kse)
	require.Equal(t, "ride_created", kse.RecoveryPoint)
	require.Equal(t, txn.KeyRunning, kse.Status)
	require.Greater(t, kse.RetryAfter, 30*time.Second, "Retry-After follows the holder's lease")

	f.hook = nil
	close(release)
	require.NoError(t, <-done)
}

func TestExpiredLeaseCanBeTakenOverLiveOneCannot(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{LeaseDuration: time.Hour})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("after_p1")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	// Simulate a crashed holder: a live lease nobody will release.
	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET lease_token = gen_random_uuid(), leased_until = now() + interval '1 hour'`)
	require.NoError(t, err)
	f.failAt.Store("")
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, txn.ErrKeyInUse)

	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET leased_until = now() - interval '1 millisecond'`)
	require.NoError(t, err)
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), f.p1.Load())
}

func TestTerminalResponsesAreStoredAndReplayed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.declined = true
	resp, err := e.runner.RunWorkflow(ctx, rideKey("declined"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 402, resp.Status)
	again, err := e.runner.RunWorkflow(ctx, rideKey("declined"), f.wf)
	require.NoError(t, err)
	require.True(t, again.Replayed)
	require.Equal(t, resp.Body, again.Body)
	require.Equal(t, int64(1), f.p1.Load())
	k := readKey(t, e.Pool, "user_1", "declined")
	require.Equal(t, "finished", k.Status)
	require.Equal(t, "ride_created", k.RecoveryPoint, "stored where the workflow stopped")

	// A 5xx the operation chooses to return is terminal too.
	var calls atomic.Int64
	r5, err := e.runner.Run(ctx, chargeKey("five", 1), func(context.Context, pgx.Tx) (txn.Response, error) {
		calls.Add(1)
		return txn.JSON(503, map[string]string{"error": "upstream unavailable"})
	})
	require.NoError(t, err)
	require.Equal(t, 503, r5.Status)
	r5b, err := e.runner.Run(ctx, chargeKey("five", 1), insertCharge(&calls, "c", 1))
	require.NoError(t, err)
	require.True(t, r5b.Replayed)
	require.Equal(t, 503, r5b.Status)
	require.Equal(t, int64(1), calls.Load())
}

func TestTransientErrorReleasesKeyAndRetryResumes(t *testing.T) {
	t.Parallel()
	for _, point := range []string{"after_p1", "foreign", "after_p2", "in_p3"} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			f := newRideFlow(t, e.reg, "ride")
			f.failAt.Store(point)
			_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
			require.ErrorIs(t, err, errInjected)
			k := readKey(t, e.Pool, "user_1", "k1")
			require.Equal(t, "running", k.Status)
			require.False(t, k.LeaseHeld, "released")
			wantPoint := map[string]string{"after_p1": "ride_created", "foreign": "ride_created", "after_p2": "charge_created", "in_p3": "charge_created"}[point]
			require.Equal(t, wantPoint, k.RecoveryPoint, "recovery point intact")
			require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%'`), "the failed phase rolled back")

			f.failAt.Store("")
			resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
			require.NoError(t, err)
			require.Equal(t, 201, resp.Status)
			require.Equal(t, int64(1), f.p1.Load(), "phase 1 ran once")
			require.Equal(t, 1, f.prov.distinct(), "one charge at the provider")
			require.Equal(t, int64(1), f.prov.calls.Load(),
				"one call: a result in hand when the attempt failed was recorded by its release")
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'ride'`))
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%'`))
			require.Equal(t, 2, readKey(t, e.Pool, "user_1", "k1").Attempts)
		})
	}
}

func TestPanicIsTransient(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	_, err := e.runner.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('x', 1)`); err != nil {
			return txn.Response{}, err
		}
		panic("boom")
	})
	require.ErrorIs(t, err, txn.ErrPanicked)
	var pe *txn.PanicError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, "boom", pe.Value)
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM charges`))
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM idempotency_keys`))

	f := newRideFlow(t, e.reg, "ride")
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "after_p2" {
			panic("boom in workflow")
		}
	}
	_, err = e.runner.RunWorkflow(ctx, rideKey("k2"), f.wf)
	require.ErrorIs(t, err, txn.ErrPanicked)
	k := readKey(t, e.Pool, "user_1", "k2")
	require.Equal(t, "charge_created", k.RecoveryPoint)
	require.False(t, k.LeaseHeld)
	f.hook = nil
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k2"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
}

func TestCancelledContextStillReleasesKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	cctx, cancel := context.WithCancel(ctx)
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "after_p1" {
			cancel() // the client went away mid-operation
		}
	}
	_, err := e.runner.RunWorkflow(cctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, context.Canceled)
	k := readKey(t, e.Pool, "user_1", "k1")
	require.Equal(t, "ride_created", k.RecoveryPoint)
	require.False(t, k.LeaseHeld, "released on a fresh context")
	f.hook = nil
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), f.p1.Load())
}

func TestTimesComeFromTheDatabaseClock(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	// Give this schema a database clock ten days ahead of the application's:
	// with pg_catalog after the schema in search_path, now() resolves here.
	_, err := e.Pool.Exec(ctx, `CREATE FUNCTION now() RETURNS timestamptz LANGUAGE sql STABLE
		AS $$ SELECT pg_catalog.now() + interval '10 days' $$`)
	require.NoError(t, err)
	pool := e.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["search_path"] = e.Schema + ", pg_catalog" })
	reg := txn.NewRegistry()
	r, err := txn.New(pool, &txn.Config{Workflows: reg, LeaseDuration: time.Hour})
	require.NoError(t, err)
	f := newRideFlow(t, reg, "ride")
	f.failAt.Store("after_p1")
	_, err = r.RunWorkflow(ctx, rideKey("wf"), f.wf)
	require.ErrorIs(t, err, errInjected)
	var calls atomic.Int64
	_, err = r.Run(ctx, chargeKey("single", 1), insertCharge(&calls, "c", 1))
	require.NoError(t, err)

	appNow := time.Now()
	rows, err := e.Pool.Query(ctx, `SELECT created_at, last_run_at, coalesce(finished_at, last_run_at) FROM idempotency_keys`)
	require.NoError(t, err)
	for rows.Next() {
		var ts [3]time.Time
		require.NoError(t, rows.Scan(&ts[0], &ts[1], &ts[2]))
		for _, tm := range ts {
			require.InDelta(t, (10 * 24 * time.Hour).Hours(), tm.Sub(appNow).Hours(), 1, "timestamp %v is not from the database clock", tm)
		}
	}
	require.NoError(t, rows.Err())

	// Leases are judged by the same clock: a lease set by the shifted clock
	// is live by it, although it ended long ago by the unshifted one.
	_, err = pool.Exec(ctx, `UPDATE idempotency_keys SET lease_token = gen_random_uuid(), leased_until = now() + interval '1 minute' WHERE key = 'wf'`)
	require.NoError(t, err)
	f.failAt.Store("")
	_, err = r.RunWorkflow(ctx, rideKey("wf"), f.wf)
	require.ErrorIs(t, err, txn.ErrKeyInUse)
}

func TestFiftyGoroutinesOnOneWorkflowKeyRunEachPhaseOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	start := make(chan struct{})
	var wg sync.WaitGroup
	var ok, inUse atomic.Int64
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
			switch {
			case err == nil:
				ok.Add(1)
			case errors.Is(err, txn.ErrKeyInUse):
				inUse.Add(1)
			default:
				t.Errorf("unexpected: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	require.GreaterOrEqual(t, ok.Load(), int64(1))
	// The first phase takes the key with its first statement: a call that
	// loses the key's lock has run its phase up to that statement, which
	// never ran (the lock's error aborted the transaction before it). A call
	// whose lookup came just before the winner committed takes the lock
	// after it, and runs its phase in a transaction that is rolled back
	// (its key row's insert meets the winner's): only the winner's writes
	// commit.
	require.GreaterOrEqual(t, f.p1Wrote.Load(), int64(1))
	require.LessOrEqual(t, f.p1.Load(), int64(50), "a call that lost the key once does not run the phase again")
	require.Equal(t, int64(1), f.p3.Load())
	require.Equal(t, int64(1), f.prov.calls.Load())
	require.Equal(t, 2, e.Count(t, `SELECT count(*) FROM charges`))
}

// uninterrupted runs the ride workflow once, start to end, in a fresh schema.
func uninterrupted(t *testing.T) txn.Response {
	e := newEnv(t, nil)
	f := newRideFlow(t, e.reg, "ride")
	resp, err := e.runner.RunWorkflow(ctxT(t), rideKey("k1"), f.wf)
	require.NoError(t, err)
	return resp
}

func TestWorkflowInterruptedAfterPhaseResumesToSameResponse(t *testing.T) {
	t.Parallel()
	want := uninterrupted(t)
	for _, point := range []string{"after_p1", "after_p2"} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			f := newRideFlow(t, e.reg, "ride")
			f.failAt.Store(point)
			_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
			require.ErrorIs(t, err, errInjected)
			f.failAt.Store("")
			got, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
			require.NoError(t, err)
			require.Equal(t, want.Status, got.Status)
			require.Equal(t, want.Header, got.Header)
			require.JSONEq(t, string(want.Body), string(got.Body))
			require.Equal(t, int64(1), f.p1.Load(), "phase 1 side effects exist once")
			require.Equal(t, 1, f.prov.distinct(), "phase 2 charged once")
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'ride'`))
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%'`))
			// Resume via the recovery path gives the same stored answer.
			again, err := e.runner.Resume(ctx, "user_1", "k1")
			require.NoError(t, err)
			require.True(t, again.Replayed)
			require.Equal(t, got.Body, again.Body)
		})
	}
}

func TestResumeContinuesWithStoredParams(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("after_p1")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	f.failAt.Store("")
	resp, err := e.runner.Resume(ctx, "user_1", "k1")
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Contains(t, string(resp.Body), `"amount":1250`)

	_, err = e.runner.Resume(ctx, "user_1", "missing")
	require.ErrorIs(t, err, txn.ErrKeyNotFound)

	// A key whose workflow is not registered in this runner.
	other := txn.NewRegistry()
	r2, err := txn.New(e.Pool, &txn.Config{Workflows: other})
	require.NoError(t, err)
	f.failAt.Store("after_p1")
	_, err = e.runner.RunWorkflow(ctx, rideKey("k2"), f.wf)
	require.ErrorIs(t, err, errInjected)
	_, err = r2.Resume(ctx, "user_1", "k2")
	require.ErrorIs(t, err, txn.ErrUnknownWorkflow)
}

func TestConnectionsCutMidPhaseLoseNothingAndDuplicateNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	proxy, pool := e.NewProxy(t)
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	f := newRideFlow(t, e.reg, "ride")
	var cut atomic.Bool
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "in_p3" && cut.CompareAndSwap(false, true) {
			proxy.CutAll() // the database goes away mid-phase
		}
	}
	_, err = r.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.Error(t, err)
	// The release could not reach the database either: the lease must
	// expire before a retry can take over.
	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET leased_until = now() - interval '1 second' WHERE lease_token IS NOT NULL`)
	require.NoError(t, err)
	resp, err := r.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), f.p1.Load())
	require.Equal(t, 1, f.prov.distinct())
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%'`))
}

// validatingFlow is a workflow that validates its params before any phase
// (400 when amount is not positive), then runs an atomic phase, a foreign
// call and the final phase. reject makes it answer 422 at a chosen point.
type validatingFlow struct {
	wf      *txn.Workflow
	reject  atomic.Value // "", "after_phase", "after_foreign_error", "in_finish"
	foreign atomic.Int64
}

func newValidatingFlow(t *testing.T, reg *txn.Registry) *validatingFlow {
	t.Helper()
	f := &validatingFlow{}
	f.reject.Store("")
	f.wf = txn.NewWorkflow("validating", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		var in struct {
			Amount int `json:"amount"`
		}
		if err := jsonUnmarshal(a.Params(), &in); err != nil || in.Amount <= 0 {
			return txn.JSON(400, map[string]string{"error": "amount must be positive"})
		}
		if f.reject.Load() == "after_foreign_error" {
			_, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (string, error) {
				f.foreign.Add(1)
				return "", errDeclined // the provider may have acted before failing
			})
			if errors.Is(err, errDeclined) {
				return txn.JSON(422, map[string]string{"error": "card rejected"})
			}
			return txn.Response{}, err
		}
		id, err := txn.Atomic(ctx, a, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO charges (ref, amount) VALUES ('reserve', $1) RETURNING id`, in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		if f.reject.Load() == "after_phase" {
			return txn.JSON(422, map[string]any{"error": "too late", "id": id})
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			return txn.JSON(201, map[string]any{"id": id})
		})
	})
	require.NoError(t, reg.Register(f.wf))
	return f
}

func amountKey(value, params string) txn.Key {
	return txn.Key{Scope: "user_1", Value: value, Method: "POST", Path: "/charges", Params: []byte(params)}
}

// A rejection a client is expected to correct (txn.DefaultStore), given
// before anything took effect, leaves no key: the corrected request runs
// under the same key. The same policy as a single-phase run.
func TestWorkflowRejectionBeforeAnyPhaseLeavesNoKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newValidatingFlow(t, e.reg)

	resp, err := e.runner.RunWorkflow(ctx, amountKey("k1", `{"amount":0}`), f.wf)
	require.NoError(t, err)
	require.Equal(t, 400, resp.Status)
	require.False(t, resp.Replayed)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`), "no key left")
	require.Equal(t, uint64(1), e.runner.Stats().NotStored)

	resp, err = e.runner.RunWorkflow(ctx, amountKey("k1", `{"amount":5}`), f.wf)
	require.NoError(t, err, "the corrected request is not ErrKeyReused")
	require.Equal(t, 201, resp.Status)
	replay, err := e.runner.RunWorkflow(ctx, amountKey("k1", `{"amount":5}`), f.wf)
	require.NoError(t, err)
	require.True(t, replay.Replayed)

	// Single phase: the same policy, and the function's writes roll back.
	resp, err = e.runner.Run(ctx, chargeKey("s1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('rejected', 1)`); err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(422, "unprocessable")
	})
	require.NoError(t, err)
	require.Equal(t, 422, resp.Status)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 's1'`))
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'rejected'`))
}

// Once something took effect (a phase committed, or a foreign call was
// made), every answer is stored, rejections included.
func TestWorkflowRejectionAfterSomethingTookEffectIsStored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newValidatingFlow(t, e.reg)
	for _, point := range []string{"after_phase", "after_foreign_error"} {
		f.reject.Store(point)
		resp, err := e.runner.RunWorkflow(ctx, amountKey(point, `{"amount":5}`), f.wf)
		require.NoError(t, err, point)
		require.Equal(t, 422, resp.Status, point)
		k := readKey(t, e.Pool, "user_1", point)
		require.Equal(t, "finished", k.Status, point)
		require.Equal(t, 422, *k.RespStatus, point)
		replay, err := e.runner.RunWorkflow(ctx, amountKey(point, `{"amount":5}`), f.wf)
		require.NoError(t, err, point)
		require.True(t, replay.Replayed, point)
		require.Equal(t, resp.Body, replay.Body, point)
	}
	require.Equal(t, int64(1), f.foreign.Load())
}

// An attempt that took over a key (a crash or transient error before) does
// not know whether an earlier one called the provider without recording
// it, so it stores even an early rejection rather than forget the key.
func TestRejectionByAnAttemptThatTookTheKeyOverIsStored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{Store: func(status int) bool { return status != 418 }})
	ctx := ctxT(t)
	var runs atomic.Int64
	wf := txn.NewWorkflow("flaky_then_rejects", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if runs.Add(1) == 1 {
			// A call that may have reached the provider: a later attempt
			// cannot know that nothing took effect.
			_, err := txn.Foreign(ctx, a, "call", func(context.Context, string) (int, error) { return 0, errInjected })
			return txn.Response{}, err
		}
		return txn.Response{Status: 418}, nil
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, errInjected)
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, 418, resp.Status)
	require.Equal(t, "finished", readKey(t, e.Pool, "user_1", "k1").Status)

	// Config.Store is the policy: 418 is not stored by a first attempt.
	resp, err = e.runner.RunWorkflow(ctx, rideKey("k2"), wf)
	require.NoError(t, err)
	require.Equal(t, 418, resp.Status)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'k2'`))
}

// Concurrent attempts on one key, some with a rejected body and some with
// the corrected one: a rejection never removes a key another attempt
// created or took effect under, the corrected operation runs exactly once,
// and its response is the one every later retry gets.
func TestConcurrentRejectionsAndCorrectedRequestsOnOneKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newValidatingFlow(t, e.reg)
	var mu sync.Mutex
	outcomes := map[string]int{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 40 {
		wg.Go(func() {
			<-start
			params := `{"amount":5}`
			if i%2 == 0 {
				params = `{"amount":0}`
			}
			resp, err := e.runner.RunWorkflow(ctx, amountKey("k", params), f.wf)
			var out string
			switch {
			case errors.Is(err, txn.ErrKeyInUse):
				out = "in_use"
			case errors.Is(err, txn.ErrKeyReused):
				out = "reused"
			case err != nil:
				out = "error: " + err.Error()
			case resp.Replayed:
				out = "replayed " + strconv.Itoa(resp.Status)
			default:
				out = strconv.Itoa(resp.Status)
			}
			mu.Lock()
			outcomes[out]++
			mu.Unlock()
		})
	}
	close(start)
	wg.Wait()
	t.Logf("outcomes: %v", outcomes)
	for out := range outcomes {
		require.NotContains(t, out, "error", "no attempt failed")
	}
	require.LessOrEqual(t, outcomes["201"], 1, "the operation ran at most once")
	require.LessOrEqual(t, e.Count(t, `SELECT count(*) FROM charges`), 1)
	resp, err := e.runner.RunWorkflow(ctx, amountKey("k", `{"amount":5}`), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`), "exactly one reservation in the end")
	require.Equal(t, "finished", readKey(t, e.Pool, "user_1", "k").Status)
}

// A client retry of a key older than MaxAge does not take it
// over (the provider would be called again past its idempotency window): the
// statement that would have taken it fails it, storing the problem response.
func TestKeyOlderThanMaxAgeIsFailedNotTakenOver(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil) // MaxAge: the default, 12 hours
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("foreign")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	e.age(t, "k1", 30*time.Hour)
	f.failAt.Store("")

	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	requireMaxAgeFailure(t, resp)
	require.False(t, resp.Replayed)
	require.Zero(t, f.prov.calls.Load(), "no foreign call past MaxAge")
	require.Equal(t, int64(1), f.p1.Load(), "no phase ran again")
	k := readKey(t, e.Pool, "user_1", "k1")
	require.Equal(t, "failed", k.Status)
	require.Equal(t, 1, k.Attempts, "not taken over")
	require.Equal(t, "max_age", e.failureReason(t, "k1"))
	require.Equal(t, uint64(1), e.runner.Stats().TooOld)

	again, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.True(t, again.Replayed)
	require.Equal(t, resp.Body, again.Body)

	// A younger key is resumed as before.
	f.failAt.Store("foreign")
	_, err = e.runner.RunWorkflow(ctx, rideKey("k2"), f.wf)
	require.ErrorIs(t, err, errInjected)
	e.age(t, "k2", 11*time.Hour)
	f.failAt.Store("")
	resp, err = e.runner.RunWorkflow(ctx, rideKey("k2"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
}

// A waiting retry (WaitWhenInUse) that outlives the holder's lease does not
// take over a key past MaxAge either.
func TestWaitModeTakeoverOfKeyOlderThanMaxAgeFailsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{WaitWhenInUse: true, WaitPollInterval: 5 * time.Millisecond})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("after_p1")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	f.failAt.Store("")
	// A crashed holder's lease, expiring shortly, on a key created 13 hours ago.
	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET lease_token = gen_random_uuid(),
		leased_until = now() + interval '200 milliseconds', created_at = now() - interval '13 hours'`)
	require.NoError(t, err)

	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	requireMaxAgeFailure(t, resp)
	require.Zero(t, f.prov.calls.Load())
	require.Equal(t, "failed", readKey(t, e.Pool, "user_1", "k1").Status)
}

// Resume (the recovery path and admin tools) fails such a key too.
func TestResumeOfKeyOlderThanMaxAgeFailsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("after_p1")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	f.failAt.Store("")
	e.age(t, "k1", 12*time.Hour+time.Minute)

	resp, err := e.runner.Resume(ctx, "user_1", "k1")
	require.NoError(t, err)
	requireMaxAgeFailure(t, resp)
	require.Zero(t, f.prov.calls.Load())
	require.Equal(t, "max_age", e.failureReason(t, "k1"))
}

// Client retries and the recovery path racing on one key past MaxAge: one
// statement fails it, nobody takes it over, and every caller gets the one
// stored failure.
func TestConcurrentRetriesOfAKeyPastMaxAgeAllGetItsOneFailure(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{WaitWhenInUse: true, WaitPollInterval: time.Millisecond})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("foreign")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	f.failAt.Store("")
	e.age(t, "k1", 13*time.Hour)

	bodies := make(chan string, 21)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 21 {
		wg.Go(func() {
			<-start
			var resp txn.Response
			var err error
			if i%7 == 0 {
				resp, err = e.runner.Resume(ctx, "user_1", "k1")
			} else {
				resp, err = e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
			}
			if err != nil {
				bodies <- "error: " + err.Error()
				return
			}
			bodies <- strconv.Itoa(resp.Status) + " " + string(resp.Body)
		})
	}
	close(start)
	wg.Wait()
	close(bodies)
	distinct := map[string]int{}
	for b := range bodies {
		distinct[b]++
	}
	require.Len(t, distinct, 1, "one answer: %v", distinct)
	for b := range distinct {
		require.True(t, strings.HasPrefix(b, "500 "), b)
		require.Contains(t, b, "max_age")
	}
	require.Zero(t, f.prov.calls.Load(), "nobody called the provider")
	require.Equal(t, int64(1), f.p1.Load())
	k := readKey(t, e.Pool, "user_1", "k1")
	require.Equal(t, "failed", k.Status)
	require.Equal(t, 1, k.Attempts, "nobody took it over")
	require.Equal(t, uint64(1), e.runner.Stats().TooOld, "one statement failed it")
}

func TestResumedAttemptSeesByteIdenticalParams(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	params := []byte(`{ "z": "<b>", "amount": 1E+2, "items": [{"qty": 2.50, "sku": "a"}], "note": "\u00e9\/" }`)
	var fail atomic.Bool
	fail.Store(true)
	seen := make(chan string, 2)
	wf := txn.NewWorkflow("params", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		seen <- string(a.Params())
		if _, err := txn.Atomic(ctx, a, "one", func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		if fail.Load() {
			return txn.Response{}, errInjected
		}
		return txn.Response{Status: 201, Body: a.Params()}, nil
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, txn.Key{Scope: "s", Value: "k", Method: "POST", Path: "/p", Params: params}, wf)
	require.ErrorIs(t, err, errInjected)
	first := <-seen
	require.Equal(t, `{"amount":1E+2,"items":[{"qty":2.50,"sku":"a"}],"note":"é/","z":"<b>"}`, first,
		"canonical: keys sorted, literals as written, no HTML escaping")

	fail.Store(false)
	resp, err := e.runner.Resume(ctx, "s", "k")
	require.NoError(t, err)
	require.Equal(t, first, <-seen, "the resumed attempt sees the same bytes")
	require.Equal(t, first, string(resp.Body))
}

// Rows written before migration 00004 keep their params and phase results
// in jsonb only; they still resume, from those.
func TestKeyStoredBeforeLosslessColumnsStillResumes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("after_p1")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	// What the previous version stored: jsonb columns, no raw ones.
	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys
		SET request_params = convert_from(request_params_raw, 'UTF8')::jsonb,
		    phase_results = convert_from(phase_results_raw, 'UTF8')::jsonb,
		    request_params_raw = NULL, phase_results_raw = NULL`)
	require.NoError(t, err)
	f.failAt.Store("")
	resp, err := e.runner.Resume(ctx, "user_1", "k1")
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Contains(t, string(resp.Body), `"amount":1250`)
	require.Equal(t, int64(1), f.p1.Load(), "the phase committed before is not run again")
}

// The server dies as the key's insert commits, and the attempt's removal of
// the insert cannot reach it either, within its own ReleaseTimeout: the
// caller gets ErrUnavailable (503, retry later), not an error that looks
// like its own context's deadline (which the removal's was). The key is
// free once its lease expires.
// chargeFirst registers a workflow whose first phase is a foreign call, so
// that its key is inserted on its own (autocommit) before the call; runs
// counts the workflow's runs that got past the key's insert.
func chargeFirst(t *testing.T, e *env, prov *provider, runs *atomic.Int64) *txn.Workflow {
	t.Helper()
	wf := txn.NewWorkflow("charge_first", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		charge, err := txn.Foreign(ctx, a, "charged", func(ctx context.Context, fk string) (string, error) {
			runs.Add(1)
			return prov.charge(fk), nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, 1)`, charge); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(201, charge)
		})
	})
	require.NoError(t, e.reg.Register(wf))
	return wf
}

// cutKeyInsert arms proxy, as r's attempt sends its key's insert on its own
// (autocommit, before a Foreign phase that comes first), to cut the
// insert's answer once the insert committed; only the first one.
func cutKeyInsert(r *txn.Runner, proxy *pgtest.Proxy) {
	var armed atomic.Bool
	txnhook.Install(r, func(ev txnhook.Event) {
		if ev.Point == txnhook.BeforeCommit && ev.Commit == txnhook.CommitKey && armed.CompareAndSwap(false, true) {
			proxy.CutAfterNextStatement("SELECT 1") // the insert returns its row through a SELECT (InsertKey)
		}
	})
}

func TestInsertCutAndRemovalTimedOutIsUnavailable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	proxy, pool := e.NewProxy(t)
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg, LeaseDuration: time.Second, ReleaseTimeout: 100 * time.Millisecond})
	require.NoError(t, err)
	var runs atomic.Int64
	wf := chargeFirst(t, e, newProvider(), &runs)
	require.NoError(t, pool.Ping(ctx)) // a connection in the pool before the latency

	proxy.SetLatency(300 * time.Millisecond) // slower than ReleaseTimeout: the removal times out
	cutKeyInsert(r, proxy)
	_, err = r.RunWorkflow(ctx, rideKey("k1"), wf)
	require.Error(t, err)
	require.ErrorIs(t, err, txn.ErrUnavailable, "%v", err)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "the caller's context did not end")
	require.Equal(t, 503, txn.HTTPStatus(err))
	require.Zero(t, runs.Load(), "nothing ran")

	proxy.SetLatency(0)
	time.Sleep(1100 * time.Millisecond) // the insert's lease expires
	resp, err := r.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
}

// A workflow key's own insert (before a Foreign phase that comes first)
// that commits while the caller sees an error (the connection is cut right
// after the commit) does not hold the key for a whole lease: the attempt removes it, so the client's retry runs at once.
func TestAmbiguousKeyInsertDoesNotHoldTheKeyForALease(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil) // a 90 s lease
	ctx := ctxT(t)
	proxy, pool := e.NewProxy(t)
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	prov := newProvider()
	var runs atomic.Int64
	wf := chargeFirst(t, e, prov, &runs)

	cutKeyInsert(r, proxy)
	_, err = r.RunWorkflow(ctx, rideKey("k1"), wf)
	require.Error(t, err, "the caller sees the insert fail")
	select {
	case <-proxy.CommitCut():
	default:
		t.Fatal("the insert's answer was not cut")
	}
	require.Zero(t, runs.Load(), "nothing ran")
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`), "the committed insert was removed")

	resp, err := r.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err, "the retry is not answered ErrKeyInUse")
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), runs.Load())
	require.Equal(t, 1, prov.distinct())
}

// keyWrites counts, by a trigger, the transactions that write the key rows
// of e's schema: each is a commit the operation pays for.
func keyWrites(t *testing.T, e *env) func() int {
	t.Helper()
	_, err := e.Pool.Exec(context.Background(), `
		CREATE TABLE key_writes (xid xid8 NOT NULL);
		CREATE FUNCTION note_key_write() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN INSERT INTO key_writes VALUES (pg_current_xact_id()); RETURN NULL; END $$;
		CREATE TRIGGER note_key_write AFTER INSERT OR UPDATE ON idempotency_keys
			FOR EACH ROW EXECUTE FUNCTION note_key_write();`)
	require.NoError(t, err)
	return func() int { return e.Count(t, `SELECT count(DISTINCT xid) FROM key_writes`) }
}

// Atomic → Foreign → Finish commits twice on its first attempt: the key
// with the first phase, the foreign result with the final phase; no commit
// of its own for the key, the lease check or the foreign result. Round
// trips: the read; BEGIN with the key insert and the phase's insert (in
// pgx's default mode once the connection prepared that insert: see
// TestWorkflowFirstPhaseTakesTheKeyWithItsFirstStatement); the phase record
// with COMMIT; the check before the call (a read, unless
// Config.FailoverKeepsCommits); BEGIN with the final phase's insert; the
// response with COMMIT.
func TestWorkflowFirstAttemptCommitsTwice(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name                 string
		failoverKeepsCommits bool
		roundTrips           int64
	}{
		{"default", false, 6},
		{"failover_keeps_commits", true, 5},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			writes := keyWrites(t, e)
			r, qc := e.countingRunnerIn(t, &txn.Config{Workflows: e.reg, FailoverKeepsCommits: c.failoverKeepsCommits}, pgx.QueryExecModeExec)
			f := newRideFlow(t, e.reg, "ride")

			resp, err := r.RunWorkflow(ctx, rideKey("k1"), f.wf)
			require.NoError(t, err)
			require.Equal(t, 201, resp.Status)
			require.Equal(t, 2, writes(), "transactions that wrote the key")
			require.Equal(t, int64(1), f.prov.calls.Load())
			k := readKey(t, e.Pool, "user_1", "k1")
			require.Equal(t, "finished", k.Status)
			require.False(t, k.LeaseHeld)
			require.Equal(t, `{"ride_created":{"id":1,"amount":1250},"charge_created":"ch_1"}`, storedResults(t, e, "k1"))
			require.Equal(t, c.roundTrips, qc.n.Load(), "round trips")

			before := qc.n.Load()
			again, err := r.RunWorkflow(ctx, rideKey("k1"), f.wf)
			require.NoError(t, err)
			require.True(t, again.Replayed)
			require.Equal(t, int64(1), qc.n.Load()-before, "a replay is one round trip")
			require.Equal(t, 2, writes())
		})
	}
}

// A workflow's first phase inserts its key row once, at its commit, with
// the phase's recovery point and result: no insert followed by an update of
// the same row. Atomic → Foreign → Finish writes two row versions, the
// insert and the final phase's.
func TestWorkflowFirstPhaseWritesItsKeyRowOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	_, err := e.Pool.Exec(ctx, `
		CREATE SEQUENCE key_row_writes;
		CREATE FUNCTION count_key_row_write() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM nextval('key_row_writes'); RETURN NEW; END $$;
		CREATE TRIGGER count_key_row_writes BEFORE INSERT OR UPDATE ON idempotency_keys
			FOR EACH ROW EXECUTE FUNCTION count_key_row_write()`)
	require.NoError(t, err)
	f := newRideFlow(t, e.reg, "ride")
	for i := range 3 { // the first on a connection prepares; the later ones ride with BEGIN
		resp, err := e.runner.RunWorkflow(ctx, rideKey("k"+strconv.Itoa(i)), f.wf)
		require.NoError(t, err)
		require.Equal(t, 201, resp.Status)
	}
	var writes int64
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT last_value FROM key_row_writes`).Scan(&writes))
	require.Equal(t, int64(6), writes, "two row versions per key")
	require.Equal(t, 3, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'finished' AND response_status = 201`))
	for i := range 3 {
		require.Equal(t, `{"ride_created":{"id":`+strconv.Itoa(2*i+1)+`,"amount":1250},"charge_created":"ch_`+strconv.Itoa(i+1)+`"}`,
			storedResults(t, e, "k"+strconv.Itoa(i)))
	}
}

// A workflow's first phase takes its key with its first statement, and
// inserts the key row at its commit: a call whose lookup came before a
// twin committed the key runs that phase on a snapshot with the twin's
// writes, and whatever it makes of them (an error, a rejection) is not its
// answer: the twin's response is, replayed.
func TestWorkflowThatLostToACommittedTwinReplaysWhateverItsFirstPhaseMade(t *testing.T) {
	t.Parallel()
	for _, outcome := range []string{"error", "rejection"} {
		t.Run(outcome, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			_, err := e.Pool.Exec(ctx, `CREATE TABLE orders (ref text PRIMARY KEY)`)
			require.NoError(t, err)
			entered, release := make(chan struct{}), make(chan struct{})
			releaseFirst := sync.OnceFunc(func() { close(release) })
			t.Cleanup(releaseFirst) // on a failed assertion too: the pool's Close waits for the first call
			var calls atomic.Int64
			wf := txn.NewWorkflow("orders", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
				n := calls.Add(1)
				_, err := txn.Atomic(ctx, a, "ordered", func(ctx context.Context, tx pgx.Tx) (string, error) {
					if n == 1 {
						close(entered)
						<-release // before its first statement: it holds nothing yet
					}
					_, err := tx.Exec(ctx, `INSERT INTO orders (ref) VALUES ('o1')`)
					return "o1", err
				})
				switch {
				case err != nil && outcome == "rejection":
					return txn.JSON(422, "order exists") // a rejection is not stored by default
				case err != nil:
					return txn.Response{}, err
				}
				return a.Finish(ctx, func(context.Context, pgx.Tx) (txn.Response, error) { return txn.JSON(201, "o1") })
			})
			require.NoError(t, e.reg.Register(wf))
			done := make(chan error, 1)
			var first txn.Response
			go func() {
				var err error
				first, err = e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
				done <- err
			}()
			<-entered
			twin, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
			require.NoError(t, err)
			require.Equal(t, 201, twin.Status)
			releaseFirst()
			require.NoError(t, <-done)
			require.True(t, first.Replayed, "the twin's response, replayed")
			require.Equal(t, twin.Body, first.Body)
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM orders`))
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'finished'`))
		})
	}
}

// A first attempt's key goes out with BEGIN and its first phase's first
// statement, as a Run's does: in pgx's default mode once a workflow
// prepared that statement on the connection (after the key, so the first
// such workflow pays a round trip and the prepare more), in the exec mode
// always. The key row itself goes out with the phase's COMMIT, written
// once; the phase knows its id before it is inserted.
func TestWorkflowFirstPhaseTakesTheKeyWithItsFirstStatement(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, pc := e.oneConnRunner(t, nil)
	wf := txn.NewWorkflow("first_phase_rides", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		_, err := txn.Atomic(ctx, a, "charged", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			_, ref := a.Key()
			_, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, 1)`, ref)
			return 0, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			_, ref := a.Key()
			if _, err := tx.Exec(ctx, `UPDATE charges SET amount = 2 WHERE ref = $1`, ref); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(201, map[string]int{"attempt": a.Number()})
		})
	})
	require.NoError(t, e.reg.Register(wf))
	keyIDs := make(chan int64, 4)
	idWf := txn.NewWorkflow("first_phase_key_id", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		_, err := txn.Atomic(ctx, a, "noted", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			id, ok := phasectx.KeyID(ctx)
			if !ok {
				return 0, errors.New("no key id")
			}
			keyIDs <- id
			var rows int
			err := tx.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND key = $2`, "user_1", "id1").Scan(&rows)
			if err == nil && rows != 0 {
				err = errors.New("the key row is there before the phase's commit")
			}
			return id, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(200, map[string]string{})
	})
	require.NoError(t, e.reg.Register(idWf))

	// The first on the connection: BEGIN with the key's lock goes first,
	// then the prepare of the phase's statement (not a query: not counted
	// here).
	rt, _ := pc.roundTrips(func() {
		_, err := r.RunWorkflow(ctx, rideKey("w1"), wf)
		require.NoError(t, err)
	})
	require.Equal(t, int64(6), rt, "the read, BEGIN with the key's lock, the phase's insert, the key row with COMMIT, "+
		"BEGIN with Finish's statement, the response with COMMIT")
	rt, prepares := pc.roundTrips(func() {
		_, err := r.RunWorkflow(ctx, rideKey("w2"), wf)
		require.NoError(t, err)
	})
	require.Equal(t, int64(5), rt, "the read, BEGIN with the key's lock and the phase's insert, the key row with COMMIT, "+
		"BEGIN with Finish's statement, the response with COMMIT")
	require.Zero(t, prepares)
	require.Equal(t, 2, e.Count(t, `SELECT count(*) FROM charges`))

	// The phase is given the id its key row takes at the commit (the
	// outbox's messages carry it), before the row is there.
	_, err := r.RunWorkflow(ctx, rideKey("id1"), idWf)
	require.NoError(t, err)
	var stored int64
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT id FROM idempotency_keys WHERE key = 'id1'`).Scan(&stored))
	require.Equal(t, stored, <-keyIDs)
}

// Rule 4 for a workflow whose first phase's statement travels with the
// key's insert: the insert fails before the statement runs, so a twin gets
// ErrKeyInUse at once, not after a wait on its holder's table lock, and
// nothing of its phase is written.
func TestWorkflowTwinLosesTheKeyAtOnceWhileItsFirstStatementTravels(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeCacheStatement} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			r, _ := e.oneConnRunner(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			f := newRideFlow(t, e.reg, "ride")
			_, err := r.RunWorkflow(ctx, rideKey("warm"), f.wf) // prepares the first statement in cache_statement
			require.NoError(t, err)

			release := holdKeyWithTableLock(ctx, t, e, rideKey("k1"))
			short, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			_, err = r.RunWorkflow(short, rideKey("k1"), f.wf)
			require.ErrorIs(t, err, txn.ErrKeyInUse, "at once, not after a wait on the holder's table lock")
			require.NoError(t, release())
			require.Equal(t, int64(2), f.p1.Load(), "the twin's phase ran; its statement did not")
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'ride'`))
			require.Equal(t, int64(1), f.prov.calls.Load())
		})
	}
}

// A workflow that waits for its key's holder (WaitWhenInUse) and lost the
// key's insert once inserts it on its own before the phase runs from then
// on, so that its first phase does not run again and again while it waits.
func TestWorkflowWaitingForItsKeyDoesNotRunItsFirstPhaseWhileItWaits(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	waiter, err := txn.New(e.NewPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	}), &txn.Config{Workflows: e.reg, WaitWhenInUse: true, WaitPollInterval: 5 * time.Millisecond})
	require.NoError(t, err)

	release := holdKeyWithTableLock(ctx, t, e, rideKey("k1"))
	done := make(chan error, 1)
	go func() {
		_, err := waiter.RunWorkflow(ctx, rideKey("k1"), f.wf)
		done <- err
	}()
	time.Sleep(300 * time.Millisecond) // about 60 polls
	require.NoError(t, release())
	err = <-done
	// The holder was a single-phase Run: the waiter finds the key finished
	// by another operation.
	require.ErrorIs(t, err, txn.ErrKeyReused)
	require.LessOrEqual(t, f.p1.Load(), int64(1), "the first phase ran at most once, before the first lost insert")
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'ride'`))
}

// A workflow that fails before its first commit leaves no key: nothing
// took effect, and the retry runs it as new.
func TestWorkflowErrorBeforeItsFirstCommitLeavesNoKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var runs atomic.Int64
	wf := txn.NewWorkflow("fails_first", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if runs.Add(1) == 1 {
			return txn.Response{}, errInjected
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, "ok") })
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, errInjected)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, 1, readKey(t, e.Pool, "user_1", "k1").Attempts, "the retry was a first attempt")
}

// While a first attempt's first phase (which inserts the key with its
// first statement) is open, a concurrent attempt on the key gets
// ErrKeyInUse at once, commits nothing, and in wait mode replays the first
// attempt's response once it finishes.
func TestTwinOfAnUncommittedFirstPhaseIsKeyInUseOrWaits(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	inPhase, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) }) // a failed assertion does not leave the holder waiting
	var held atomic.Bool
	wf := txn.NewWorkflow("slow_first_phase", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "reserved", func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('reserved', 1)`)
			if err == nil && held.CompareAndSwap(false, true) {
				close(inPhase) // the key is taken
				<-release
			}
			return 1, err
		}); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, "done") })
	})
	require.NoError(t, e.reg.Register(wf))
	first := make(chan error, 1)
	go func() { _, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf); first <- err }()
	<-inPhase

	start := time.Now()
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, txn.ErrKeyInUse)
	require.Less(t, time.Since(start), 10*time.Second, "at once, not after the holder")

	waiter, err := txn.New(e.Pool, &txn.Config{Workflows: e.reg, WaitWhenInUse: true, WaitPollInterval: 5 * time.Millisecond})
	require.NoError(t, err)
	waited := make(chan txn.Response, 1)
	go func() {
		resp, err := waiter.RunWorkflow(ctx, rideKey("k1"), wf)
		assert.NoError(t, err)
		waited <- resp
	}()
	// The waiter polls the uncommitted key: only then is the holder let go.
	require.Eventually(t, func() bool { return waiter.Stats().Waited == 1 }, 10*time.Second, time.Millisecond)
	once.Do(func() { close(release) })
	require.NoError(t, <-first)
	resp := <-waited
	require.True(t, resp.Replayed)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'reserved'`))
}

// The first commit of a workflow, which inserts its key with the first
// phase's writes, may take effect while the caller sees an error: the
// attempt releases the key it may have created, and the retry resumes
// after the phase instead of running it again.
func TestAmbiguousFirstCommitIsResumedNotRepeated(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil) // a 90 s lease: only a release lets the retry in at once
	ctx := ctxT(t)
	proxy, pool := e.NewProxy(t)
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	f := newRideFlow(t, e.reg, "ride")

	proxy.CutAfterNextCommit()
	_, err = r.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.Error(t, err, "the caller sees the commit fail")
	select {
	case <-proxy.CommitCut():
	default:
		t.Fatal("the commit's answer was not cut")
	}
	k := readKey(t, e.Pool, "user_1", "k1")
	require.Equal(t, "ride_created", k.RecoveryPoint, "the first commit took effect")
	require.False(t, k.LeaseHeld, "and the attempt released the key")

	resp, err := r.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), f.p1.Load(), "the first phase ran once")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'ride'`))
}

// A key row that moved while its attempt held the lease (another statement
// rewrote it, as VACUUM FULL or an operator's UPDATE would) is found again
// by id and lease token: the final phase, whose fenced update goes out
// with COMMIT and fails rather than match nothing, runs again there and
// commits once.
func TestMovedKeyRowIsFoundAgainAndThePhaseCommitsOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "after_p2" {
			_, err := e.Pool.Exec(ctx, `UPDATE idempotency_keys SET request_path = request_path`) // a new row version
			require.NoError(t, err)
		}
	}
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(2), f.p3.Load(), "the final phase ran again where the row is")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%'`), "and committed once")
	require.Equal(t, "finished", readKey(t, e.Pool, "user_1", "k1").Status)
	require.Equal(t, `{"ride_created":{"id":1,"amount":1250},"charge_created":"ch_1"}`, storedResults(t, e, "k1"))
}

// A workflow that turns the error of an ambiguous first commit into a
// rejection Config.Store does not store is not answered as if nothing took
// effect: the commit may have stored the key and the phase. The attempt
// finds the key there and resumes it, and the phase runs once.
func TestRejectionAfterAnAmbiguousFirstCommitIsNotReturnedAsUnstarted(t *testing.T) {
	t.Parallel()
	// The rejection is returned as it is, or through Finish (whose
	// transaction tries to insert the key the lost commit stored).
	for _, via := range []string{"return", "finish"} {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			proxy, pool := e.NewProxy(t)
			r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
			require.NoError(t, err)
			var p1 atomic.Int64
			wf := txn.NewWorkflow("rejects_on_error", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
				if _, err := txn.Atomic(ctx, a, "p1", func(ctx context.Context, tx pgx.Tx) (int, error) {
					p1.Add(1)
					_, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('p1', 1)`)
					return 1, err
				}); err != nil {
					reject := txn.Response{Status: http.StatusConflict} // not stored by DefaultStore
					if via == "finish" {
						return a.Finish(ctx, func(context.Context, pgx.Tx) (txn.Response, error) { return reject, nil })
					}
					return reject, nil
				}
				return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, "done") })
			})
			require.NoError(t, e.reg.Register(wf))

			proxy.CutAfterNextCommit()
			resp, err := r.RunWorkflow(ctx, rideKey("k1"), wf)
			<-proxy.CommitCut()
			if err == nil && resp.Status == http.StatusConflict {
				require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`),
					"an unstored rejection leaves no key, and nothing took effect")
			}
			require.Equal(t, int64(1), p1.Load(), "the phase ran once")
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'p1'`))
			require.NoError(t, err, "not in use by the attempt itself")
			require.Equal(t, 201, resp.Status, "the operation was resumed after its committed phase")
			require.Equal(t, "finished", readKey(t, e.Pool, "user_1", "k1").Status)
		})
	}
}

// A later commit whose answer is lost may have recorded the pending
// foreign results with it: the release after the error does not record
// them again over it, and leaves the recovery point where that commit put
// it.
func TestReleaseAfterAnAmbiguousCommitDoesNotRecordForeignResultsTwice(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	proxy, pool := e.NewProxy(t)
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	wf := txn.NewWorkflow("p1_f_p3", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "p1", func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		if _, err := txn.Foreign(ctx, a, "f", func(context.Context, string) (string, error) { return "ch", nil }); err != nil {
			return txn.Response{}, err
		}
		proxy.CutAfterNextCommit()
		if _, err := txn.Atomic(ctx, a, "p3", func(context.Context, pgx.Tx) (int, error) { return 3, nil }); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, "done") })
	})
	require.NoError(t, e.reg.Register(wf))
	_, err = r.RunWorkflow(ctx, rideKey("k1"), wf)
	require.Error(t, err, "p3's commit answer was cut")
	<-proxy.CommitCut()
	k := readKey(t, e.Pool, "user_1", "k1")
	require.Equal(t, "p3", k.RecoveryPoint)
	require.False(t, k.LeaseHeld)
	require.Equal(t, `{"p1":1,"f":"ch","p3":3}`, storedResults(t, e, "k1"))
}

// A workflow's first phase that ends with its function's error inserted
// no key (the row goes in with its commit), but must find out whether a
// twin stored the key meanwhile, or whether the function committed the
// transaction itself: that read goes out with the ROLLBACK, on the phase's
// own connection. The attempt costs 3 round trips in the exec mode (the
// lookup; BEGIN with the key's lock and the phase's statement; ROLLBACK
// with the read), leaves nothing behind, and a retry runs the phase anew.
func TestWorkflowFirstPhaseErrorReadsTheOutcomeWithItsRollback(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var runs atomic.Int64
	wf := txn.NewWorkflow("fails_first", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		n := runs.Add(1)
		if _, err := txn.Atomic(ctx, a, "charge_row", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, 1)`, "c"+strconv.FormatInt(n, 10)); err != nil {
				return 0, err
			}
			if n == 1 {
				return 0, errInjected
			}
			return n, nil
		}); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(context.Context, pgx.Tx) (txn.Response, error) { return txn.Response{Status: 201}, nil })
	})
	require.NoError(t, e.reg.Register(wf))
	r, writes, settledOnThePool := e.wireRunner(t, pgx.QueryExecModeExec)
	before := writes.Load()
	_, err := r.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, errInjected)
	require.Equal(t, int64(3), writes.Load()-before, "round trips")
	require.Zero(t, settledOnThePool.Load(), "the outcome was read with the ROLLBACK")
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges`))
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`))

	resp, err := r.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'c2'`))
}
