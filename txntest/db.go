package txntest

import (
	"os"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// EnvDatabaseURL names the environment variable DB reads first: the URL (or
// key=value connection string) of a PostgreSQL server the tests may create
// schemas in.
const EnvDatabaseURL = pgtest.EnvURL

// DB returns a pool connected to a schema of the test's own on a real
// PostgreSQL server, with atomicphase's migrations applied: the tables a
// txn.Runner, the outbox and recovery need, and nothing else. The pool is
// closed and the schema dropped when the test ends. Tests that call DB may
// run in parallel: each gets its own schema.
//
// The server is found once per test binary, in this order:
//  1. TEST_DATABASE_URL (EnvDatabaseURL), when set;
//  2. a PostgreSQL container started with testcontainers-go, when a Docker
//     engine answers;
//  3. a throwaway local cluster started from the installed PostgreSQL
//     server binaries (initdb and pg_ctl: PG_BINDIR, pg_config --bindir,
//     /usr/lib/postgresql/*/bin or PATH), on a private Unix socket;
//  4. otherwise the test fails with a message naming the three options.
//
// A container or a cluster is stopped by Main (or StopServer), so call Main
// from the package's TestMain; without it a local cluster outlives the test
// binary.
func DB(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	d := pgtest.New(tb)
	noteSchema(d.Schema)
	return d.Pool
}

// Main runs a package's tests, then stops the PostgreSQL server DB or
// CrashEveryBoundary started for them, if they started one, and exits with
// the tests' status. Call it from TestMain:
//
//	func TestMain(m *testing.M) { txntest.Main(m) }
//
// A TestMain with more to do after the tests calls m.Run and then
// StopServer itself.
func Main(m *testing.M) {
	code := m.Run()
	StopServer()
	os.Exit(code)
}

// StopServer stops the container or local cluster started for the tests,
// if one was started. Nothing may use DB afterwards.
func StopServer() { pgtest.StopServer() }
