// Package pgtest gives each test an isolated PostgreSQL schema, migrated with
// the real goose migrations, on a real server.
//
// The server is found once per test binary, in this order:
//  1. TEST_DATABASE_URL, when set;
//  2. a PostgreSQL container started with testcontainers-go, when a Docker
//     engine answers;
//  3. a throwaway local cluster started from the installed PostgreSQL
//     binaries (initdb and pg_ctl), when they are found;
//  4. otherwise the test fails with a message naming the three options.
//
// Nothing is skipped: a test that needs a database and cannot get one fails.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
	"go.uber.org/goleak"

	"github.com/atomicphase/atomicphase/internal/connstr"
	"github.com/atomicphase/atomicphase/internal/pgcluster"
	"github.com/atomicphase/atomicphase/migrations"
)

// EnvURL names the environment variable holding the test server's URL.
const EnvURL = "TEST_DATABASE_URL"

var (
	serverOnce sync.Once
	serverURL  string
	serverErr  error
	teardown   func()
	atExit     []func()
	atExitMu   sync.Mutex
)

// AtExit registers f to run when Main ends, after the tests and before the
// shared server stops (e.g. to remove binaries a package's tests built).
func AtExit(f func()) {
	atExitMu.Lock()
	defer atExitMu.Unlock()
	atExit = append(atExit, f)
}

