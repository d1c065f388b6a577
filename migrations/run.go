package migrations

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/pgerr"
)

// Timing of Up and DownTo when another migrator works on the same schema.
var (
	// giveUpAfter bounds how long Up and DownTo wait for other migrators.
	giveUpAfter = 5 * time.Minute
	// quietPeriod is how long the version table must stay unchanged before
	// a migrator that yielded to another one tries again: longer than the
	// goose CLI's pause between two of its migrations.
	quietPeriod = 2 * time.Second
	// pollInterval is how often the version table is read meanwhile.
	pollInterval = 50 * time.Millisecond
	// stepLockTimeout is the lock_timeout of the migration statements: a
	// statement that would wait longer for a lock (held by a concurrent
	// goose CLI, or by long application transactions) gives up, the whole
	// run rolls back, and it is tried again after the quiet period, rather
	// than queueing every application query behind it.
	stepLockTimeout = 2 * time.Second
)

// lockID returns the transaction-scoped advisory lock taken while migrating
// schema, so that several processes starting at once apply each migration
// once. It is derived from the schema, so migrating one schema never waits
// on another, and differs from goose's default lock, so the host
// application's own migrations do not wait on ours.
func lockID(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("atomicphase/migrations\x00" + schema))
	return int64(h.Sum64() &^ (1 << 63))
}

// migration is one embedded goose SQL file.
type migration struct {
	version  int64
	name     string
	up, down string
}

// embedded returns the embedded migrations in version order.
var embedded = sync.OnceValues(func() ([]migration, error) {
	names, err := fs.Glob(FS, "*.sql")
	if err != nil {
		return nil, err
	}
	var ms []migration
	for _, name := range names {
		text, err := fs.ReadFile(FS, name)
		if err != nil {
			return nil, err
		}
		m, err := parseMigration(name, string(text))
		if err != nil {
			return nil, err
		}
		ms = append(ms, m)
	}
	slices.SortFunc(ms, func(a, b migration) int { return int(a.version - b.version) })
	for i := 1; i < len(ms); i++ {
		if ms[i].version == ms[i-1].version {
			return nil, fmt.Errorf("migrations: %s and %s have the same version", ms[i-1].name, ms[i].name)
		}
	}
	return ms, nil
})

// parseMigration splits a goose SQL file into its Up and Down sections. Each
// section runs as one simple-protocol query, inside the run's transaction,
// so statements need no splitting; goose's StatementBegin and StatementEnd
// annotations (which the goose CLI needs around $$ bodies) are comments to
// it. Files that goose would run outside a transaction are refused: Up and
// DownTo promise one transaction.
func parseMigration(name, text string) (migration, error) {
	prefix, _, _ := strings.Cut(name, "_")
	version, err := strconv.ParseInt(prefix, 10, 64)
	if err != nil || version < 1 {
		return migration{}, fmt.Errorf("migrations: file %s has no version prefix", name)
	}
	m := migration{version: version, name: name}
	var section *strings.Builder
	var up, down strings.Builder
	for line := range strings.Lines(text) {
		trimmed := strings.TrimSpace(line)
		if ann, ok := strings.CutPrefix(trimmed, "-- +goose "); ok {
			switch strings.ToLower(strings.TrimSpace(ann)) {
			case "up":
				if section != nil {
					return migration{}, fmt.Errorf("migrations: %s: +goose Up after another section", name)
				}
				section = &up
				continue
			case "down":
				if section != &up {
					return migration{}, fmt.Errorf("migrations: %s: +goose Down without +goose Up before it", name)
				}
				section = &down
				continue
			case "statementbegin", "statementend":
			default:
				return migration{}, fmt.Errorf("migrations: %s: annotation %q is not supported (migrations run in one transaction)", name, trimmed)
			}
		}
		if section != nil {
			section.WriteString(line)
		}
	}
	if section == nil || strings.TrimSpace(up.String()) == "" {
		return migration{}, fmt.Errorf("migrations: %s has no +goose Up section", name)
	}
	m.up, m.down = up.String(), down.String()
	return m, nil
}

