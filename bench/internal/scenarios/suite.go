// Package scenarios holds the benchmark scenarios: atomicphase and its peers
// measured side by side, each against a baseline measured in the same run.
package scenarios

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
	"github.com/atomicphase/atomicphase/migrations"
)

// Suite runs scenarios against one environment and collects their rows.
type Suite struct {
	Env          *harness.Env
	Timing       harness.Timing
	Concurrency  []int
	CleanupRows  int
	CleanupBatch int
	// CleanupPause is cleanup.Config.BatchPause (0: the library default).
	CleanupPause time.Duration
	// CleanupLoadRows is how many expired keys the table holds while Run's
	// latency is measured with and without the cleaner (0: CleanupRows).
	CleanupLoadRows int
	// DrainMessages is the backlog the relay-capacity rows drain.
	DrainMessages int
	// WatermillPoll is the Watermill SQL subscriber's poll interval.
	WatermillPoll time.Duration
	// Experiments adds rows that measure proposed library changes by
	// bypassing the library (see each experiment's comment).
	Experiments bool
	// Log receives progress lines (stderr in the command).
	Log io.Writer
	// Statements, if set, receives each cell's pg_stat_statements summary.
	Statements   io.Writer
	statementsOn bool

	Tables []*Table
}

// Progress prints a progress line.
func (s *Suite) Progress(format string, args ...any) {
	if s.Log != nil {
		fmt.Fprintf(s.Log, "%s  "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
	}
}

// businessTable is the application table every subject writes its rows to.
const businessTable = `CREATE TABLE IF NOT EXISTS bench_rows (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    op_key     text        NOT NULL,
    step       smallint    NOT NULL,
    amount     bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)`

// insertRow is the one business write of every subject.
const insertRow = `INSERT INTO bench_rows (op_key, step, amount) VALUES ($1, $2, $3)`

// Prepare creates every schema the scenarios use: ours (the real
// migrations), the business table, and River's. DBOS and Watermill create
// theirs when first started.
func (s *Suite) Prepare(ctx context.Context) error {
	pool, _, err := s.Env.NewPool(ctx, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	s.statementsOn = s.Statements != nil && enableStatements(ctx, pool)
	if _, err := pool.Exec(ctx, businessTable); err != nil {
		return fmt.Errorf("create business table: %w", err)
	}
	m, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return err
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("river migrate: %w", err)
	}
	return nil
}

// reset gives a cell a clean state: every table the scenarios write to
// emptied, and a checkpoint so that none falls inside the measurement.
func reset(ctx context.Context, pool *pgxpool.Pool) error {
	var tables []string
	rows, err := pool.Query(ctx, `
		SELECT format('%I.%I', schemaname, tablename) FROM pg_tables
		WHERE (schemaname = 'public' AND (tablename IN ('bench_rows', 'idempotency_keys', 'outbox_messages', 'river_job')
		                                  OR tablename LIKE 'watermill\_%'))
		   OR (schemaname = 'dbos' AND tablename IN ('workflow_status', 'operation_outputs', 'transaction_completion'))`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var t string
		if err := rows.Scan(&t); err != nil {
			return err
		}
		tables = append(tables, t)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if len(tables) > 0 {
		if _, err := pool.Exec(ctx, "TRUNCATE "+strings.Join(tables, ", ")+" RESTART IDENTITY CASCADE"); err != nil {
			return fmt.Errorf("truncate: %w", err)
		}
	}
	if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	return nil
}

// cell is one subject at one concurrency: set up, reset, warmed up and measured.
type cell struct {
	pool *pgxpool.Pool
	ctr  *harness.Counter
}

// newCell opens a pool with room for concurrency workers plus background
// connections (relay listener, River and DBOS internals), and resets state.
func (s *Suite) newCell(ctx context.Context, concurrency int) (*cell, error) {
	pool, ctr, err := s.Env.NewPool(ctx, concurrency+10)
	if err != nil {
		return nil, err
	}
	if err := reset(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return &cell{pool: pool, ctr: ctr}, nil
}

func opKey(prefix string, seq int64) string { return fmt.Sprintf("%s-%d", prefix, seq) }
