package backoff_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/backoff"
)

func TestBackoffDoublesFromBaseUpToMax(t *testing.T) {
	t.Parallel()
	p := backoff.Policy{Base: 100 * time.Millisecond, Max: 30 * time.Second}
	want := []time.Duration{100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000}
	for n, w := range want {
		require.Equal(t, w*time.Millisecond, p.Backoff(n), "retry %d", n)
		require.Equal(t, w*time.Millisecond, p.Delay(n), "without jitter the wait is the backoff")
	}
	for _, n := range []int{62, 63, 64, 1000, math.MaxInt} {
		require.Equal(t, 30*time.Second, p.Backoff(n), "no overflow at retry %d", n)
	}
	require.Equal(t, 100*time.Millisecond, p.Backoff(-1), "a negative retry counts as the first")
	huge := backoff.Policy{Base: time.Duration(math.MaxInt64 / 3), Max: time.Duration(math.MaxInt64)}
	require.Equal(t, time.Duration(math.MaxInt64/3)<<1, huge.Backoff(1))
	require.Equal(t, time.Duration(math.MaxInt64), huge.Backoff(2), "a doubling that overflows is capped")
	require.Zero(t, backoff.Policy{}.Delay(3))
	require.Zero(t, backoff.Policy{Max: time.Second, Jitter: backoff.Equal}.Delay(3), "no base, no wait")
}

func TestEqualJitterDrawsFromTheUpperHalf(t *testing.T) {
	t.Parallel()
	p := backoff.Policy{Base: time.Second, Max: time.Minute, Jitter: backoff.Equal}
	for n := range 100 {
		b := p.Backoff(n)
		for range 50 {
			d := p.Delay(n)
			require.GreaterOrEqual(t, d, b/2)
			require.LessOrEqual(t, d, b)
			if n > 0 && b == 2*p.Backoff(n-1) {
				// Below the cap, no wait is shorter than any before it.
				require.GreaterOrEqual(t, d, p.Backoff(n-1))
			}
		}
	}

	// Both ends of [backoff/2, backoff] are drawn.
	tiny := backoff.Policy{Base: 4, Max: 4, Jitter: backoff.Equal}
	seen := map[time.Duration]bool{}
	for range 1000 {
		seen[tiny.Delay(0)] = true
	}
	require.Equal(t, map[time.Duration]bool{2: true, 3: true, 4: true}, seen)
}

func TestSleepEndsWithItsContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	began := time.Now()
	require.ErrorIs(t, backoff.Sleep(ctx, time.Hour), context.Canceled)
	require.Less(t, time.Since(began), time.Minute)
	require.NoError(t, backoff.Sleep(context.Background(), time.Millisecond))
}
