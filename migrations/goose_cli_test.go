package migrations_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
)

// gooseTags leave only the PostgreSQL driver in the goose CLI, so that its
// build needs no module beyond go.mod's (see goosecli_deps_test.go).
const gooseTags = "no_clickhouse no_libsql no_mssql no_mysql no_sqlite3 no_vertica no_ydb"

var (
	gooseOnce sync.Once
	gooseBin  string
	gooseErr  error
)

// buildGoose builds the goose CLI at the goose version in go.mod, once per
// test binary, into a folder removed when the tests end.
func buildGoose(t *testing.T) string {
	t.Helper()
	gooseOnce.Do(func() {
		dir, err := os.MkdirTemp("", "goose-cli")
		if err != nil {
			gooseErr = err
			return
		}
		pgtest.AtExit(func() { _ = os.RemoveAll(dir) })
		gooseBin = filepath.Join(dir, "goose")
		out, err := exec.Command("go", "build", "-tags", gooseTags, "-o", gooseBin,
			"github.com/pressly/goose/v3/cmd/goose").CombinedOutput()
		if err != nil {
			gooseErr = errors.New("go build goose: " + err.Error() + "\n" + string(out))
		}
	})
	require.NoError(t, gooseErr)
	return gooseBin
}

// migrationsDir is this package's folder, where the .sql files are.
func migrationsDir(t *testing.T) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	require.True(t, ok)
	return filepath.Dir(file)
}

type gooseRun struct {
	cmd    *exec.Cmd
	output bytes.Buffer
}

// startGoose starts the goose CLI on d's database: goose -dir <this
// folder> [flags] postgres <d.URL> command...
func startGoose(t *testing.T, d *pgtest.DB, env, flags []string, command ...string) *gooseRun {
	t.Helper()
	args := append([]string{"-dir", migrationsDir(t), "-env", "none"}, flags...)
	args = append(append(args, "postgres", d.URL), command...)
	r := &gooseRun{cmd: exec.Command(buildGoose(t), args...)}
	r.cmd.Dir = t.TempDir()
	r.cmd.Env = append(os.Environ(), env...)
	r.cmd.Stdout, r.cmd.Stderr = &r.output, &r.output
	require.NoError(t, r.cmd.Start())
	t.Cleanup(func() {
		if r.cmd.ProcessState == nil {
			_ = r.cmd.Process.Kill()
			_ = r.cmd.Wait()
		}
	})
	return r
}

// wait returns the CLI's exit code and output.
func (r *gooseRun) wait(t *testing.T) (int, string) {
	t.Helper()
	err := r.cmd.Wait()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.ExitCode(), r.output.String()
	}
	require.NoError(t, err)
	return 0, r.output.String()
}

func runGoose(t *testing.T, d *pgtest.DB, env, flags []string, command ...string) (int, string) {
	t.Helper()
	return startGoose(t, d, env, flags, command...).wait(t)
}

// withTable is the flag every goose command for these migrations needs.
var withTable = []string{"-table", migrations.TableName}

// freshDatabase returns a database of the test's own with nothing in it,
// not even a version table.
func freshDatabase(t *testing.T) *pgtest.DB {
	t.Helper()
	return pgtest.NewEmptyDatabase(t)
}

