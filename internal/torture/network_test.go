package torture

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

// untilDone retries one key until it gets a response, as a client would.
func untilDone(ctx context.Context, t testing.TB, r *txn.Runner, key txn.Key, wf *txn.Workflow) txn.Response {
	t.Helper()
	for {
		resp, err := r.RunWorkflow(ctx, key, wf)
		if err == nil {
			return resp
		}
		if ctx.Err() != nil {
			t.Fatalf("key %s never completed: %v", key.Value, err)
		}
		time.Sleep(20 * time.Millisecond) // a client's pause before it retries
	}
}

func TestNetworkLatencyChangesNothing(t *testing.T) {
	t.Parallel()
	d := newDB(t)
	proxy, pool := d.NewProxy(t)
	proxy.SetLatency(3 * time.Millisecond)
	reg := txn.NewRegistry()
	f := newFlow(t, pool, reg, "t.latency")
	r, err := txn.New(pool, &txn.Config{Workflows: reg, Logger: quietLogger(t)})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Go(func() { untilDone(ctx, t, r, orderKey(i), f.wf) })
	}
	wg.Wait()
	exactlyOnce(t, d, 20)
}

func TestConnectionResetDuringPhaseIsTransient(t *testing.T) {
	t.Parallel()
	d := newDB(t)
	proxy, pool := d.NewProxy(t)
	reg := txn.NewRegistry()
	f := newFlow(t, pool, reg, "t.reset")
	var once atomic.Bool
	f.hook = func(p string) {
		if p == "inside_foreign" && once.CompareAndSwap(false, true) {
			proxy.CutAll() // every connection dies while the provider call is in flight
		}
	}
	r, err := txn.New(pool, &txn.Config{Workflows: reg, Logger: quietLogger(t), LeaseDuration: time.Second, WaitWhenInUse: true})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = r.RunWorkflow(ctx, orderKey(1), f.wf)
	require.Error(t, err, "the caller sees a transient error")
	resp := untilDone(ctx, t, r, orderKey(1), f.wf)
	require.Equal(t, 201, resp.Status)
	exactlyOnce(t, d, 1)
	require.GreaterOrEqual(t, d.Count(t, `SELECT count(*) FROM provider_calls`), 1)
}

func TestResetRightAfterCommitReplays(t *testing.T) {
	t.Parallel()
	d := newDB(t)
	proxy, pool := d.NewProxy(t)
	reg := txn.NewRegistry()
	f := newFlow(t, pool, reg, "t.ambiguous")
	var armed atomic.Bool
	f.delay = func() time.Duration {
		if f.phase.Load() == "finish" && armed.CompareAndSwap(false, true) {
			proxy.CutAfterNextCommit()
		}
		return 0
	}
	r, err := txn.New(pool, &txn.Config{Workflows: reg, Logger: quietLogger(t)})
	require.NoError(t, err)
	ctx := context.Background()
	_, err = r.RunWorkflow(ctx, orderKey(1), f.wf)
	require.Error(t, err, "the commit's answer was lost")
	<-proxy.CommitCut()
	resp, err := r.RunWorkflow(ctx, orderKey(1), f.wf)
	require.NoError(t, err)
	require.True(t, resp.Replayed, "the committed operation is replayed, not run again")
	exactlyOnce(t, d, 1)
}

func TestDatabaseUnreachableForSecondsLosesNothing(t *testing.T) {
	t.Parallel()
	d := newDB(t)
	proxy, pool := d.NewProxy(t)
	reg := txn.NewRegistry()
	f := newFlow(t, pool, reg, "t.outage")
	f.delay = func() time.Duration { return 5 * time.Millisecond }
	r, err := txn.New(pool, &txn.Config{Workflows: reg, Logger: quietLogger(t), LeaseDuration: time.Second, ReleaseTimeout: 200 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const keys = 40
	var failures atomic.Int64
	var wg sync.WaitGroup
	for i := range keys {
		wg.Go(func() {
			time.Sleep(time.Duration(i) * 25 * time.Millisecond) // spread over the outage
			for {
				_, err := r.RunWorkflow(ctx, orderKey(i), f.wf)
				if err == nil {
					return
				}
				if ctx.Err() != nil {
					t.Errorf("key %d never completed: %v", i, err)
					return
				}
				if !errors.Is(err, txn.ErrKeyInUse) {
					failures.Add(1)
				}
				time.Sleep(50 * time.Millisecond) // a client's pause before it retries
			}
		})
	}
	time.Sleep(200 * time.Millisecond) // fault timing: the outage starts with calls in flight
	proxy.Unreachable()
	time.Sleep(2 * time.Second) // fault timing: how long the database stays unreachable
	proxy.Reachable()
	wg.Wait()
	require.Positive(t, failures.Load(), "callers saw the outage as transient errors")
	exactlyOnce(t, d, keys)
}

func TestTerminateBackendMidPhaseIsTransient(t *testing.T) {
	t.Parallel()
	d := newDB(t)
	// Only this test's sessions carry this application_name.
	pool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = d.Schema })
	reg := txn.NewRegistry()
	f := newFlow(t, pool, reg, "t.terminate")
	var once atomic.Bool
	f.hook = func(p string) {
		if p == "between_phases" && once.CompareAndSwap(false, true) {
			// An operator (or a failover) kills the application's sessions.
			var n int
			require.NoError(t, d.Pool.QueryRow(context.Background(), `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE application_name = $1`, d.Schema).Scan(&n))
			require.Positive(t, n)
		}
	}
	r, err := txn.New(pool, &txn.Config{Workflows: reg, Logger: quietLogger(t), LeaseDuration: time.Second, WaitWhenInUse: true})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	resp := untilDone(ctx, t, r, orderKey(1), f.wf)
	require.Equal(t, 201, resp.Status)
	exactlyOnce(t, d, 1)
}
