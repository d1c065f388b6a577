package pgbouncer_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/connstr"
	"github.com/atomicphase/atomicphase/internal/pgbouncer"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// allModes are pgx's query exec modes; straight to PostgreSQL every public
// path works in each.
var allModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement,
	pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec,
	pgx.QueryExecModeSimpleProtocol,
}

// bouncerModes are the modes that can work behind PgBouncer 1.18 in
// transaction pooling mode, for any pgx client: each query is a single
// round trip, with the unnamed statement or a simple query.
var bouncerModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeExec,
	pgx.QueryExecModeSimpleProtocol,
}

func modeName(mode pgx.QueryExecMode) string { return connstr.ExecModeName(mode) }

// connectThrough opens a plain pgx connection to d's database through b.
func connectThrough(t *testing.T, b *pgbouncer.Bouncer, d *pgtest.DB, mode pgx.QueryExecMode) *pgx.Conn {
	t.Helper()
	cfg, err := b.Config(d.URL, d.Database, mode)
	require.NoError(t, err)
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// threeServerConnections returns a fresh database for which PgBouncer holds
// three idle server connections: with server_round_robin, a client's next
// three transactions go to each of them in turn.
func threeServerConnections(t *testing.T, b *pgbouncer.Bouncer) *pgtest.DB {
	t.Helper()
	d := pgtest.NewEmptyDatabase(t)
	cs, err := b.ConnString(d.URL, d.Database, pgx.QueryExecModeSimpleProtocol)
	require.NoError(t, err)
	warm(t, newPool(t, cs), 3)
	return d
}

// PgBouncer 1.18 keeps no track of prepared statements (max_prepared_statements
// arrived in 1.21), and in transaction mode a statement prepared in one
// transaction is gone, or belongs to another client, in the next. pgx's
// default mode prepares each query once per client connection under a name
// and executes it by that name in a later round trip, so any pgx client in
// that mode fails behind it: here the statement was prepared on one server
// connection and executed on another (26000); two clients sharing a server
// connection get 42P05 instead.
func TestCacheStatementModeCannotWorkBehindPgBouncer118(t *testing.T) {
	t.Parallel()
	b := startBouncer(t)
	d := threeServerConnections(t, b)
	conn := connectThrough(t, b, d, pgx.QueryExecModeCacheStatement)
	var n int
	err := conn.QueryRow(context.Background(), "SELECT $1::int * 2", 21).Scan(&n)
	require.Error(t, err)
	t.Log(err)
	require.Contains(t, []string{"26000", "42P05"}, pgerr.Code(err), err.Error())
}

// describe_exec describes the query with the unnamed statement in one round
// trip and binds and executes the unnamed statement in the next. Behind a
// transaction-pooling PgBouncer the second round trip may run on another
// server connection, where the unnamed statement is whatever another client
// parsed last: here it silently runs that client's query with this client's
// argument. No pgx client can use this mode behind PgBouncer 1.18 (nor a
// later one: PgBouncer tracks only named statements).
func TestDescribeExecModeCannotWorkBehindPgBouncer118(t *testing.T) {
	t.Parallel()
	b := startBouncer(t)
	d := threeServerConnections(t, b)
	ctx := context.Background()

	// Another client leaves "SELECT $1::int + 1000" as the unnamed statement
	// of all three server connections (exec mode: one round trip each).
	other := connectThrough(t, b, d, pgx.QueryExecModeExec)
	for range 3 {
		var n int
		require.NoError(t, other.QueryRow(ctx, "SELECT $1::int + 1000", 1).Scan(&n))
		require.Equal(t, 1001, n)
	}

	conn := connectThrough(t, b, d, pgx.QueryExecModeDescribeExec)
	var n int
	err := conn.QueryRow(ctx, "SELECT $1::int * 2", 21).Scan(&n)
	require.NoError(t, err, "no error: worse")
	require.Equal(t, 1021, n, "the other client's query ran with this client's argument")

	// The same query in the modes that work is right every time.
	for _, mode := range bouncerModes {
		conn := connectThrough(t, b, d, mode)
		for range 3 {
			require.NoError(t, conn.QueryRow(ctx, "SELECT $1::int * 2", 21).Scan(&n))
			require.Equal(t, 42, n, modeName(mode))
		}
	}
}