// waitingOnVersionTable polls until some session waits for a lock on d's
// version table.
func waitingOnVersionTable(t *testing.T, d *pgtest.DB) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for d.Count(t, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass($1)`, migrations.TableName) == 0 {
		require.True(t, time.Now().Before(deadline), "nobody waits for the version table")
		time.Sleep(20 * time.Millisecond)
	}
}

func appliedVersions(t *testing.T, d *pgtest.DB) []int64 {
	t.Helper()
	rows, err := d.Pool.Query(context.Background(),
		`SELECT version_id FROM `+migrations.TableName+` WHERE version_id > 0 ORDER BY id`)
	require.NoError(t, err)
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	return vs
}

func allVersions(t *testing.T) []int64 {
	t.Helper()
	var vs []int64
	for _, name := range files(t) {
		prefix, _, _ := strings.Cut(name, "_")
		v, err := strconv.ParseInt(prefix, 10, 64)
		require.NoError(t, err, name)
		vs = append(vs, v)
	}
	return vs
}

// newestFileVersion is the version of the newest migration file.
func newestFileVersion(t *testing.T) int64 {
	t.Helper()
	vs := allVersions(t)
	return vs[len(vs)-1]
}

func TestGooseCLIAndUpAgreeOnTheVersionTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	byCLI := freshDatabase(t)
	code, out := runGoose(t, byCLI, nil, withTable, "up")
	require.Zero(t, code, out)
	require.NoError(t, migrations.Check(ctx, byCLI.Pool))
	require.NoError(t, migrations.Up(ctx, byCLI.Pool), "nothing left to apply")
	require.Equal(t, allVersions(t), appliedVersions(t, byCLI))

	byUp := freshDatabase(t)
	require.NoError(t, migrations.Up(ctx, byUp.Pool))
	code, out = runGoose(t, byUp, nil, withTable, "up")
	require.Zero(t, code, out)
	require.Contains(t, out, "no migrations to run")
	require.Equal(t, allVersions(t), appliedVersions(t, byUp))

	// goose's library reads the same state.
	db := stdlib.OpenDBFromPool(byUp.Pool)
	defer db.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, db, migrations.FS, goose.WithTableName(migrations.TableName))
	require.NoError(t, err)
	version, err := p.GetDBVersion(ctx)
	require.NoError(t, err)
	require.Equal(t, newestFileVersion(t), version)
	pending, err := p.HasPending(ctx)
	require.NoError(t, err)
	require.False(t, pending)
}

// Up holds the version table while it migrates: a CLI started meanwhile
// waits for it, then finds nothing to do.
func TestGooseCLIStartedDuringUpWaitsAndFindsNothingToDo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := freshDatabase(t)
	locked, release := make(chan struct{}), make(chan struct{})
	restore := migrations.SetAfterLock(d.Database, d.Schema, func() {
		close(locked)
		<-release
	})
	defer restore()

	up := make(chan error, 1)
	go func() { up <- migrations.Up(ctx, d.Pool) }()
	<-locked
	cli := startGoose(t, d, nil, withTable, "up")
	waitingOnVersionTable(t, d)
	close(release)
	require.NoError(t, <-up)
	code, out := cli.wait(t)
	require.Zero(t, code, out)
	require.Contains(t, out, "no migrations to run")
	require.Equal(t, allVersions(t), appliedVersions(t, d), "each version applied once")
}

// A CLI in the middle of its migrations holds the version table; Up started
// meanwhile yields until the CLI is done, then finds nothing to do.
func TestUpStartedDuringTheGooseCLIWaitsAndFindsNothingToDo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := freshDatabase(t)
	// Hold the CLI inside its first migration: its version row waits for
	// this SHARE lock, after its CREATE TABLE ran.
	code, out := runGoose(t, d, nil, withTable, "version") // creates the version table
	require.Zero(t, code, out)
	hold, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer hold.Rollback(ctx)
	_, err = hold.Exec(ctx, "LOCK TABLE "+migrations.TableName+" IN SHARE MODE")
	require.NoError(t, err)
	cli := startGoose(t, d, nil, withTable, "up")
	waitingOnVersionTable(t, d)

	yielded := make(chan struct{})
	restore := migrations.SetOnYield(d.Database, d.Schema, sync.OnceFunc(func() { close(yielded) }))
	defer restore()
	up := make(chan error, 1)
	go func() { up <- migrations.Up(ctx, d.Pool) }()
	<-yielded
	require.NoError(t, hold.Rollback(ctx))

	code, out = cli.wait(t)
	require.Zero(t, code, out)
	require.Contains(t, out, "successfully migrated database to version: "+strconv.FormatInt(newestFileVersion(t), 10))
	require.NoError(t, <-up)
	require.Equal(t, allVersions(t), appliedVersions(t, d), "each version applied once, by the CLI")
}

func TestGooseCLIRunWithoutTableFlagIsNamedByUpAndCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := freshDatabase(t)
	code, out := runGoose(t, d, nil, nil, "up") // forgot -table
	require.Zero(t, code, out)
	for _, err := range []error{migrations.Up(ctx, d.Pool), migrations.Check(ctx, d.Pool)} {
		require.ErrorIs(t, err, migrations.ErrWrongVersionTable)
		for _, want := range []string{"goose_db_version", migrations.TableName, "-table " + migrations.TableName} {
			require.Contains(t, err.Error(), want)
		}
	}
}

func TestGooseCLIDownRefusesToDropRowsUnlessOptedIn(t *testing.T) {
	t.Parallel()
	d := freshDatabase(t)
	code, out := runGoose(t, d, nil, withTable, "up")
	require.Zero(t, code, out)
	insertKey(t, d)

	code, out = runGoose(t, d, nil, withTable, "down-to", "0")
	require.NotZero(t, code, out)
	require.Contains(t, out, "would delete the rows of idempotency_keys")
	require.Contains(t, out, "PGOPTIONS='-c atomicphase.allow_data_loss=on'")
	// The CLI runs each step in its own transaction: the steps above 00003
	// that lost nothing went, 00003 refused, the tables and the row stay.
	require.Contains(t, appliedVersions(t, d), int64(3), "00003 was not rolled back")
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_keys`))

	code, out = runGoose(t, d, []string{"PGOPTIONS=-c atomicphase.allow_data_loss=on"},
		withTable, "down-to", "0")
	require.Zero(t, code, out)
	require.Empty(t, appliedVersions(t, d))
	require.Equal(t, []string{migrations.TableName}, tables(t, d))
}
