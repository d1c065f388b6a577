package migrations_test

import (
	"context"
	"io/fs"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func tables(t *testing.T, d *pgtest.DB) []string {
	t.Helper()
	rows, err := d.Pool.Query(context.Background(),
		`SELECT table_name FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1`, d.Schema)
	require.NoError(t, err)
	var names []string
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		names = append(names, n)
	}
	require.NoError(t, rows.Err())
	return names
}

// files returns the embedded migration file names.
func files(t *testing.T) []string {
	t.Helper()
	names, err := fs.Glob(migrations.FS, "*.sql")
	require.NoError(t, err)
	require.NotEmpty(t, names)
	return names
}

func TestUpUsesItsOwnVersionTable(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t) // migrated with migrations.Up
	require.Equal(t, []string{migrations.TableName, "idempotency_key_tombstones", "idempotency_keys", "inbox_messages", "outbox_messages"}, tables(t, d),
		"no goose_db_version table of the host application's is created")
	require.NoError(t, migrations.Check(context.Background(), d.Pool))
	require.NoError(t, migrations.Up(context.Background(), d.Pool), "Up is idempotent")
}

func TestDownMigrationsWorkAndCheckNamesTheMissingOne(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	require.NoError(t, migrations.DownTo(ctx, d.Pool, 1))
	require.Equal(t, []string{migrations.TableName, "idempotency_keys"}, tables(t, d))
	err := migrations.Check(ctx, d.Pool)
	require.ErrorIs(t, err, migrations.ErrSchemaBehind)
	require.Contains(t, err.Error(), "00002_outbox_messages.sql")

	require.NoError(t, migrations.DownTo(ctx, d.Pool, 0))
	require.Equal(t, []string{migrations.TableName}, tables(t, d))
	require.NoError(t, migrations.Up(ctx, d.Pool))
	require.Equal(t, []string{migrations.TableName, "idempotency_key_tombstones", "idempotency_keys", "inbox_messages", "outbox_messages"}, tables(t, d))
}

func TestConcurrentUpAppliesEachMigrationOnce(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	require.NoError(t, migrations.DownTo(ctx, d.Pool, 0))
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pool := d.NewPool(t, func(c *pgxpool.Config) { c.MaxConns = 4 })
			errs <- migrations.Up(ctx, pool)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, len(files(t)), d.Count(t, `SELECT count(*) FROM `+migrations.TableName+` WHERE version_id > 0 AND is_applied`))
}

func TestSchemaRejectsInvalidRowsItself(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	insert := `INSERT INTO idempotency_keys (scope, key, fingerprint, request_method, request_path) VALUES ('', $1, $2, 'POST', '/')`
	fp := make([]byte, 32)
	for _, bad := range []string{"", "tab\there", string(make([]byte, 256))} {
		_, err := d.Pool.Exec(ctx, insert, bad, fp)
		require.Error(t, err, "key %q", bad)
	}
	_, err := d.Pool.Exec(ctx, insert, "ok", []byte("short"))
	require.Error(t, err, "fingerprint must be a sha256")
	_, err = d.Pool.Exec(ctx, insert, "ok", fp)
	require.NoError(t, err)
	_, err = d.Pool.Exec(ctx, `UPDATE idempotency_keys SET status = 'finished'`)
	require.Error(t, err, "a terminal key needs a response and a finish time")
	_, err = d.Pool.Exec(ctx, insert, "ok", fp)
	require.Error(t, err, "unique per scope and key")
}
