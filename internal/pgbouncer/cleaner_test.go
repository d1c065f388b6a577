package pgbouncer_test

import (
	"context"
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/cleanup"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

var quiet = slog.New(slog.DiscardHandler)

func sqlExec(t *testing.T, d *pgtest.DB, sql string, args ...any) {
	t.Helper()
	_, err := d.Pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

// cleanupLockClass is the first key of the cleaner's advisory lock ("apcl").
const cleanupLockClass = 0x6170636c

// cleanerRounds runs five cleanup rounds in a row through pool; each must
// run (none finds a lock left over) and leave no lock on any server
// connection of d's database, checked on the server itself.
func cleanerRounds(t *testing.T, d *pgtest.DB, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	c, err := cleanup.New(pool, &cleanup.Config{Logger: quiet, BatchSize: 2})
	require.NoError(t, err)
	for round := range 5 {
		sqlExec(t, d, `INSERT INTO idempotency_keys (scope, key, fingerprint, request_method, request_path,
				recovery_point, status, finished_at, response_status, response_headers, response_body)
			SELECT 'seed', 'r' || $1::int || '-' || i, decode(repeat('ab', 32), 'hex'), 'POST', '/',
				'finished', 'finished', now() - interval '2 days', 201, '{}', '\x7b7d'
			FROM generate_series(1, 5) AS i`, round)
		rep, err := c.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, cleanup.Report{KeysDeleted: 5, Batches: 3}, rep, "round %d", round)
		require.Zero(t, d.Count(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND classid = $1::bigint::oid
			AND objid = (('idempotency_keys'::regclass::oid::bigint + 2147483648) % 4294967296)::oid`,
			cleanupLockClass), "round %d left the cleanup lock held on a server connection", round)
	}
}

func TestCleanerRoundsThroughPgBouncerLeaveNoLockBehind(t *testing.T) {
	t.Parallel()
	b := startBouncer(t)
	for _, mode := range bouncerModes {
		t.Run(modeName(mode), func(t *testing.T) {
			t.Parallel()
			d := pgtest.NewDatabase(t)
			cleanerRounds(t, d, bouncerPool(t, b, d, mode))
		})
	}
}
