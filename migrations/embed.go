package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/pgerr"
)

// FS holds the migration files, for goose or any other runner.
//
//go:embed *.sql
var FS embed.FS

// TableName is the goose version table these migrations record themselves in.
// Pass it to the goose CLI with -table.
const TableName = "atomicphase_goose_db_version"

// hostTableName is goose's default version table, which the host
// application's own migrations use.
const hostTableName = "goose_db_version"

// Up applies every pending migration. It is safe to call at every process
// start, from any number of processes at once, and beside the goose CLI:
//
//   - All pending migrations are applied in one transaction, with their
//     version rows: a failure leaves the schema as it was.
//   - Callers of Up and DownTo on the same schema take turns (a
//     transaction-scoped advisory lock, so it works through a
//     transaction-pooling PgBouncer).
//   - While it migrates, Up holds the version table locked: a goose CLI
//     started meanwhile waits, then finds nothing to do.
//   - The goose CLI takes no lock. When Up meets one at work (its version
//     row not yet committed, or an object it is creating), Up rolls back,
//     waits until the version table has been quiet for a moment, and tries
//     again, finding the CLI's migrations applied.
//
// It fails with [ErrWrongVersionTable] when the tables exist but were
// recorded in another version table (a goose CLI run without -table).
func Up(ctx context.Context, pool *pgxpool.Pool) error {
	if pool == nil {
		return errors.New("migrations: up: pool is nil")
	}
	ms, err := embedded()
	if err != nil {
		return err
	}
	if err := retry(ctx, pool, func(ctx context.Context) error { return upOnce(ctx, pool, ms) }); err != nil {
		return fmt.Errorf("migrations: up: %w", err)
	}
	return nil
}

// DownOption changes what DownTo may do.
type DownOption func(*downOptions)

type downOptions struct {
	allowDataLoss bool
}

// AllowDataLoss lets DownTo roll back migrations that delete rows: without
// it, a rollback that would drop a table holding rows (stored responses,
// unsent messages) fails with [ErrDataLossRefused] and changes nothing. It
// sets atomicphase.allow_data_loss = on for the rollback's transaction only.
func AllowDataLoss() DownOption {
	return func(o *downOptions) { o.allowDataLoss = true }
}

// DownTo rolls the schema back to version (0 removes every table), in one
// transaction. A rollback that would delete rows is refused with
// [ErrDataLossRefused] unless [AllowDataLoss] is given; rolling back empty
// tables needs no option. (Rolling back 00004 while keys hold exact params
// or results is refused too, with an error that names
// atomicphase.allow_data_loss but does not match ErrDataLossRefused: that
// file predates the guard and is never edited.) Rolling back is meant for development and tests,
// and for undoing a failed deploy before any traffic.
func DownTo(ctx context.Context, pool *pgxpool.Pool, version int64, opts ...DownOption) error {
	if pool == nil {
		return errors.New("migrations: down: pool is nil")
	}
	var o downOptions
	for _, opt := range opts {
		opt(&o)
	}
	ms, err := embedded()
	if err != nil {
		return err
	}
	err = retry(ctx, pool, func(ctx context.Context) error { return downOnce(ctx, pool, ms, version, o) })
	if pgerr.Code(err) == pgerr.DataLossRefused {
		return fmt.Errorf("migrations: down to %d: %w: %w", version, ErrDataLossRefused, err)
	}
	if err != nil {
		return fmt.Errorf("migrations: down to %d: %w", version, err)
	}
	return nil
}

// Check returns nil when the database has every migration this build embeds,
// and an error wrapping [ErrSchemaBehind] naming the first missing one
// otherwise, or [ErrWrongVersionTable] when the tables exist but another
// version table records them. It only reads: it creates nothing, not even
// the version table, and takes no lock.
func Check(ctx context.Context, pool *pgxpool.Pool) error {
	if pool == nil {
		return errors.New("migrations: check: pool is nil")
	}
	ms, err := embedded()
	if err != nil {
		return err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("migrations: check: %w", err)
	}
	defer conn.Release()
	schema, err := currentSchema(ctx, conn.Conn())
	if err != nil {
		return fmt.Errorf("migrations: check: %w", err)
	}
	applied, _, err := readApplied(ctx, conn.Conn(), schema)
	if err != nil {
		return fmt.Errorf("migrations: check: %w", err)
	}
	for _, m := range ms {
		if applied[m.version] {
			continue
		}
		if err := checkVersionTable(ctx, conn.Conn(), schema, ms, applied); err != nil {
			return fmt.Errorf("migrations: check: %w", err)
		}
		return fmt.Errorf("migrations: check: %w: migration %s (version %d) is not applied; run migrations.Up, or goose -table %s up",
			ErrSchemaBehind, m.name, m.version, TableName)
	}
	return nil
}
