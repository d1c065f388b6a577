package pgbouncer_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/internal/connstr"
	"github.com/atomicphase/atomicphase/internal/pgbouncer"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

// target is one way to reach a test's tables: straight to PostgreSQL, or
// through PgBouncer, with a pgx query exec mode.
type target struct {
	// d reaches the same tables straight, for setup and assertions.
	d *pgtest.DB
	// pool is the path under test.
	pool *pgxpool.Pool
	// connString is the path under test, for another process.
	connString string
}

func direct(t *testing.T, mode pgx.QueryExecMode) target {
	t.Helper()
	d := pgtest.New(t)
	cs, err := connstr.Edit(d.ConnString(t), func(c *pgx.ConnConfig) { c.DefaultQueryExecMode = mode })
	require.NoError(t, err)
	return target{d: d, pool: newPool(t, cs), connString: cs}
}

func throughBouncer(t *testing.T, b *pgbouncer.Bouncer, mode pgx.QueryExecMode) target {
	t.Helper()
	d := pgtest.NewDatabase(t)
	cs, err := b.ConnString(d.URL, d.Database, mode)
	require.NoError(t, err)
	return target{d: d, pool: bouncerPool(t, b, d, mode), connString: cs}
}

func TestPublicPathsInEveryQueryExecModeStraightToPostgres(t *testing.T) {
	t.Parallel()
	for _, mode := range allModes {
		t.Run(modeName(mode), func(t *testing.T) {
			t.Parallel()
			exercise(t, func(t *testing.T) target { return direct(t, mode) })
		})
	}
}

func TestPublicPathsThroughPgBouncerInTransactionMode(t *testing.T) {
	t.Parallel()
	b := startBouncer(t)
	for _, mode := range bouncerModes {
		t.Run(modeName(mode), func(t *testing.T) {
			t.Parallel()
			exercise(t, func(t *testing.T) target { return throughBouncer(t, b, mode) })
		})
	}
}

// exercise runs every public path against targets newTarget makes, one per
// path.
func exercise(t *testing.T, newTarget func(*testing.T) target) {
	t.Run("run", func(t *testing.T) { runExactlyOnce(t, newTarget(t)) })
	t.Run("run_stored_nothing", func(t *testing.T) { runStoredNothing(t, newTarget(t)) })
	t.Run("workflow_resumer_relay", func(t *testing.T) { workflowResumedAndRelayed(t, newTarget(t)) })
	t.Run("httpidem", func(t *testing.T) { httpReplays(t, newTarget(t)) })
	t.Run("cleaner", func(t *testing.T) {
		tg := newTarget(t)
		cleanerRounds(t, tg.d, tg.pool)
	})
	t.Run("reaper", func(t *testing.T) { reaperRound(t, newTarget(t)) })
	t.Run("redrive", func(t *testing.T) { redriveByIDAndAll(t, newTarget(t)) })
	t.Run("inbox", func(t *testing.T) { inboxHandleAndDeadLetter(t, newTarget(t)) })
	t.Run("webhookin", func(t *testing.T) { webhookReceived(t, newTarget(t)) })
	t.Run("natsin", func(t *testing.T) { natsConsumed(t, newTarget(t)) })
	t.Run("monitor", func(t *testing.T) { monitorSnapshot(t, newTarget(t)) })
	t.Run("admin_command", func(t *testing.T) { adminCommands(t, newTarget(t)) })
	t.Run("reaper_http", func(t *testing.T) { reaperHTTP(t, newTarget(t)) })
}

