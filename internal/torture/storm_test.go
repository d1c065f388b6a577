package torture

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

// TestConcurrencyStorm: 64 goroutines hammer 500 keys with random retries,
// with leases short enough to expire mid-phase (so attempts are taken over
// and stale holders fenced) and two resumers running concurrently. A
// checker then verifies from the database and the side-effect log that
// every key executed each phase at most once and finished exactly once, and
// that every caller who got a response got the same one.
func TestConcurrencyStorm(t *testing.T) {
	t.Parallel()
	for it := range iterations() {
		t.Run("", func(t *testing.T) {
			stormOnce(t, int64(it))
		})
	}
}

func stormOnce(t *testing.T, seed int64) {
	const goroutines, keys = 64, 500
	d := newDB(t)
	pool := d.NewPool(t, nil)
	reg := txn.NewRegistry()
	f := newFlow(t, pool, reg, "t.storm")
	// Phases take 0-30 ms; the lease is 25 ms: many expire mid-phase.
	f.delay = func() time.Duration { return time.Duration(rand.N(30)) * time.Millisecond }
	r, err := txn.New(pool, &txn.Config{Workflows: reg, Logger: quietLogger(t), LeaseDuration: 25 * time.Millisecond,
		MaxRetries: 20, RetryBaseDelay: time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	stop := make(chan struct{})
	var resumers sync.WaitGroup
	for range 2 {
		res, err := recovery.New(r, &recovery.Config{ResumeDelay: time.Millisecond,
			Concurrency: 4, MaxAttempts: 1 << 30, Logger: quietLogger(t)})
		require.NoError(t, err)
		resumers.Go(func() {
			for {
				select {
				case <-stop:
					return
				case <-time.After(5 * time.Millisecond):
				}
				_, _ = res.RunOnce(ctx)
			}
		})
	}

	var mu sync.Mutex
	responses := map[int]map[string]int{} // key -> body -> times received
	var finished [keys]atomic.Bool
	var remaining atomic.Int64
	remaining.Store(keys)
	var lost, inUse, other atomic.Int64
	var wg sync.WaitGroup
	rng := rand.New(rand.NewPCG(uint64(seed), 7))
	seeds := make([]uint64, goroutines)
	for i := range seeds {
		seeds[i] = rng.Uint64()
	}
	for g := range goroutines {
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(seeds[g], 1))
			for remaining.Load() > 0 && ctx.Err() == nil {
				i := rnd.IntN(keys)
				resp, err := r.RunWorkflow(ctx, orderKey(i), f.wf)
				switch {
				case err == nil:
					mu.Lock()
					if responses[i] == nil {
						responses[i] = map[string]int{}
					}
					responses[i][string(resp.Body)]++
					mu.Unlock()
					if finished[i].CompareAndSwap(false, true) {
						remaining.Add(-1)
					}
				case errorsIs(err, txn.ErrLeaseLost):
					lost.Add(1)
				case errorsIs(err, txn.ErrKeyInUse):
					inUse.Add(1)
				default:
					other.Add(1)
				}
				time.Sleep(time.Duration(rnd.IntN(5)) * time.Millisecond) // fault timing: a client's random pause before retrying
			}
		})
	}
	wg.Wait()
	close(stop)
	resumers.Wait()
	require.NoError(t, ctx.Err(), "the storm did not finish: %d keys left", remaining.Load())

	// Leases of 25 ms make for many attempts: the resumers' MaxAttempts is
	// lifted so that no key is failed instead of finished.
	require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status <> 'finished'`))
	exactlyOnce(t, d, keys)
	for i := range keys {
		require.Len(t, responses[i], 1, "key %d: every caller got the same response", i)
		var stored []byte
		require.NoError(t, pool.QueryRow(ctx, `SELECT response_body FROM idempotency_keys WHERE key = $1`, orderKey(i).Value).Scan(&stored))
		for body := range responses[i] {
			require.Equal(t, string(stored), body)
		}
	}
	takeovers := d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE attempts > 1`)
	t.Logf("storm: %d lease-lost, %d in-use, %d other transient errors; %d keys taken over; %d provider calls for %d charges",
		lost.Load(), inUse.Load(), other.Load(), takeovers, d.Count(t, `SELECT count(*) FROM provider_calls`), keys)
	require.Positive(t, takeovers, "leases expired mid-phase and keys were taken over")
}
