package txn_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

// A workflow key's insert that commits while the caller sees an error (the
// connection is cut right after the commit) does not hold the key for a
// whole lease: the attempt removes it, so the client's retry runs at once.
func TestAmbiguousKeyInsertDoesNotHoldTheKeyForALease(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil) // a 90 s lease
	ctx := ctxT(t)
	proxy, pool := e.NewProxy(t)
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	f := newRideFlow(t, e.reg, "ride")

	proxy.CutAfterNextStatement("INSERT 0 1")
	_, err = r.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.Error(t, err, "the caller sees the insert fail")
	select {
	case <-proxy.CommitCut():
	default:
		t.Fatal("the insert's answer was not cut")
	}
	require.Zero(t, f.p1.Load(), "nothing ran")
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`), "the committed insert was removed")

	resp, err := r.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err, "the retry is not answered ErrKeyInUse")
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), f.p1.Load())
	require.Equal(t, 1, f.prov.distinct())
}

// A lease is extended from the time of the phase's commit, not from the
// start of its transaction: a phase that runs longer than the lease commits
// a lease that is still live, so no other attempt may take the key over.
func TestLeaseOutlivesAPhaseLongerThanTheLease(t *testing.T) {
	t.Parallel()
	const lease, phase = time.Second, 1200 * time.Millisecond
	e := newEnv(t, &txn.Config{LeaseDuration: lease})
	ctx := ctxT(t)
	var counted, remaining float64 // seconds
	var inUse error
	var wf *txn.Workflow
	wf = txn.NewWorkflow("slow_phase", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "slow", func(ctx context.Context, tx pgx.Tx) (int, error) {
			// The phase outlasts the lease (a slow query, a lock wait).
			_, err := tx.Exec(ctx, `SELECT pg_sleep($1)`, phase.Seconds())
			return 1, err
		}); err != nil {
			return txn.Response{}, err
		}
		// last_run_at is the phase transaction's start (now()); the lease
		// must count from after the phase's work.
		if err := e.Pool.QueryRow(ctx, `SELECT extract(epoch FROM leased_until - last_run_at),
			extract(epoch FROM leased_until - clock_timestamp()) FROM idempotency_keys WHERE key = 'k1'`).
			Scan(&counted, &remaining); err != nil {
			return txn.Response{}, err
		}
		_, inUse = e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
		return txn.JSON(201, "done")
	})
	require.NoError(t, e.reg.Register(wf))
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.GreaterOrEqual(t, counted, (lease + phase).Seconds(), "the lease counts from the commit, not the phase's start")
	require.Greater(t, remaining, 0.0, "the lease is live after the commit")
	require.ErrorIs(t, inUse, txn.ErrKeyInUse, "a concurrent retry cannot take the key over")
	require.Equal(t, 1, readKey(t, e.Pool, "user_1", "k1").Attempts)
}