// runExactlyOnce: 16 concurrent calls with one key commit fn's write once
// (a call whose lookup came just before the winner's commit may run fn in
// a transaction that is then rolled back); retries replay; another payload
// under the key is refused.
func runExactlyOnce(t *testing.T, tg target) {
	ctx := context.Background()
	sqlExec(t, tg.d, `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, sku text NOT NULL)`)
	runner, err := txn.New(tg.pool, &txn.Config{Logger: quiet})
	require.NoError(t, err)
	key := txn.Key{Scope: "acct_1", Value: "order-1", Method: "POST", Path: "/orders",
		Params: []byte(`{"sku": "tea", "qty": 2, "note": "caf\u00e9 \"x\""}`)}
	fn := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO orders (sku) VALUES ($1) RETURNING id`, "tea").Scan(&id); err != nil {
			return txn.Response{}, err // a twin took the key first: the insert never ran
		}
		return txn.JSON(http.StatusCreated, map[string]any{"id": id})
	}
	var wg sync.WaitGroup
	var ok, inUse atomic.Int32
	bodies := make(chan string, 16)
	for range 16 {
		wg.Go(func() {
			resp, err := runner.Run(ctx, key, fn)
			switch {
			case err == nil:
				ok.Add(1)
				bodies <- string(resp.Body)
			case errors.Is(err, txn.ErrKeyInUse):
				inUse.Add(1)
			default:
				t.Errorf("run: %v", err)
			}
		})
	}
	wg.Wait()
	close(bodies)
	require.Equal(t, int32(16), ok.Load()+inUse.Load())
	require.Positive(t, ok.Load())
	first := <-bodies
	for b := range bodies {
		require.Equal(t, first, b, "every success is the one stored response")
	}
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM orders`))

	key.Params = []byte(`{"qty":2,"note":"café \"x\"","sku":"tea"}`) // same JSON, keys reordered
	resp, err := runner.Run(ctx, key, fn)
	require.NoError(t, err)
	require.True(t, resp.Replayed)
	require.Equal(t, first, string(resp.Body))

	key.Params = []byte(`{"sku": "coffee"}`)
	_, err = runner.Run(ctx, key, fn)
	require.ErrorIs(t, err, txn.ErrKeyReused)
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM orders`), "fn's write committed once")
}

// runStoredNothing: a Run whose function answers 422 (not stored), and one
// whose statement fails (an aborted transaction), leave no key and no row,
// and their connection goes back idle: the read that settles them rides
// with their ROLLBACK, and must work through PgBouncer too. Several times,
// since pgx caches what it prepares or describes after the first.
func runStoredNothing(t *testing.T, tg target) {
	ctx := context.Background()
	sqlExec(t, tg.d, `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, sku text NOT NULL)`)
	runner, err := txn.New(tg.pool, &txn.Config{Logger: quiet})
	require.NoError(t, err)
	key := txn.Key{Scope: "acct_1", Value: "order-r", Method: "POST", Path: "/orders", Params: []byte(`{"sku": "tea"}`)}
	insert := func(sku any, status int) txn.Func {
		return func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO orders (sku) VALUES ($1)`, sku); err != nil {
				return txn.Response{}, err
			}
			return txn.Response{Status: status}, nil
		}
	}
	for range 3 {
		resp, err := runner.Run(ctx, key, insert("tea", http.StatusUnprocessableEntity))
		require.NoError(t, err)
		require.Equal(t, http.StatusUnprocessableEntity, resp.Status)
		_, err = runner.Run(ctx, key, insert(nil, http.StatusCreated))
		require.Equal(t, "23502", pgerr.Code(err), "%v", err)
	}
	require.Zero(t, tg.d.Count(t, `SELECT count(*) FROM orders`))
	require.Zero(t, tg.d.Count(t, `SELECT count(*) FROM idempotency_keys`))
	resp, err := runner.Run(ctx, key, insert("tea", http.StatusCreated))
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, resp.Status)
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM orders`))
}

var errProviderDown = errors.New("provider timed out")

// workflowResumedAndRelayed: a three-phase workflow fails transiently in its
// foreign phase; a Resumer finishes it, the final phase stages a receipt,
// and a poll-only Relay publishes the receipt once.
func workflowResumedAndRelayed(t *testing.T, tg target) {
	ctx := context.Background()
	sqlExec(t, tg.d, `CREATE TABLE rides (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, cents bigint NOT NULL, charge text)`)
	var failCharge atomic.Bool
	failCharge.Store(true)
	charges := map[string]int{}
	var mu sync.Mutex
	wf := txn.NewWorkflow("ride", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		var in struct {
			Cents int64 `json:"cents"`
		}
		if err := json.Unmarshal(a.Params(), &in); err != nil {
			return txn.Response{}, err
		}
		ride, err := txn.Atomic(ctx, a, "ride_created", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO rides (cents) VALUES ($1) RETURNING id`, in.Cents).Scan(&id)
			return id, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		charge, err := txn.Foreign(ctx, a, "charge_created", func(ctx context.Context, foreignKey string) (string, error) {
			if failCharge.CompareAndSwap(true, false) {
				return "", errProviderDown
			}
			mu.Lock()
			defer mu.Unlock()
			charges[foreignKey]++
			return "ch_" + foreignKey[:8], nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `UPDATE rides SET charge = $1 WHERE id = $2`, charge, ride); err != nil {
				return txn.Response{}, err
			}
			receipt, _ := json.Marshal(map[string]any{"ride": ride, "charge": charge})
			if err := outbox.Enqueue(ctx, tx, outbox.Message{Topic: "receipts", OrderingKey: "ride", Payload: receipt,
				Headers: map[string]string{"Content-Type": "application/json"}}); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(http.StatusCreated, map[string]any{"ride": ride, "charge": charge})
		})
	})
	registry := txn.NewRegistry()
	require.NoError(t, registry.Register(wf))
	runner, err := txn.New(tg.pool, &txn.Config{Workflows: registry, Logger: quiet})
	require.NoError(t, err)
	key := txn.Key{Scope: "rider_1", Value: "ride-1", Method: "POST", Path: "/rides", Params: []byte(`{"cents": 1250}`)}

	_, err = runner.RunWorkflow(ctx, key, wf)
	require.ErrorIs(t, err, errProviderDown)
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM idempotency_keys
		WHERE status = 'running' AND recovery_point = 'ride_created' AND lease_token IS NULL`))
	sqlExec(t, tg.d, `UPDATE idempotency_keys SET last_run_at = now() - interval '1 hour'`) // stalled

	resumer, err := recovery.New(runner, &recovery.Config{Logger: quiet})
	require.NoError(t, err)
	rep, err := resumer.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, recovery.Report{Resumed: 1}, rep)

	resp, err := runner.RunWorkflow(ctx, key, wf)
	require.NoError(t, err)
	require.True(t, resp.Replayed)
	require.Equal(t, http.StatusCreated, resp.Status)
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM rides WHERE charge IS NOT NULL`))
	mu.Lock()
	require.Len(t, charges, 1)
	for _, n := range charges {
		require.Equal(t, 1, n, "charged once")
	}
	mu.Unlock()

	var published []outbox.Envelope
	relay, err := outbox.New(tg.pool, outbox.PublisherFunc(func(ctx context.Context, e outbox.Envelope) error {
		mu.Lock()
		defer mu.Unlock()
		published = append(published, e)
		return nil
	}), &outbox.Config{Logger: quiet, DisableNotify: true})
	require.NoError(t, err)
	n, err := relay.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	n, err = relay.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "published once")
	require.Len(t, published, 1)
	require.Equal(t, "receipts", published[0].Topic)
	require.Equal(t, map[string]string{"Content-Type": "application/json"}, published[0].Headers)
	require.JSONEq(t, string(resp.Body), string(published[0].Payload))
}

