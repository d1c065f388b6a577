package pgbouncer_test

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
)

// migrations.Up at service start works through PgBouncer: its lock is
// transaction-scoped, and four services starting at once apply each
// migration once.
func TestMigrationsUpThroughPgBouncer(t *testing.T) {
	t.Parallel()
	b := startBouncer(t)
	for _, mode := range bouncerModes {
		t.Run(modeName(mode), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			d := pgtest.NewEmptyDatabase(t)
			var wg sync.WaitGroup
			errs := make(chan error, 4)
			for range 4 {
				pool := bouncerPool(t, b, d, mode)
				wg.Go(func() { errs <- migrations.Up(ctx, pool) })
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			pool := bouncerPool(t, b, d, mode)
			require.NoError(t, migrations.Check(ctx, pool))
			require.Equal(t, 1, d.Count(t, `SELECT count(DISTINCT version_id) FILTER (WHERE version_id > 0)
				/ greatest(count(*) FILTER (WHERE version_id > 0), 1) FROM `+migrations.TableName),
				"each version recorded once")
			require.NoError(t, migrations.DownTo(ctx, pool, 0))
			require.NoError(t, migrations.Up(ctx, pool))
			require.Zero(t, d.Count(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
				AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`))
		})
	}
}
