package txn_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

func TestFiftyGoroutinesOnOneNewKeyRunItOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64
	var executed, replayed, inUse atomic.Int64
	var bodies sync.Map
	start := make(chan struct{})
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			resp, err := e.runner.Run(ctx, chargeKey("k1", 700), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				time.Sleep(200 * time.Millisecond) // hold the key while others arrive
				return insertCharge(&calls, "c1", 700)(ctx, tx)
			})
			switch {
			case err == nil && resp.Replayed:
				replayed.Add(1)
				bodies.Store(string(resp.Body), true)
			case err == nil:
				executed.Add(1)
				bodies.Store(string(resp.Body), true)
			case errors.Is(err, txn.ErrKeyInUse):
				inUse.Add(1)
			default:
				t.Errorf("unexpected result: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	require.Equal(t, int64(1), calls.Load(), "fn ran exactly once")
	require.Equal(t, int64(1), executed.Load())
	require.Equal(t, int64(50), executed.Load()+replayed.Load()+inUse.Load())
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))
	n := 0
	bodies.Range(func(any, any) bool { n++; return true })
	require.Equal(t, 1, n, "every caller that got a response got the same one")
	t.Logf("executed=%d replayed=%d in_use=%d", executed.Load(), replayed.Load(), inUse.Load())
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
	require.Equal(t, int64(1), f.p1.Load())
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

func TestAmbiguousCommitRetryReplaysNotReexecutes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	proxy, pool := e.NewProxy(t)
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)

	var calls atomic.Int64
	proxy.CutAfterNextCommit()
	_, err = r.Run(ctx, chargeKey("k1", 900), insertCharge(&calls, "c1", 900))
	require.Error(t, err, "the caller sees the commit fail")
	<-proxy.CommitCut()
	require.Equal(t, "finished", readKey(t, e.Pool, "acct_1", "k1").Status, "but it committed on the server")

	resp, err := r.Run(ctx, chargeKey("k1", 900), insertCharge(&calls, "c1", 900))
	require.NoError(t, err)
	require.True(t, resp.Replayed, "the retry replays")
	require.Equal(t, int64(1), calls.Load())
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))

	// The same for a workflow's final phase.
	f := newRideFlow(t, e.reg, "ride")
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "in_p3" {
			proxy.CutAfterNextCommit()
		}
	}
	_, err = r.RunWorkflow(ctx, rideKey("w1"), f.wf)
	require.Error(t, err)
	<-proxy.CommitCut()
	f.hook = nil
	resp, err = r.RunWorkflow(ctx, rideKey("w1"), f.wf)
	require.NoError(t, err)
	require.True(t, resp.Replayed)
	require.Equal(t, int64(1), f.p3.Load())
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%'`))
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

func TestTerminatedBackendMidPhaseIsTransient(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64
	var pid int32
	_, err := e.runner.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		calls.Add(1)
		if err := tx.QueryRow(ctx, `INSERT INTO charges (ref, amount) VALUES ('x', 1) RETURNING pg_backend_pid()`).Scan(&pid); err != nil {
			return txn.Response{}, err
		}
		_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
		return txn.Response{Status: 201}, err
	})
	require.Error(t, err)
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM charges`))
	// The client sees the FATAL before the backend has aborted its
	// transaction: until it exits it still holds the key's advisory lock, and
	// a retry in that window is rightly answered ErrKeyInUse (its insert is
	// in flight). Retry once the backend is gone.
	require.Eventually(t, func() bool {
		return e.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid) == 0
	}, 10*time.Second, 5*time.Millisecond)
	resp, err := e.runner.Run(ctx, chargeKey("k1", 1), insertCharge(&calls, "c", 1))
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(2), calls.Load())
}

// Operations on unrelated keys must not make each other fail: the key
// bookkeeping inside SERIALIZABLE phases takes no predicate locks on shared
// index pages (single-phase runs reserve an id and insert; workflow phases
// update their row by ctid, as HOT updates). Before that, 16 workers over
// fresh keys saw dozens of ErrConflict per thousand operations.
func TestUnrelatedKeysDoNotConflict(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	wf := txn.NewWorkflow("two_phases", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "one", func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, 1) })
	})
	require.NoError(t, e.reg.Register(wf))
	noop := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, 1) }
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 40 {
				key := txn.Key{Value: fmt.Sprintf("g%d-%d", g, i), Method: "POST", Path: "/x"}
				var err error
				if i%2 == 0 {
					_, err = e.runner.Run(ctx, key, noop)
				} else {
					_, err = e.runner.RunWorkflow(ctx, key, wf)
				}
				require.NoError(t, err)
			}
		})
	}
	wg.Wait()
	s := e.runner.Stats()
	require.Zero(t, s.Conflicts)
	require.Equal(t, uint64(640), s.Executed)
	t.Logf("serialization retries over 640 operations: %d", s.Retries)
}

// The same scope and key in another schema (another installation in the
// same database) is a different operation, never "in use".
func TestSameKeyInAnotherSchemaIsIndependent(t *testing.T) {
	t.Parallel()
	a, b := newEnv(t, nil), newEnv(t, nil)
	ctx := ctxT(t)
	entered, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := a.runner.Run(ctx, chargeKey("shared", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			close(entered)
			<-release
			return txn.Response{Status: 201}, nil
		})
		done <- err
	}()
	<-entered
	var calls atomic.Int64
	resp, err := b.runner.Run(ctx, chargeKey("shared", 1), insertCharge(&calls, "c", 1))
	require.NoError(t, err, "not blocked by the other schema's in-flight key")
	require.Equal(t, 201, resp.Status)
	f := newRideFlow(t, b.reg, "ride")
	_, err = b.runner.RunWorkflow(ctx, txn.Key{Scope: "acct_1", Value: "shared", Method: "POST", Path: "/rides", Params: []byte(`{"amount": 1}`)}, f.wf)
	require.ErrorIs(t, err, txn.ErrKeyReused, "same schema, other request: reuse, decided by the row")
	close(release)
	require.NoError(t, <-done)
}
