package torture

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/txn"
)

var natsURL string

func TestMain(m *testing.M) {
	if os.Getenv(envChild) != "" {
		// A crash-matrix child process: no server of its own.
		pgtest.Main(m)
		return
	}
	natsURL = os.Getenv("TEST_NATS_URL")
	if natsURL == "" {
		dir, err := os.MkdirTemp("", "torture-nats")
		if err != nil {
			panic(err)
		}
		srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoSigs: true})
		if err != nil {
			_ = os.RemoveAll(dir)
			panic(err)
		}
		// pgtest.Main ends the process with os.Exit, so a deferred call
		// would never run: stop the server in its exit hook, before goleak
		// looks for leftover goroutines.
		pgtest.AtExit(func() { srv.Shutdown(); srv.WaitForShutdown(); _ = os.RemoveAll(dir) })
		go srv.Start()
		if !srv.ReadyForConnections(10 * time.Second) {
			panic("nats did not start")
		}
		natsURL = srv.ClientURL()
	}
	pgtest.Main(m)
}

// iterations is how often randomized tests repeat (TORTURE_ITERATIONS).
func iterations() int {
	n, err := strconv.Atoi(os.Getenv("TORTURE_ITERATIONS"))
	if err != nil || n < 1 {
		return 1
	}
	return n
}

const flowSchema = `
CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key text NOT NULL, attempt int NOT NULL);
-- The side-effect log: one row per committed effect, written in the effect's transaction.
CREATE TABLE effects (key text NOT NULL, effect text NOT NULL, attempt int NOT NULL);
-- The payment provider's tables: every call is logged; charges are idempotent on the key.
CREATE TABLE provider_calls (foreign_key text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE provider_charges (foreign_key text PRIMARY KEY, charge_id text NOT NULL);`

// flow is a 3-phase workflow (atomic, foreign, final atomic with an outbox
// message) whose every effect is logged, with hooks at its boundaries.
type flow struct {
	wf    *txn.Workflow
	pool  *pgxpool.Pool // the provider's own connections
	topic string
	// hook is called at named points; crash tests kill the process there.
	hook func(point string)
	// delay, when set, stretches phases (storm tests make leases expire mid-phase).
	delay func() time.Duration
	phase atomic.Value // the phase running now, for tracers
}

func newFlow(t testing.TB, pool *pgxpool.Pool, reg *txn.Registry, topic string) *flow {
	f := &flow{pool: pool, topic: topic, hook: func(string) {}, delay: func() time.Duration { return 0 }}
	f.phase.Store("")
	f.wf = txn.NewWorkflow("torture_order", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		_, key := a.Key()
		f.phase.Store("order_created")
		orderID, err := txn.Atomic(ctx, a, "order_created", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			if err := tx.QueryRow(ctx, `INSERT INTO orders (key, attempt) VALUES ($1, $2) RETURNING id`, key, a.Number()).Scan(&id); err != nil {
				return 0, err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, 'order_created', $2)`, key, a.Number()); err != nil {
				return 0, err
			}
			time.Sleep(f.delay())
			return id, nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		f.hook("between_phases")
		f.phase.Store("charged")
		charge, err := txn.Foreign(ctx, a, "charged", func(ctx context.Context, fk string) (string, error) {
			id, err := f.charge(ctx, fk)
			if err != nil {
				return "", err
			}
			f.hook("inside_foreign")
			time.Sleep(f.delay())
			return id, nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		f.phase.Store("finish")
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, 'finished', $2)`, key, a.Number()); err != nil {
				return txn.Response{}, err
			}
			payload, _ := json.Marshal(map[string]any{"key": key, "order_id": orderID, "charge_id": charge})
			if err := outbox.Enqueue(ctx, tx, outbox.Message{Topic: f.topic, Payload: payload}); err != nil {
				return txn.Response{}, err
			}
			time.Sleep(f.delay())
			return txn.JSON(201, map[string]any{"order_id": orderID, "charge_id": charge})
		})
	})
	require.NoError(t, reg.Register(f.wf))
	return f
}

// charge is the idempotent payment provider: it logs every call and
// charges once per foreign key.
func (f *flow) charge(ctx context.Context, fk string) (string, error) {
	if _, err := f.pool.Exec(ctx, `INSERT INTO provider_calls (foreign_key) VALUES ($1)`, fk); err != nil {
		return "", err
	}
	id := "ch_" + fk[3:15]
	if _, err := f.pool.Exec(ctx, `INSERT INTO provider_charges VALUES ($1, $2) ON CONFLICT DO NOTHING`, fk, id); err != nil {
		return "", err
	}
	return id, nil
}

func orderKey(i int) txn.Key {
	return txn.Key{Scope: "tenant", Value: fmt.Sprintf("order-%d", i), Method: "POST", Path: "/orders",
		Params: []byte(`{"sku":"book","quantity":1}`)}
}

// exactlyOnce asserts, from the database, that every key in keys finished
// and each of its effects committed exactly once.
func exactlyOnce(t testing.TB, d *pgtest.DB, keys int) {
	t.Helper()
	require.Equal(t, keys, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'finished'`), "every key finished")
	require.Equal(t, keys, d.Count(t, `SELECT count(*) FROM orders`), "one order per key")
	require.Equal(t, 0, d.Count(t, `SELECT count(*) FROM (SELECT key, effect FROM effects GROUP BY 1, 2 HAVING count(*) > 1) d`), "no effect twice")
	require.Equal(t, 2*keys, d.Count(t, `SELECT count(*) FROM effects`), "every effect once")
	require.Equal(t, keys, d.Count(t, `SELECT count(*) FROM provider_charges`), "one charge per key")
	require.Equal(t, keys, d.Count(t, `SELECT count(*) FROM outbox_messages`), "one message per key")
}

func quietLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelError}))
}

func newDB(t testing.TB) *pgtest.DB {
	d := pgtest.New(t)
	_, err := d.Pool.Exec(context.Background(), flowSchema)
	require.NoError(t, err)
	return d
}

func errorsIs(err, target error) bool { return errors.Is(err, target) }
