package txn_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// env is one test's schema with a business table and a runner.
type env struct {
	*pgtest.DB
	runner *txn.Runner
	reg    *txn.Registry
}

func newEnv(t *testing.T, cfg *txn.Config) *env {
	t.Helper()
	d := pgtest.New(t)
	_, err := d.Pool.Exec(context.Background(), `
		CREATE TABLE charges (
			id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
			ref text NOT NULL,
			amount bigint NOT NULL,
			attempt int NOT NULL DEFAULT 0
		)`)
	require.NoError(t, err)
	if cfg == nil {
		cfg = &txn.Config{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	if cfg.Workflows == nil {
		cfg.Workflows = txn.NewRegistry()
	}
	r, err := txn.New(d.Pool, cfg)
	require.NoError(t, err)
	return &env{DB: d, runner: r, reg: cfg.Workflows}
}

func ctxT(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func chargeKey(value string, amount int) txn.Key {
	params, _ := json.Marshal(map[string]any{"amount": amount, "currency": "eur"})
	return txn.Key{Scope: "acct_1", Value: value, Method: "POST", Path: "/charges", Params: params}
}

// insertCharge is a single-phase body: one business row and a 201.
func insertCharge(calls *atomic.Int64, ref string, amount int) txn.Func {
	return func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		calls.Add(1)
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, $2) RETURNING id`, ref, amount).Scan(&id); err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(201, map[string]any{"id": id, "ref": ref, "amount": amount})
	}
}

// keyRow is the stored state of one key, for assertions.
type keyRow struct {
	Status        string
	RecoveryPoint string
	Attempts      int
	LeaseHeld     bool
	RespStatus    *int
	RespBody      []byte
	Xmin          string
}

func readKey(t *testing.T, pool *pgxpool.Pool, scope, value string) keyRow {
	t.Helper()
	var k keyRow
	err := pool.QueryRow(context.Background(), `
		SELECT status, recovery_point, attempts, lease_token IS NOT NULL, response_status, response_body, xmin::text
		FROM idempotency_keys WHERE scope = $1 AND key = $2`, scope, value).
		Scan(&k.Status, &k.RecoveryPoint, &k.Attempts, &k.LeaseHeld, &k.RespStatus, &k.RespBody, &k.Xmin)
	require.NoError(t, err)
	return k
}

// queryCounter counts statements sent on a pool's connections.
type queryCounter struct{ n atomic.Int64 }

func (c *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// countingRunner returns a runner on a pool that counts the statements it sends.
func (e *env) countingRunner(t *testing.T, cfg *txn.Config) (*txn.Runner, *queryCounter) {
	t.Helper()
	qc := &queryCounter{}
	pool := e.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = qc })
	if cfg == nil {
		cfg = &txn.Config{Workflows: e.reg}
	}
	r, err := txn.New(pool, cfg)
	require.NoError(t, err)
	// Warm a connection so that connect-time statements are not counted.
	require.NoError(t, pool.Ping(context.Background()))
	qc.n.Store(0)
	return r, qc
}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }
