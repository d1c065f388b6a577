// Package inboxtest holds test helpers shared by the inbox and its
// adapters' tests: a statement counter, and a table of handler effects
// without a unique constraint, so that a handler that ran twice shows.
package inboxtest

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// Counter counts the statements and batches sent on a pool's connections.
type Counter struct{ n atomic.Int64 }

// N returns how many statements and batches were sent since the last Reset.
func (c *Counter) N() int64 { return c.n.Load() }

// Reset sets the count to zero.
func (c *Counter) Reset() { c.n.Store(0) }

func (c *Counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *Counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *Counter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *Counter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *Counter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// CountingPool returns a pool on d's schema whose statements c counts, with
// one connection warmed up and the count reset.
func CountingPool(t *testing.T, d *pgtest.DB) (*pgxpool.Pool, *Counter) {
	t.Helper()
	c := &Counter{}
	pool := d.NewPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = c })
	require.NoError(t, pool.Ping(context.Background()))
	c.Reset()
	return pool, c
}

// EffectsTable is a handler's business table: one row per effect, and no
// unique constraint, so that an effect written twice is counted twice.
const EffectsTable = `CREATE TABLE effects (
	message_id text        NOT NULL,
	consumer   text        NOT NULL DEFAULT '',
	body       bytea,
	written_at timestamptz NOT NULL DEFAULT clock_timestamp()
)`

// CreateEffects creates the effects table in d's schema.
func CreateEffects(t *testing.T, d *pgtest.DB) {
	t.Helper()
	_, err := d.Pool.Exec(context.Background(), EffectsTable)
	require.NoError(t, err)
}

// WriteEffect inserts one effect row.
func WriteEffect(ctx context.Context, tx pgx.Tx, consumer, messageID string, body []byte) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (message_id, consumer, body) VALUES ($1, $2, $3)`, messageID, consumer, body)
	return err
}

// Logger returns a logger that writes warnings and errors to the test's
// output.
func Logger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}
