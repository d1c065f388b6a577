package txn_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
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

// takeKey is a function's first statement: the key's insert goes out with
// it, so from then on the attempt holds the key. Before it, the attempt
// holds nothing and a twin may take the key.
func takeKey(ctx context.Context, tx pgx.Tx) error {
	_, err := tx.Exec(ctx, `SELECT 1`)
	return err
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

// queryCounter counts the round trips made on a pool's connections: each
// statement sent on its own, and each batch (its statements go out together).
type queryCounter struct{ n atomic.Int64 }

func (c *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *queryCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *queryCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *queryCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// countingRunner returns a runner on a pool that counts its round trips.
func (e *env) countingRunner(t *testing.T, cfg *txn.Config) (*txn.Runner, *queryCounter) {
	t.Helper()
	return e.countingRunnerIn(t, cfg, pgx.QueryExecModeCacheStatement)
}

// countingRunnerIn is countingRunner with the pool's connections in mode.
func (e *env) countingRunnerIn(t *testing.T, cfg *txn.Config, mode pgx.QueryExecMode) (*txn.Runner, *queryCounter) {
	t.Helper()
	qc := &queryCounter{}
	pool := e.NewPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = qc
		c.ConnConfig.DefaultQueryExecMode = mode
	})
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

// allExecModes are pgx's five query exec modes.
var allExecModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

// wireRunner returns a runner on a pool of one connection in mode, and a
// count of the writes made on that connection: one per round trip (pgx
// writes what a round trip sends at once), including those made on the
// connection's pgconn directly, which pgx's tracer does not see.
//
// settledOnThePool counts the KeyOutcome reads made on their own (not in a
// batch with a ROLLBACK): the fallback of a run that could not read its
// outcome on its own connection.
func (e *env) wireRunner(t *testing.T, mode pgx.QueryExecMode) (r *txn.Runner, writes, settledOnThePool *atomic.Int64) {
	t.Helper()
	writes, settledOnThePool = new(atomic.Int64), new(atomic.Int64)
	pool := e.NewPool(t, func(c *pgxpool.Config) {
		c.MaxConns = 1
		c.ConnConfig.DefaultQueryExecMode = mode
		c.ConnConfig.Tracer = outcomeReads{settledOnThePool}
		dial := c.ConnConfig.DialFunc
		if dial == nil {
			var d net.Dialer
			dial = d.DialContext
		}
		c.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return countedConn{Conn: conn, writes: writes}, nil
		}
	})
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	require.NoError(t, pool.Ping(context.Background()))
	writes.Store(0)
	return r, writes, settledOnThePool
}

// outcomeReads counts the statements sent on their own that read a key's
// outcome (KeyOutcome).
type outcomeReads struct{ n *atomic.Int64 }

func (o outcomeReads) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "name: KeyOutcome ") {
		o.n.Add(1)
	}
	return ctx
}

func (outcomeReads) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

type countedConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c countedConn) Write(b []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(b)
}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

// provider is an in-process payment provider that deduplicates on the
// idempotency key it is given, as real providers do.
type provider struct {
	mu      sync.Mutex
	charges map[string]string // foreign key -> charge id
	calls   atomic.Int64
}

func newProvider() *provider { return &provider{charges: map[string]string{}} }

func (p *provider) charge(foreignKey string) string {
	p.calls.Add(1)
	p.mu.Lock()
	defer p.mu.Unlock()
	if id, ok := p.charges[foreignKey]; ok {
		return id
	}
	id := fmt.Sprintf("ch_%d", len(p.charges)+1)
	p.charges[foreignKey] = id
	return id
}

func (p *provider) distinct() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.charges)
}

var errInjected = errors.New("injected transient failure")

// rideFlow is a 3-phase workflow (atomic, foreign, final atomic) with hooks
// that fail or block it at chosen points. It counts each phase's executions.
type rideFlow struct {
	wf       *txn.Workflow
	prov     *provider
	p1, p3   atomic.Int64 // phase body executions (including rolled-back ones)
	p1Wrote  atomic.Int64 // p1 executions whose statement ran (it may still roll back)
	failAt   atomic.Value // string: "after_p1", "after_p2", "in_p3", "foreign"
	hook     func(point string, a *txn.Attempt)
	declined bool
}

type ride struct {
	ID     int64 `json:"id"`
	Amount int   `json:"amount"`
}

