package pgbouncer_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/txn"
)

// PgBouncer 1.18 refuses a connection that sends search_path or options as
// a startup parameter, which is why the tests behind it use a database of
// their own and the README sets search_path on the role.
func TestPgBouncer118RefusesSearchPathAndOptionsStartupParameters(t *testing.T) {
	t.Parallel()
	b := startBouncer(t)
	d := pgtest.NewDatabase(t)
	for name, param := range map[string][2]string{
		"search_path": {"search_path", "public"},
		"options":     {"options", "-c search_path=public"},
	} {
		cfg, err := b.Config(d.URL, d.Database, pgx.QueryExecModeExec)
		require.NoError(t, err)
		cfg.RuntimeParams[param[0]] = param[1]
		conn, err := pgx.ConnectConfig(context.Background(), cfg)
		if err == nil {
			_ = conn.Close(context.Background())
		}
		require.ErrorContains(t, err, "unsupported startup parameter", name)
	}
}

// What the README prescribes instead: search_path set on the role (here on
// the server user, in the test's own database only) applies to every server
// connection PgBouncer opens, so migrations.Up and Run through it use that
// schema, in each bouncer mode.
func TestSearchPathSetOnTheRoleReachesPooledServerConnections(t *testing.T) {
	t.Parallel()
	b := startBouncer(t)
	d := pgtest.NewEmptyDatabase(t)
	ctx := context.Background()
	var user string
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT current_user`).Scan(&user))
	sqlExec(t, d, `CREATE SCHEMA app`)
	sqlExec(t, d, `ALTER ROLE `+pgx.Identifier{user}.Sanitize()+` IN DATABASE `+pgx.Identifier{d.Database}.Sanitize()+
		` SET search_path = app`)
	for i, mode := range bouncerModes {
		pool := bouncerPool(t, b, d, mode)
		var schema string
		require.NoError(t, pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema))
		require.Equal(t, "app", schema, modeName(mode))
		require.NoError(t, migrations.Up(ctx, pool), modeName(mode))
		runner, err := txn.New(pool, &txn.Config{Logger: quiet})
		require.NoError(t, err)
		resp, err := runner.Run(ctx, txn.Key{Scope: "acct", Value: fmt.Sprint("k", i), Method: "POST", Path: "/",
			Params: []byte(`{}`)}, func(context.Context, pgx.Tx) (txn.Response, error) {
			return txn.Response{Status: 204}, nil
		})
		require.NoError(t, err, modeName(mode))
		require.Equal(t, 204, resp.Status)
	}
	require.Equal(t, len(bouncerModes), d.Count(t, `SELECT count(*) FROM app.idempotency_keys`))
	require.Zero(t, d.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = 'public'`), "nothing in public")
}