// httpReplays: the middleware stores a handler's response and replays it.
func httpReplays(t *testing.T, tg target) {
	sqlExec(t, tg.d, `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, sku text NOT NULL)`)
	runner, err := txn.New(tg.pool, &txn.Config{Logger: quiet})
	require.NoError(t, err)
	mw, err := httpidem.New(runner, &httpidem.Config{Logger: quiet,
		Scope: func(r *http.Request) (string, error) { return r.Header.Get("Authorization"), nil }})
	require.NoError(t, err)
	var calls atomic.Int32
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		tx, _ := httpidem.Tx(r.Context())
		var in struct {
			SKU string `json:"sku"`
		}
		_ = json.NewDecoder(r.Body).Decode(&in)
		var id int64
		if err := tx.QueryRow(r.Context(), `INSERT INTO orders (sku) VALUES ($1) RETURNING id`, in.SKU).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{"id": id, "sku": in.SKU})
	})))
	defer srv.Close()
	post := func() (int, string, http.Header) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"sku":"tea"}`))
		require.NoError(t, err)
		req.Header.Set("Authorization", "acct_1")
		req.Header.Set(httpidem.HeaderName, `"order-1"`)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(body), resp.Header
	}
	status, body, _ := post()
	require.Equal(t, http.StatusCreated, status, body)
	status2, body2, header := post()
	require.Equal(t, status, status2)
	require.Equal(t, body, body2)
	require.Equal(t, "true", header.Get(httpidem.ReplayedHeader))
	require.Equal(t, int32(1), calls.Load())
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM orders`))
}

var (
	reaperOnce sync.Once
	reaperBin  string
	reaperErr  error
)

func buildReaper(t *testing.T) string {
	t.Helper()
	reaperOnce.Do(func() {
		dir, err := os.MkdirTemp("", "reaper-bouncer")
		if err != nil {
			reaperErr = err
			return
		}
		pgtest.AtExit(func() { _ = os.RemoveAll(dir) })
		reaperBin = filepath.Join(dir, "reaper")
		out, err := exec.Command("go", "build", "-o", reaperBin, "github.com/atomicphase/atomicphase/cmd/reaper").CombinedOutput()
		if err != nil {
			reaperErr = errors.New(err.Error() + ": " + string(out))
		}
	})
	require.NoError(t, reaperErr)
	return reaperBin
}

// reaperRound: the reaper command fails an unresumable stalled key and
// deletes an expired one.
func reaperRound(t *testing.T, tg target) {
	bin := buildReaper(t)
	sqlExec(t, tg.d, `INSERT INTO idempotency_keys (key, fingerprint, request_method, request_path, workflow, status,
			recovery_point, created_at, last_run_at, finished_at, response_status, response_headers, response_body)
		VALUES
			('stalled', decode(repeat('ab', 32), 'hex'), 'POST', '/rides', 'ride', 'running',
				'ride_created', now() - interval '2 hours', now() - interval '2 hours', NULL, NULL, NULL, NULL),
			('expired', decode(repeat('ab', 32), 'hex'), 'POST', '/rides', '', 'finished',
				'finished', now() - interval '3 days', now() - interval '3 days', now() - interval '25 hours', 201, '{}', '\x7b7d')`)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-once")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+tg.connString)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Run(), stderr.String())
	require.Contains(t, stderr.String(), `"failed_unknown_workflow":1`)
	require.Contains(t, stderr.String(), `"keys_deleted":1`)
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM idempotency_keys
		WHERE key = 'stalled' AND status = 'failed' AND failure_reason = 'unknown_workflow'`))
	require.Zero(t, tg.d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'expired'`))
}