func newRideFlow(t *testing.T, reg *txn.Registry, name string) *rideFlow {
	t.Helper()
	f := &rideFlow{prov: newProvider()}
	f.failAt.Store("")
	f.wf = txn.NewWorkflow(name, func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		var in struct {
			Amount int `json:"amount"`
		}
		if err := jsonUnmarshal(a.Params(), &in); err != nil {
			return txn.JSON(400, map[string]string{"error": "bad params"})
		}
		r, err := txn.Atomic(ctx, a, "ride_created", func(ctx context.Context, tx pgx.Tx) (ride, error) {
			f.p1.Add(1)
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO charges (ref, amount, attempt) VALUES ('ride', $1, $2) RETURNING id`, in.Amount, a.Number()).Scan(&id)
			if err == nil {
				f.p1Wrote.Add(1)
			}
			return ride{ID: id, Amount: in.Amount}, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		f.at("after_p1", a)
		if f.failAt.Load() == "after_p1" {
			return txn.Response{}, errInjected
		}
		charge, err := txn.Foreign(ctx, a, "charge_created", func(ctx context.Context, fk string) (string, error) {
			if f.failAt.Load() == "foreign" {
				return "", errInjected
			}
			if f.declined {
				return "", errDeclined
			}
			return f.prov.charge(fk), nil
		})
		if errors.Is(err, errDeclined) {
			return txn.JSON(402, map[string]string{"error": "card_declined"})
		}
		if err != nil {
			return txn.Response{}, err
		}
		f.at("after_p2", a)
		if f.failAt.Load() == "after_p2" {
			return txn.Response{}, errInjected
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			f.p3.Add(1)
			f.at("in_p3", a)
			if f.failAt.Load() == "in_p3" {
				return txn.Response{}, errInjected
			}
			if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount, attempt) VALUES ($1, $2, $3)`, charge, r.Amount, a.Number()); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(201, map[string]any{"ride_id": r.ID, "charge_id": charge, "amount": r.Amount})
		})
	})
	require.NoError(t, reg.Register(f.wf))
	return f
}

var errDeclined = errors.New("card declined")

func (f *rideFlow) at(point string, a *txn.Attempt) {
	if f.hook != nil {
		f.hook(point, a)
	}
}

func rideKey(value string) txn.Key {
	return txn.Key{Scope: "user_1", Value: value, Method: "POST", Path: "/rides", Params: []byte(`{"amount": 1250}`)}
}

// requireMaxAgeFailure checks a stored max_age failure: the same shape as
// the one the recovery Resumer stores.
func requireMaxAgeFailure(t *testing.T, resp txn.Response) {
	t.Helper()
	require.Equal(t, http.StatusInternalServerError, resp.Status, string(resp.Body))
	require.Equal(t, "application/problem+json", resp.Header.Get("Content-Type"))
	var p struct {
		Status int    `json:"status"`
		Reason string `json:"reason"`
		Detail string `json:"detail"`
	}
	require.NoError(t, json.Unmarshal(resp.Body, &p))
	require.Equal(t, "max_age", p.Reason)
	require.Equal(t, 500, p.Status)
	require.Contains(t, p.Detail, "12h0m0s")
}

// age makes a key look created long ago, and last run just now (so the
// recovery Resumer would leave it alone: only a retry can reach it).
func (e *env) age(t *testing.T, key string, age time.Duration) {
	t.Helper()
	_, err := e.Pool.Exec(context.Background(), `UPDATE idempotency_keys
		SET created_at = now() - make_interval(secs => $2), last_run_at = now() - interval '10 seconds'
		WHERE key = $1`, key, age.Seconds())
	require.NoError(t, err)
}

func (e *env) failureReason(t *testing.T, key string) string {
	t.Helper()
	var reason *string
	require.NoError(t, e.Pool.QueryRow(context.Background(),
		`SELECT failure_reason FROM idempotency_keys WHERE key = $1`, key).Scan(&reason))
	if reason == nil {
		return ""
	}
	return *reason
}

// holdKeyWithTableLock runs a Run of key on e's runner that takes the key,
// then holds a lock on charges that a twin's INSERT would wait for, until
// release: release lets it commit and returns its error. Cleanup releases
// it too, so a failed assertion does not leave the holder waiting.
func holdKeyWithTableLock(ctx context.Context, t *testing.T, e *env, key txn.Key) (release func() error) {
	t.Helper()
	locked, done := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		_, err := e.runner.Run(ctx, key, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if err := takeKey(ctx, tx); err != nil {
				return txn.Response{}, err
			}
			if _, err := tx.Exec(ctx, `LOCK TABLE charges IN SHARE ROW EXCLUSIVE MODE`); err != nil {
				return txn.Response{}, err
			}
			close(locked)
			<-done
			return txn.Response{Status: 201}, nil
		})
		held <- err
	}()
	var once sync.Once
	var err error
	release = func() error {
		once.Do(func() { close(done); err = <-held })
		return err
	}
	t.Cleanup(func() { _ = release() })
	select {
	case <-locked:
	case err := <-held:
		held <- err // for release, at cleanup
		t.Fatalf("the holder failed before it held the key: %v", err)
	}
	return release
}
