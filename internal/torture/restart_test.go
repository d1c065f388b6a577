package torture

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgcluster"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/txn"
)

// TestPostgresRestartUnderLoad restarts a throwaway cluster of its own
// (never the shared server), with fast and then immediate shutdown, in the
// middle of a concurrent load. Every operation acknowledged as finished is
// still finished with the acknowledged response; every other one completes
// on retry.
func TestPostgresRestartUnderLoad(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"fast", "immediate"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			cluster, err := pgcluster.Start(ctx, pgcluster.Options{Durable: true})
			if errors.Is(err, pgcluster.ErrNoBinaries) && os.Getenv("CI") == "" {
				t.Skip("needs PostgreSQL server binaries for a cluster of its own; CI has them")
			}
			require.NoError(t, err)
			t.Cleanup(func() { _ = cluster.Stop() })
			cfg, err := pgxpool.ParseConfig(cluster.ConnString("postgres"))
			require.NoError(t, err)
			cfg.MaxConns = 16
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			require.NoError(t, migrations.Up(ctx, pool))
			_, err = pool.Exec(ctx, flowSchema)
			require.NoError(t, err)
			d := &pgtest.DB{Pool: pool}

			reg := txn.NewRegistry()
			f := newFlow(t, pool, reg, "t.restart")
			f.delay = func() time.Duration { return 2 * time.Millisecond }
			r, err := txn.New(pool, &txn.Config{Workflows: reg, Logger: quietLogger(t), LeaseDuration: time.Second, ReleaseTimeout: 300 * time.Millisecond})
			require.NoError(t, err)

			const keys = 120
			var acked sync.Map // key index -> response body acknowledged to the caller
			var done atomic.Int64
			var wg sync.WaitGroup
			next := atomic.Int64{}
			for range 8 {
				wg.Go(func() {
					for {
						i := int(next.Add(1)) - 1
						if i >= keys {
							return
						}
						for {
							resp, err := r.RunWorkflow(ctx, orderKey(i), f.wf)
							if err == nil {
								acked.Store(i, string(resp.Body))
								done.Add(1)
								break
							}
							if ctx.Err() != nil {
								t.Errorf("key %d never completed: %v", i, err)
								return
							}
							time.Sleep(50 * time.Millisecond) // a client's pause before it retries
						}
					}
				})
			}
			for done.Load() < keys/3 {
				time.Sleep(10 * time.Millisecond)
			}
			require.NoError(t, cluster.Restart(ctx, mode))
			wg.Wait()

			exactlyOnce(t, d, keys)
			acked.Range(func(k, v any) bool {
				var body []byte
				require.NoError(t, pool.QueryRow(ctx, `SELECT response_body FROM idempotency_keys WHERE key = $1`, orderKey(k.(int)).Value).Scan(&body))
				require.Equal(t, v.(string), string(body), "the acknowledged response survived the restart")
				return true
			})
		})
	}
}