// Main runs a package's tests, then stops any server this binary started and
// fails the run if goroutines leaked. Call it from TestMain:
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
func Main(m *testing.M, ignore ...goleak.Option) {
	code := m.Run()
	atExitMu.Lock()
	for i := len(atExit) - 1; i >= 0; i-- {
		atExit[i]()
	}
	atExitMu.Unlock()
	StopServer()
	if code == 0 {
		opts := append([]goleak.Option{
			// Started by database/sql's connector inside goose; it ends with the process.
			goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
		}, ignore...)
		if err := goleak.Find(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// StopServer stops the server this binary started (a container or a local
// cluster), if any; Main calls it after the tests. Nothing may use the
// server afterwards.
func StopServer() {
	if teardown != nil {
		teardown()
		teardown = nil
	}
}

// ServerURL returns the connection string of the shared test server,
// starting one if needed (see the package documentation).
func ServerURL(tb testing.TB) string {
	tb.Helper()
	return findServerURL(tb)
}

func findServerURL(tb tbLike) string {
	tb.Helper()
	serverOnce.Do(func() { serverURL, teardown, serverErr = findServer() })
	if serverErr != nil {
		tb.Fatalf("pgtest: no PostgreSQL for tests: %v", serverErr)
	}
	return serverURL
}

func findServer() (string, func(), error) {
	if url := os.Getenv(EnvURL); url != "" {
		return url, nil, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var reasons []string
	if dockerAnswers(ctx) {
		url, stop, err := startContainer(ctx)
		if err == nil {
			return url, stop, nil
		}
		reasons = append(reasons, "testcontainers: "+err.Error())
	} else {
		reasons = append(reasons, "no Docker engine answers")
	}
	cluster, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err == nil {
		return cluster.ConnString("postgres"), func() { _ = cluster.Stop() }, nil
	}
	reasons = append(reasons, err.Error())
	return "", nil, fmt.Errorf("set %s to a PostgreSQL URL, start a Docker engine, or install PostgreSQL's server binaries (%s)",
		EnvURL, strings.Join(reasons, "; "))
}

func dockerAnswers(ctx context.Context) bool {
	if os.Getenv("DOCKER_HOST") == "" {
		if _, err := os.Stat("/var/run/docker.sock"); err != nil {
			return false
		}
	}
	p, err := testcontainers.NewDockerProvider()
	if err != nil {
		return false
	}
	defer p.Close()
	hctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return p.Health(hctx) == nil
}

func startContainer(ctx context.Context) (string, func(), error) {
	c, err := tcpostgres.Run(ctx, "postgres:15-alpine",
		tcpostgres.WithDatabase("test"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		return "", nil, err
	}
	url, err := c.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		_ = c.Terminate(context.Background())
		return "", nil, err
	}
	return url, func() { _ = c.Terminate(context.Background()) }, nil
}

// DB is one test's isolated schema on the shared server: a schema of its
// own in the shared database (New), or the public schema of a database of
// its own (NewDatabase).
type DB struct {
	// Pool is connected to the test's schema.
	Pool *pgxpool.Pool
	// Schema is the test's schema: its own, dropped when the test ends, or
	// public in a database of its own.
	Schema string
	// URL is the connection string of the shared database (for New), or of
	// the test's database (for NewDatabase), without any search_path.
	URL string
	// Database is the test's own database, dropped when the test ends; ""
	// for a schema in the shared database.
	Database string
}

// ConnString returns a connection string for the test's schema, in the
// form of a keyword/value string whatever the form of the server's (see
// internal/connstr), to hand to another process.
func (d *DB) ConnString(tb testing.TB) string {
	tb.Helper()
	if d.Database != "" {
		return d.URL
	}
	s, err := connstr.WithSearchPath(d.URL, d.Schema)
	if err != nil {
		tb.Fatalf("pgtest: connection string: %v", err)
	}
	return s
}

// New creates a schema for the test, applies the migrations in it, and
// returns a pool whose connections use it. Everything is removed at cleanup.
func New(tb testing.TB) *DB {
	tb.Helper()
	return newSchema(tb, true)
}

// Example gives a runnable Example, which has no testing.TB, a schema of its
// own on the test server, as New does for a test: migrated when migrate is
// true, else empty (for an example that migrates it). The returned function
// closes the pool and drops the schema; call it before the example returns.
// A failure panics, which fails the example.
func Example(migrate bool) (*DB, func()) {
	t := &exampleT{}
	d := newSchema(t, migrate)
	return d, t.cleanup
}

func newSchema(tb tbLike, migrate bool) *DB {
	tb.Helper()
	url := findServerURL(tb)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	schema := "apt_" + randomHex(6)
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("pgtest: connect: %v", err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		tb.Fatalf("pgtest: create schema: %v", err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			tb.Errorf("pgtest: drop schema: %v", err)
			return
		}
		defer conn.Close(context.Background())
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			tb.Errorf("pgtest: drop schema: %v", err)
		}
	})

	d := &DB{Schema: schema, URL: url}
	d.Pool = d.newPool(tb, nil)
	if !migrate {
		return d
	}
	if err := migrations.Up(ctx, d.Pool); err != nil {
		tb.Fatalf("pgtest: migrate: %v", err)
	}
	return d
}

// NewDatabase creates a database of the test's own, applies the migrations
// in its public schema, and returns it; the database is dropped (its
// connections ended) at cleanup. Use it where a schema cannot be chosen per
// connection: behind PgBouncer, which does not pass search_path on, or for
// tools that connect with a plain connection string.
func NewDatabase(tb testing.TB) *DB {
	tb.Helper()
	d := newDatabase(tb)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := migrations.Up(ctx, d.Pool); err != nil {
		tb.Fatalf("pgtest: migrate: %v", err)
	}
	return d
}

// NewEmptyDatabase is NewDatabase without the migrations.
func NewEmptyDatabase(tb testing.TB) *DB {
	tb.Helper()
	return newDatabase(tb)
}

func newDatabase(tb testing.TB) *DB {
	tb.Helper()
	server := ServerURL(tb)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := "apt_" + randomHex(6)
	admin, err := pgx.Connect(ctx, server)
	if err != nil {
		tb.Fatalf("pgtest: connect: %v", err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		tb.Fatalf("pgtest: create database: %v", err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		conn, err := pgx.Connect(ctx, server)
		if err != nil {
			tb.Errorf("pgtest: drop database: %v", err)
			return
		}
		defer conn.Close(context.Background())
		// FORCE ends the connections a pooler may still hold to it.
		if _, err := conn.Exec(ctx, "DROP DATABASE "+name+" WITH (FORCE)"); err != nil {
			tb.Errorf("pgtest: drop database: %v", err)
		}
	})
	url, err := connstr.Edit(server, func(c *pgx.ConnConfig) { c.Database = name })
	if err != nil {
		tb.Fatalf("pgtest: connection string: %v", err)
	}
	d := &DB{Schema: "public", URL: url, Database: name}
	d.Pool = d.NewPool(tb, nil)
	return d
}

// Pool is shorthand for New(tb).Pool.
func Pool(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	return New(tb).Pool
}

// NewPool opens another pool on the test's schema, after letting configure
// adjust its configuration (for example to connect through a proxy). The
// pool is closed at cleanup.
func (d *DB) NewPool(tb testing.TB, configure func(*pgxpool.Config)) *pgxpool.Pool {
	tb.Helper()
	return d.newPool(tb, configure)
}

func (d *DB) newPool(tb tbLike, configure func(*pgxpool.Config)) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(d.URL)
	if err != nil {
		tb.Fatalf("pgtest: parse url: %v", err)
	}
	if d.Database == "" {
		cfg.ConnConfig.RuntimeParams["search_path"] = d.Schema
	}
	cfg.MaxConns = 20
	if configure != nil {
		configure(cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("pgtest: pool: %v", err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// Count runs a "SELECT count(*) ..." style query on the test's schema and
// returns the number, failing the test on error.
func (d *DB) Count(tb testing.TB, query string, args ...any) int {
	tb.Helper()
	var n int
	if err := d.Pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		tb.Fatalf("pgtest: count %q: %v", query, err)
	}
	return n
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // never fails: crypto/rand aborts the process instead
	return hex.EncodeToString(b)
}

// tbLike is what the helpers need of a testing.TB, so that Example can
// serve examples, which have none.
type tbLike interface {
	Helper()
	Fatalf(format string, args ...any)
	Errorf(format string, args ...any)
	Cleanup(func())
}

// exampleT is the tbLike of an Example: failures panic, and cleanups run
// when the example calls cleanup.
type exampleT struct {
	mu       sync.Mutex
	cleanups []func()
}

func (*exampleT) Helper() {}

func (*exampleT) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }

func (*exampleT) Errorf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }

func (t *exampleT) Cleanup(f func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cleanups = append(t.cleanups, f)
}

func (t *exampleT) cleanup() {
	t.mu.Lock()
	fs := t.cleanups
	t.cleanups = nil
	t.mu.Unlock()
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}
