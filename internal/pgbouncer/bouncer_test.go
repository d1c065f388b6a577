package pgbouncer_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgbouncer"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// bouncerPool returns a pool that reaches d's database through b, after
// making PgBouncer open several server connections to it (see warm).
func bouncerPool(t *testing.T, b *pgbouncer.Bouncer, d *pgtest.DB, mode pgx.QueryExecMode) *pgxpool.Pool {
	t.Helper()
	cs, err := b.ConnString(d.URL, d.Database, mode)
	require.NoError(t, err)
	pool := newPool(t, cs)
	warm(t, pool, 3)
	return pool
}

func newPool(t *testing.T, connString string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	require.NoError(t, err)
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// warm makes PgBouncer open n server connections to the pool's database,
// by holding n transactions at once. With several idle server connections
// and server_round_robin, consecutive transactions of one client go to
// different server connections, so that session state shows at once.
func warm(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	ctx := context.Background()
	var txs []pgx.Tx
	for range n {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, "SELECT pg_backend_pid()")
		require.NoError(t, err)
		txs = append(txs, tx)
	}
	for _, tx := range txs {
		require.NoError(t, tx.Rollback(ctx))
	}
}

// The harness reaches a test's own database through PgBouncer, and its
// configuration moves one client between server connections from one
// transaction to the next: what the other tests rely on to expose session
// state.
func TestBouncerReachesAnyDatabaseAndRotatesServerConnections(t *testing.T) {
	t.Parallel()
	b := startBouncer(t)
	d := pgtest.NewDatabase(t)
	pool := bouncerPool(t, b, d, pgx.QueryExecModeExec)
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	var db string
	require.NoError(t, conn.QueryRow(ctx, "SELECT current_database()").Scan(&db))
	require.Equal(t, d.Database, db)
	pids := map[uint32]bool{}
	for range 6 {
		var pid uint32
		require.NoError(t, conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))
		pids[pid] = true
	}
	require.GreaterOrEqual(t, len(pids), 2, "one client connection, several server connections")
}