// upOnce applies the pending migrations in one transaction.
func upOnce(ctx context.Context, pool *pgxpool.Pool, ms []migration) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	c := conn.Conn()
	schema, err := currentSchema(ctx, c)
	if err != nil {
		return err
	}
	if err := ensureVersionTable(ctx, c, schema); err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
		if err := lockSchema(ctx, tx, schema); err != nil {
			return err
		}
		applied, latest, err := readApplied(ctx, tx, schema)
		if err != nil {
			return err
		}
		var pending []migration
		for _, m := range ms {
			if applied[m.version] {
				continue
			}
			if m.version < latest {
				return fmt.Errorf("migration %s (version %d) is missing below the database's version %d; apply it with goose -allow-missing -table %s up",
					m.name, m.version, latest, TableName)
			}
			pending = append(pending, m)
		}
		if len(pending) == 0 {
			return nil
		}
		if err := checkVersionTable(ctx, tx, schema, ms, applied); err != nil {
			return err
		}
		insert := "INSERT INTO " + versionTable(schema) + " (version_id, is_applied) VALUES ($1, true)"
		for _, m := range pending {
			if _, err := tx.Exec(ctx, m.up); err != nil {
				return fmt.Errorf("%s: %w", m.name, err)
			}
			if _, err := tx.Exec(ctx, insert, m.version); err != nil {
				return fmt.Errorf("%s: record version: %w", m.name, err)
			}
		}
		return nil
	})
}

// downOnce rolls back, in one transaction, every applied migration above
// version, newest first.
func downOnce(ctx context.Context, pool *pgxpool.Pool, ms []migration, version int64, o downOptions) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	c := conn.Conn()
	schema, err := currentSchema(ctx, c)
	if err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
		applied, _, err := readApplied(ctx, tx, schema)
		if err != nil {
			return err
		}
		if len(applied) == 0 {
			return nil
		}
		if err := lockSchema(ctx, tx, schema); err != nil {
			return err
		}
		if applied, _, err = readApplied(ctx, tx, schema); err != nil {
			return err
		}
		if o.allowDataLoss {
			if _, err := tx.Exec(ctx, "SELECT set_config('atomicphase.allow_data_loss', 'on', true)"); err != nil {
				return err
			}
		}
		byVersion := map[int64]migration{}
		for _, m := range ms {
			byVersion[m.version] = m
		}
		var versions []int64
		for v, ok := range applied {
			if ok && v > version && v > 0 {
				versions = append(versions, v)
			}
		}
		slices.Sort(versions)
		slices.Reverse(versions)
		del := "DELETE FROM " + versionTable(schema) + " WHERE version_id = $1"
		for _, v := range versions {
			m, ok := byVersion[v]
			if !ok {
				return fmt.Errorf("the database has migration %d, which this build does not embed; roll it back with the build that applied it", v)
			}
			if _, err := tx.Exec(ctx, m.down); err != nil {
				return fmt.Errorf("%s: %w", m.name, err)
			}
			if _, err := tx.Exec(ctx, del, v); err != nil {
				return fmt.Errorf("%s: remove version: %w", m.name, err)
			}
		}
		return nil
	})
}

// queryer is what reading the version table needs: a connection or a
// transaction.
type queryer interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// currentSchema returns the schema unqualified names are created in: where
// goose, given no schema in -table, keeps its version table too.
func currentSchema(ctx context.Context, q queryer) (string, error) {
	var schema *string
	if err := q.QueryRow(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		return "", fmt.Errorf("current schema: %w", err)
	}
	if schema == nil {
		return "", errors.New("no schema: search_path names no existing schema")
	}
	return *schema, nil
}

func versionTable(schema string) string {
	return pgx.Identifier{schema, TableName}.Sanitize()
}

// tableExists reports whether schema holds a table (or view) named name.
func tableExists(ctx context.Context, q queryer, schema, name string) (bool, error) {
	var exists bool
	err := q.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", pgx.Identifier{schema, name}.Sanitize()).Scan(&exists)
	return exists, err
}

