package scenarios

import (
	"bytes"
	"context"
	"image/png"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
)

// TestMain gives the package's tests a database of their own: the scenarios
// empty the tables of the database they run on, so with BENCH_DATABASE_URL
// they use a sibling database (created if missing) rather than the one the
// benchmarks of the other packages use; without it each test binary starts
// its own throwaway cluster.
func TestMain(m *testing.M) {
	if u := os.Getenv(harness.EnvDatabaseURL); u != "" {
		parsed, err := url.Parse(u)
		if err == nil {
			parsed.Path = strings.TrimPrefix(parsed.Path, "/") + "_scenarios_test"
			_ = os.Setenv(harness.EnvDatabaseURL, parsed.String())
		}
	}
	goleak.VerifyTestMain(m)
}

// TestRunScale runs the scale mode on small tables and checks what it
// reports: the keys it inserts are the ones ExistingKey names, with the
// fingerprint a Run of the same request computes (so every replay and every
// Resume finds a finished key and no cell has an error, and no new key is
// taken for a finished one), the relay drains both backlogs, and the report
// and the chart are written.
func TestRunScale(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env, err := harness.Setup(ctx, true, nil)
	require.NoError(t, err)
	defer env.Close()
	s := &Suite{
		Env: env, Timing: harness.Timing{Warmup: 100 * time.Millisecond, Duration: 400 * time.Millisecond},
		Concurrency: []int{1, 2}, DrainMessages: 200,
	}
	require.NoError(t, s.Prepare(ctx))

	// The Go spelling of a key matches the SQL that inserts it.
	pool, _, err := env.NewPool(ctx, 2)
	require.NoError(t, err)
	defer pool.Close()
	for _, g := range []int{1, 42, 1_000_000} {
		var want string
		require.NoError(t, pool.QueryRow(ctx, "SELECT md5($1::int::text)::uuid::text", g).Scan(&want))
		require.Equal(t, want, ExistingKey(g), "key %d", g)
	}
	require.NotEqual(t, randomKey(), randomKey())

	rep, err := s.RunScale(ctx, []int{300, 3000}, 2000)
	require.NoError(t, err)
	require.Len(t, rep.Points, 2)
	for _, p := range rep.Points {
		for _, c := range s.Concurrency {
			for _, op := range ScaleOps {
				res, ok := p.Results[ScaleCell{op, c}]
				require.True(t, ok, "%d keys, %s, c=%d: not measured", p.Keys, op, c)
				require.NoError(t, res.FirstError, "%d keys, %s, c=%d", p.Keys, op, c)
				require.Positive(t, res.Ops, "%d keys, %s, c=%d", p.Keys, op, c)
			}
		}
		require.Positive(t, p.HeapBytes)
		require.GreaterOrEqual(t, p.IndexBytes, p.KeyIndexBytes)
		require.Contains(t, p.Plans, "idempotency_keys_scope_key_uniq", "the lookup reads the (scope, key) index")
	}
	require.Len(t, rep.Drains, 2)
	require.Equal(t, 200, rep.Drains[0].Messages)
	require.Equal(t, 2000, rep.Drains[1].Messages)
	var pending int
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM outbox_messages WHERE published_at IS NULL").Scan(&pending))
	require.Zero(t, pending, "the relay published the whole backlog")

	var md bytes.Buffer
	rep.Markdown(&md)
	require.Contains(t, md.String(), "| 3k |")
	require.Contains(t, md.String(), "- Goal: replay and Run latency (p50, c=2) at 3k keys within 1.3× of 300")
	require.Contains(t, md.String(), "| 2k |")

	file := filepath.Join(t.TempDir(), "scale.png")
	require.NoError(t, rep.Chart(file))
	f, err := os.Open(file)
	require.NoError(t, err)
	defer f.Close()
	cfg, err := png.DecodeConfig(f)
	require.NoError(t, err)
	require.Greater(t, cfg.Width, 300)
}
