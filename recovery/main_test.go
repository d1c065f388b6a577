package recovery_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var quiet = slog.New(slog.DiscardHandler)

var errTransient = errors.New("provider timed out")

// fixture is a service with one three-phase workflow, "charge":
// reserve (atomic) -> charge (foreign) -> finish (final atomic). Every phase
// that runs records a row in the effects table, the foreign one outside any
// transaction, so a test can count how often each phase ran for each key.
type fixture struct {
	d        *pgtest.DB
	registry *txn.Registry
	runner   *txn.Runner
	wf       *txn.Workflow
	calls    atomic.Int64 // workflow function invocations

	mu     sync.Mutex
	failAt map[string]string // key -> phase that fails once, transiently
	block  map[string]chan struct{}
	waits  chan string // keys whose foreign phase is blocked, waiting
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	d := pgtest.New(t)
	_, err := d.Pool.Exec(context.Background(),
		`CREATE TABLE effects (key text NOT NULL, phase text NOT NULL, at timestamptz NOT NULL DEFAULT now())`)
	require.NoError(t, err)
	f := &fixture{d: d, failAt: map[string]string{}, block: map[string]chan struct{}{}, waits: make(chan string, 16)}
	f.wf = txn.NewWorkflow("charge", f.run)
	f.registry = txn.NewRegistry()
	require.NoError(t, f.registry.Register(f.wf))
	f.runner, err = txn.New(d.Pool, &txn.Config{Workflows: f.registry, Logger: quiet})
	require.NoError(t, err)
	return f
}

// failOnce makes phase fail with a transient error the next time it runs for key.
func (f *fixture) failOnce(key, phase string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failAt[key] = phase
}

// blockForeign makes the foreign phase of key wait until the returned func
// is called; the key is sent on f.waits when the phase starts waiting.
func (f *fixture) blockForeign(key string) (release func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ch := make(chan struct{})
	f.block[key] = ch
	return sync.OnceFunc(func() { close(ch) })
}

func (f *fixture) check(ctx context.Context, key, phase string) error {
	f.mu.Lock()
	fail := f.failAt[key] == phase
	if fail {
		delete(f.failAt, key)
	}
	ch := f.block[key]
	f.mu.Unlock()
	if fail {
		return fmt.Errorf("%s: %w", phase, errTransient)
	}
	if ch != nil && phase == "charge" {
		f.waits <- key
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

type chargeParams struct {
	Amount int `json:"amount"`
}

func (f *fixture) run(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
	f.calls.Add(1)
	_, key := a.Key()
	var p chargeParams
	if err := json.Unmarshal(a.Params(), &p); err != nil {
		return txn.Response{}, err
	}
	reserved, err := txn.Atomic(ctx, a, "reserve", func(ctx context.Context, tx pgx.Tx) (int, error) {
		if err := f.check(ctx, key, "reserve"); err != nil {
			return 0, err
		}
		_, err := tx.Exec(ctx, `INSERT INTO effects (key, phase) VALUES ($1, 'reserve')`, key)
		return p.Amount, err
	})
	if err != nil {
		return txn.Response{}, err
	}
	charge, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, foreignKey string) (string, error) {
		if err := f.check(ctx, key, "charge"); err != nil {
			return "", err
		}
		// The provider's side effect, outside any transaction.
		_, err := f.d.Pool.Exec(ctx, `INSERT INTO effects (key, phase) VALUES ($1, 'charge')`, key)
		return fmt.Sprintf("ch_%d", reserved), err
	})
	if err != nil {
		return txn.Response{}, err
	}
	return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if err := f.check(ctx, key, "finish"); err != nil {
			return txn.Response{}, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO effects (key, phase) VALUES ($1, 'finish')`, key); err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(201, map[string]any{"amount": reserved, "charge": charge})
	})
}

// chargeKey names a charge request. The scope is the test's own schema:
// txn's in-flight advisory lock on (scope, key) is shared by the whole
// database (see TestTxnSameKeyInAnotherSchemaIsNotInUse), so tests running
// at once must not share a scope and key.
func (f *fixture) chargeKey(key string, amount int) txn.Key {
	return txn.Key{Scope: f.d.Schema, Value: key, Method: "POST", Path: "/charges",
		Params: fmt.Appendf(nil, `{"amount": %d}`, amount)}
}

// effects returns how many times each phase ran for key.
func (f *fixture) effects(t *testing.T, key string) map[string]int {
	t.Helper()
	rows, err := f.d.Pool.Query(context.Background(),
		`SELECT phase, count(*)::int FROM effects WHERE key = $1 GROUP BY phase`, key)
	require.NoError(t, err)
	m, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (kv [2]any, err error) {
		var phase string
		var n int
		err = r.Scan(&phase, &n)
		return [2]any{phase, n}, err
	})
	require.NoError(t, err)
	out := map[string]int{}
	for _, kv := range m {
		out[kv[0].(string)] = kv[1].(int)
	}
	return out
}

// keyRow is the part of a key's row the tests look at.
type keyRow struct {
	Status, RecoveryPoint, FailureReason string
	Attempts                             int
	Leased                               bool
	ResponseStatus                       int
}

func (f *fixture) row(t *testing.T, key string) keyRow {
	t.Helper()
	var r keyRow
	err := f.d.Pool.QueryRow(context.Background(), `
		SELECT status, recovery_point, coalesce(failure_reason, ''), attempts,
		       lease_token IS NOT NULL, coalesce(response_status, 0)
		FROM idempotency_keys WHERE key = $1`, key).
		Scan(&r.Status, &r.RecoveryPoint, &r.FailureReason, &r.Attempts, &r.Leased, &r.ResponseStatus)
	require.NoError(t, err)
	return r
}

// exec runs SQL on the test's schema, failing the test on error.
func (f *fixture) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := f.d.Pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

// stall makes key look abandoned an hour ago by the database clock.
func (f *fixture) stall(t *testing.T, key string) {
	t.Helper()
	f.exec(t, `UPDATE idempotency_keys SET last_run_at = now() - interval '1 hour' WHERE key = $1`, key)
}

// snapshot returns a digest of every key row, to prove nothing changed.
func (f *fixture) snapshot(t *testing.T) string {
	t.Helper()
	var s string
	err := f.d.Pool.QueryRow(context.Background(),
		`SELECT coalesce(md5(string_agg(k::text, '|' ORDER BY id)), '') FROM idempotency_keys k`).Scan(&s)
	require.NoError(t, err)
	return s
}