// readApplied returns the versions recorded as applied in schema's version
// table (the latest row of each version decides, as for goose) and the
// highest of them; an empty map if the table does not exist.
func readApplied(ctx context.Context, q queryer, schema string) (map[int64]bool, int64, error) {
	applied := map[int64]bool{}
	exists, err := tableExists(ctx, q, schema, TableName)
	if err != nil || !exists {
		return applied, 0, err
	}
	rows, err := q.Query(ctx, "SELECT version_id, is_applied FROM "+versionTable(schema)+" ORDER BY id")
	if err != nil {
		return nil, 0, err
	}
	defer rows.Close()
	for rows.Next() {
		var v int64
		var ok bool
		if err := rows.Scan(&v, &ok); err != nil {
			return nil, 0, err
		}
		applied[v] = ok
	}
	if err := rows.Err(); err != nil {
		return nil, 0, err
	}
	var latest int64
	for v, ok := range applied {
		if ok && v > latest {
			latest = v
		}
	}
	return applied, latest, nil
}

// ensureVersionTable creates schema's version table as goose does (same
// columns, and the row for version 0), in a transaction of its own that
// commits before any migration runs, so that a goose CLI starting meanwhile
// finds it rather than trying to create it too.
func ensureVersionTable(ctx context.Context, c *pgx.Conn, schema string) error {
	if exists, err := tableExists(ctx, c, schema, TableName); err != nil || exists {
		return err
	}
	return pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockID(schema)); err != nil {
			return err
		}
		if exists, err := tableExists(ctx, tx, schema, TableName); err != nil || exists {
			return err
		}
		_, err := tx.Exec(ctx, `CREATE TABLE `+versionTable(schema)+` (
		id integer PRIMARY KEY GENERATED BY DEFAULT AS IDENTITY,
		version_id bigint NOT NULL,
		is_applied boolean NOT NULL,
		tstamp timestamp NOT NULL DEFAULT now()
	)`)
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, "INSERT INTO "+versionTable(schema)+" (version_id, is_applied) VALUES (0, true)")
		return err
	})
}

// Test hooks, keyed by "database.schema": afterLock runs once lockSchema
// holds its locks, onYield each time retry yields to another migrator.
var (
	hooksSet           atomic.Int32
	afterLock, onYield sync.Map // string -> func()
)

// runHook runs the hook in hooks for the database and schema q is on.
func runHook(ctx context.Context, hooks *sync.Map, q queryer) {
	if hooksSet.Load() == 0 {
		return
	}
	var target string
	if q.QueryRow(ctx, "SELECT current_database() || '.' || coalesce(current_schema(), '')").Scan(&target) != nil {
		return
	}
	if f, ok := hooks.Load(target); ok {
		f.(func())()
	}
}

// lockSchema takes, for the rest of tx, the advisory lock other callers of
// Up and DownTo on schema wait for, then the version table in ACCESS
// EXCLUSIVE mode without waiting, and bounds the lock waits of the
// migration statements. The version table is not waited for because
// whoever holds it is another migrator at work: a goose CLI in the middle
// of a migration, or starting one (it read the versions and is about to
// apply what it found missing). Queueing for the lock would hand it to us
// between two of the CLI's migrations, and we would apply the CLI's next
// one under it; instead the caller rolls back and waits for quiet.
func lockSchema(ctx context.Context, tx pgx.Tx, schema string) error {
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockID(schema)); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "LOCK TABLE "+versionTable(schema)+" IN ACCESS EXCLUSIVE MODE NOWAIT"); err != nil {
		return err
	}
	if err := setLockTimeout(ctx, tx, stepLockTimeout); err != nil {
		return err
	}
	runHook(ctx, &afterLock, tx)
	return nil
}

// setLockTimeout sets lock_timeout for the rest of tx.
func setLockTimeout(ctx context.Context, tx pgx.Tx, d time.Duration) error {
	_, err := tx.Exec(ctx, "SELECT set_config('lock_timeout', $1, true)", strconv.FormatInt(d.Milliseconds(), 10))
	return err
}

