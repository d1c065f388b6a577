package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

// FS holds the migration files, for goose or any other runner.
//
//go:embed *.sql
var FS embed.FS

// TableName is the goose version table these migrations record themselves in.
// Pass it to the goose CLI with -table.
const TableName = "atomicphase_goose_db_version"

// lockID returns the session advisory lock taken while migrating schema, so
// that several processes starting at once apply each migration once. It is
// derived from the schema, so migrating one schema never waits on another,
// and differs from goose's default lock, so the host application's own
// migrations do not wait on ours.
func lockID(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("atomicphase/migrations\x00" + schema))
	return int64(h.Sum64() &^ (1 << 63))
}

// ErrSchemaBehind reports that the database lacks migrations this build needs.
var ErrSchemaBehind = errors.New("migrations: database schema is behind")

// Up applies every pending migration, holding an advisory lock so concurrent
// callers do not race. It is safe to call at every process start.
func Up(ctx context.Context, pool *pgxpool.Pool) error {
	p, closeFn, err := newProvider(ctx, pool)
	if err != nil {
		return err
	}
	defer closeFn()
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("migrations: up: %w", err)
	}
	return nil
}

// DownTo rolls the schema back to version (0 removes every table).
// Rolling back drops data: it is meant for development and tests.
func DownTo(ctx context.Context, pool *pgxpool.Pool, version int64) error {
	p, closeFn, err := newProvider(ctx, pool)
	if err != nil {
		return err
	}
	defer closeFn()
	if _, err := p.DownTo(ctx, version); err != nil {
		return fmt.Errorf("migrations: down to %d: %w", version, err)
	}
	return nil
}

// Check returns nil when the database has every migration this build embeds,
// and an error wrapping [ErrSchemaBehind] naming the first missing one
// otherwise. It only reads: it creates nothing, not even goose's table.
func Check(ctx context.Context, pool *pgxpool.Pool) error {
	if pool == nil {
		return errors.New("migrations: pool is nil")
	}
	applied := map[int64]bool{}
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", TableName).Scan(&exists); err != nil {
		return fmt.Errorf("migrations: check: %w", err)
	}
	if exists {
		rows, err := pool.Query(ctx, "SELECT version_id, is_applied FROM "+TableName+" ORDER BY id")
		if err != nil {
			return fmt.Errorf("migrations: check: %w", err)
		}
		for rows.Next() {
			var v int64
			var ok bool
			if err := rows.Scan(&v, &ok); err != nil {
				return fmt.Errorf("migrations: check: %w", err)
			}
			applied[v] = ok // the latest row for a version decides
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("migrations: check: %w", err)
		}
	}
	files, err := fs.Glob(FS, "*.sql")
	if err != nil {
		return err
	}
	sort.Strings(files)
	for _, name := range files {
		prefix, _, _ := strings.Cut(name, "_")
		version, err := strconv.ParseInt(prefix, 10, 64)
		if err != nil {
			return fmt.Errorf("migrations: file %s has no version prefix", name)
		}
		if !applied[version] {
			return fmt.Errorf("%w: migration %s (version %d) is not applied; run goose -table %s up",
				ErrSchemaBehind, name, version, TableName)
		}
	}
	return nil
}

func newProvider(ctx context.Context, pool *pgxpool.Pool) (*goose.Provider, func(), error) {
	if pool == nil {
		return nil, nil, errors.New("migrations: pool is nil")
	}
	var schema string
	if err := pool.QueryRow(ctx, "SELECT coalesce(current_schema(), '')").Scan(&schema); err != nil {
		return nil, nil, fmt.Errorf("migrations: current schema: %w", err)
	}
	// Poll for the lock every second, for up to five minutes.
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(lockID(schema)), lock.WithLockTimeout(1, 300))
	if err != nil {
		return nil, nil, fmt.Errorf("migrations: locker: %w", err)
	}
	sqlDB := stdlib.OpenDBFromPool(pool)
	fsys, err := fs.Sub(FS, ".")
	if err != nil {
		_ = sqlDB.Close()
		return nil, nil, err
	}
	p, err := goose.NewProvider(goose.DialectPostgres, sqlDB, fsys,
		goose.WithTableName(TableName),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		_ = sqlDB.Close()
		return nil, nil, fmt.Errorf("migrations: %w", err)
	}
	return p, func() { _ = sqlDB.Close() }, nil
}