// checkVersionTable fails with ErrWrongVersionTable when the tables of the
// first migration exist although the version table does not record it.
func checkVersionTable(ctx context.Context, q queryer, schema string, ms []migration, applied map[int64]bool) error {
	if len(ms) == 0 || applied[ms[0].version] {
		return nil
	}
	const marker = "idempotency_keys" // created by the first migration
	exists, err := tableExists(ctx, q, schema, marker)
	if err != nil || !exists {
		return err
	}
	host, err := tableExists(ctx, q, schema, hostTableName)
	if err != nil {
		return err
	}
	where := "another version table (goose's default is " + hostTableName + ")"
	if host {
		where = hostTableName + ", goose's default table (which belongs to the host application's migrations)"
	}
	return fmt.Errorf("%w: %s exists in schema %q but %s does not record migration %s: the goose CLI applied these migrations to %s. Pass -table %s to every goose command for these migrations; the README (Migrations) shows how to record the versions already applied",
		ErrWrongVersionTable, marker, schema, TableName, ms[0].name, where, TableName)
}

// retry runs attempt until it succeeds, fails for a reason other than
// another migrator at work, or giveUpAfter passes. After a conflict with
// another migrator (a lock it holds, an object it just created) it waits
// until the version table has been quiet for quietPeriod, and tries again.
// An object that exists although nobody migrated since the last such wait
// is not a conflict: that error is returned.
func retry(ctx context.Context, pool *pgxpool.Pool, attempt func(context.Context) error) error {
	deadline := time.Now().Add(giveUpAfter)
	var quiet *state // the version table after the last wait
	for {
		err := attempt(ctx)
		if err == nil || !concurrentMigrator(err) || ctx.Err() != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("another migrator kept the schema busy for %v: %w", giveUpAfter, err)
		}
		if hooksSet.Load() > 0 {
			if conn, aerr := pool.Acquire(ctx); aerr == nil {
				runHook(ctx, &onYield, conn)
				conn.Release()
			}
		}
		after, qerr := waitQuiet(ctx, pool)
		if qerr != nil {
			return errors.Join(err, qerr)
		}
		if !lockWait(err) && quiet != nil && *quiet == after {
			return err
		}
		quiet = &after
	}
}

// concurrentMigrator reports errors another migrator working on the same
// schema at the same moment causes.
func concurrentMigrator(err error) bool {
	switch pgerr.Code(err) {
	case pgerr.LockNotAvailable, pgerr.DeadlockDetected,
		pgerr.DuplicateTable, pgerr.DuplicateObject, pgerr.DuplicateFunction, pgerr.UniqueViolation:
		return true
	}
	return false
}

// lockWait reports a lock another session held (as opposed to an object
// another session created).
func lockWait(err error) bool {
	switch pgerr.Code(err) {
	case pgerr.LockNotAvailable, pgerr.DeadlockDetected:
		return true
	}
	return false
}

// state identifies the content of a version table: goose only inserts and
// deletes rows, so any change moves the count or the highest id.
type state struct{ rows, maxID int64 }

func versionState(ctx context.Context, pool *pgxpool.Pool) (state, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return state{}, err
	}
	defer conn.Release()
	schema, err := currentSchema(ctx, conn.Conn())
	if err != nil {
		return state{}, err
	}
	exists, err := tableExists(ctx, conn.Conn(), schema, TableName)
	if err != nil || !exists {
		return state{rows: -1}, err
	}
	var s state
	err = conn.QueryRow(ctx, "SELECT count(*), coalesce(max(id), 0) FROM "+versionTable(schema)).Scan(&s.rows, &s.maxID)
	return s, err
}

// waitQuiet returns once the version table has not changed for quietPeriod.
func waitQuiet(ctx context.Context, pool *pgxpool.Pool) (state, error) {
	last, err := versionState(ctx, pool)
	if err != nil {
		return last, err
	}
	since := time.Now()
	t := time.NewTicker(pollInterval)
	defer t.Stop()
	for time.Since(since) < quietPeriod {
		select {
		case <-ctx.Done():
			return last, ctx.Err()
		case <-t.C:
		}
		s, err := versionState(ctx, pool)
		if err != nil {
			return s, err
		}
		if s != last {
			last, since = s, time.Now()
		}
	}
	return last, nil
}
