package txn_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/backoff"
	"github.com/atomicphase/atomicphase/internal/txnbridge"
	"github.com/atomicphase/atomicphase/txn"
)

// A phase's retries after a serialization failure or a deadlock back off
// from RetryBaseDelay, doubling up to RetryMaxDelay, with equal jitter.
func TestPhaseRetriesBackOffWithEqualJitter(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := txn.New(e.Pool, &txn.Config{RetryBaseDelay: 3 * time.Millisecond, RetryMaxDelay: 40 * time.Millisecond})
	require.NoError(t, err)
	require.Equal(t, backoff.Policy{Base: 3 * time.Millisecond, Max: 40 * time.Millisecond, Jitter: backoff.Equal}, txn.RetryPolicy(r))
	require.Equal(t, backoff.Policy{Base: 2 * time.Millisecond, Max: 250 * time.Millisecond, Jitter: backoff.Equal},
		txn.RetryPolicy(e.runner), "the defaults")
}

// The module's packages built on txn (recovery, httpidem) see the runner's
// own pool and settings, defaults filled in, and workflows registered after
// New.
func TestBridgeDescribesTheRunnerToTheModulesPackages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	reg := txn.NewRegistry()
	logger := slog.New(slog.DiscardHandler)
	r, err := txn.New(e.Pool, &txn.Config{Workflows: reg, Logger: logger, MaxAge: time.Hour,
		Store: func(status int) bool { return status == 201 }})
	require.NoError(t, err)
	b := txnbridge.Of(r)
	require.Same(t, e.Pool, b.Pool)
	require.Same(t, logger, b.Logger)
	require.Equal(t, time.Hour, b.MaxAge)
	require.True(t, b.Store(201))
	require.False(t, b.Store(200))
	require.Empty(t, b.Registered())
	noop := func(context.Context, *txn.Attempt) (txn.Response, error) { return txn.JSON(201, 1) }
	require.NoError(t, reg.Register(txn.NewWorkflow("b", noop), txn.NewWorkflow("a", noop)))
	require.Equal(t, []string{"a", "b"}, b.Registered())

	d := txnbridge.Of(e.runner)
	require.Equal(t, txn.MaxAgeDefault, d.MaxAge)
	require.True(t, d.Store(500))
	require.False(t, d.Store(422), "txn.DefaultStore")
}

// capture is a slog.Handler that keeps every record, for assertions.
type capture struct {
	mu      sync.Mutex
	records []slog.Record
}

func (c *capture) Enabled(context.Context, slog.Level) bool { return true }

func (c *capture) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.records = append(c.records, r.Clone())
	return nil
}

func (c *capture) WithAttrs([]slog.Attr) slog.Handler { return c }

func (c *capture) WithGroup(string) slog.Handler { return c }

// take returns the records logged since the last take.
func (c *capture) take() []slog.Record {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := c.records
	c.records = nil
	return r
}

func atLeast(records []slog.Record, level slog.Level) []string {
	var msgs []string
	for _, r := range records {
		if r.Level >= level {
			msgs = append(msgs, r.Message)
		}
	}
	return msgs
}

func attr(r slog.Record, key string) (slog.Value, bool) {
	var v slog.Value
	found := false
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v, found = a.Value, true
			return false
		}
		return true
	})
	return v, found
}

// A rejection returned unstored is DEBUG, a transient failure exactly one
// WARN (a failed release included in it), and durations are
// time.Duration values.
func TestLogLevelsAndDurations(t *testing.T) {
	t.Parallel()
	logs := &capture{}
	e := newEnv(t, &txn.Config{Logger: slog.New(logs), LeaseDuration: time.Minute})
	ctx := ctxT(t)

	_, err := e.runner.Run(ctx, chargeKey("rejected", 1), func(context.Context, pgx.Tx) (txn.Response, error) {
		return txn.JSON(400, "bad")
	})
	require.NoError(t, err)
	recs := logs.take()
	require.Empty(t, atLeast(recs, slog.LevelInfo), "a client-correctable answer is not news")
	require.Len(t, recs, 1)
	require.Equal(t, slog.LevelDebug, recs[0].Level)

	_, err = e.runner.Run(ctx, chargeKey("broken", 1), func(context.Context, pgx.Tx) (txn.Response, error) {
		return txn.Response{}, errInjected
	})
	require.ErrorIs(t, err, errInjected)
	require.Len(t, atLeast(logs.take(), slog.LevelWarn), 1, "one WARN per transient failure")

	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("after_p1")
	_, err = e.runner.RunWorkflow(ctx, rideKey("w"), f.wf)
	require.ErrorIs(t, err, errInjected)
	require.Len(t, atLeast(logs.take(), slog.LevelWarn), 1, "one WARN per transient failure")

	// The release fails too (the pool is gone): still one WARN, saying so.
	closed := e.NewPool(t, nil)
	rc, err := txn.New(closed, &txn.Config{Workflows: e.reg, Logger: slog.New(logs)})
	require.NoError(t, err)
	f.failAt.Store("")
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "after_p2" {
			closed.Close()
		}
	}
	_, err = rc.RunWorkflow(ctx, rideKey("w2"), f.wf)
	require.Error(t, err)
	warns := atLeast(logs.take(), slog.LevelWarn)
	require.Len(t, warns, 1, "%v", warns)
	f.hook = nil

	// In use: Retry-After is logged as a duration.
	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET lease_token = gen_random_uuid(),
		leased_until = now() + interval '1 minute' WHERE key = 'w'`)
	require.NoError(t, err)
	_, err = e.runner.RunWorkflow(ctx, rideKey("w"), f.wf)
	require.ErrorIs(t, err, txn.ErrKeyInUse)
	recs = logs.take()
	require.Len(t, recs, 1)
	v, ok := attr(recs[0], "retry_after")
	require.True(t, ok)
	require.Equal(t, slog.KindDuration, v.Kind())
	require.Empty(t, atLeast(recs, slog.LevelWarn), "a hit is logged at HitLogLevel only")
}

// Every pgx query exec mode works, so PgBouncer in transaction mode is
// supported: in exec and simple protocol modes parameters go as text without
// type OIDs, so jsonb must be bound as text and bytea as bytes. Each mode
// runs a single-phase key with stored headers, a workflow whose foreign
// result jsonb cannot hold through a resume, and a key failed for its age.
func TestEveryQueryExecModeStoresResumesAndFailsKeys(t *testing.T) {
	t.Parallel()
	modes := map[string]pgx.QueryExecMode{
		"cache_statement": pgx.QueryExecModeCacheStatement,
		"cache_describe":  pgx.QueryExecModeCacheDescribe,
		"describe_exec":   pgx.QueryExecModeDescribeExec,
		"exec":            pgx.QueryExecModeExec,
		"simple_protocol": pgx.QueryExecModeSimpleProtocol,
	}
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			pool := e.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
			require.NoError(t, err)

			resp, err := r.Run(ctx, chargeKey("single", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				return txn.Response{Status: 201, Header: http.Header{"Location": {"/c/1"}}, Body: []byte("{}")}, nil
			})
			require.NoError(t, err)
			replay, err := r.Run(ctx, chargeKey("single", 1), nil2xx)
			require.NoError(t, err)
			require.True(t, replay.Replayed)
			require.Equal(t, resp.Header, replay.Header)

			var fail = true
			wf := txn.NewWorkflow("mode", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
				got, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (json.RawMessage, error) {
					return json.RawMessage(`{"memo":"\u0000","n":1e400000}`), nil
				})
				if err != nil {
					return txn.Response{}, err
				}
				if fail {
					return txn.Response{}, errInjected
				}
				return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
					return txn.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: got}, nil
				})
			})
			require.NoError(t, e.reg.Register(wf))
			_, err = r.RunWorkflow(ctx, rideKey("wf"), wf)
			require.ErrorIs(t, err, errInjected)
			fail = false
			resp, err = r.Resume(ctx, "user_1", "wf")
			require.NoError(t, err)
			require.Equal(t, `{"memo":"\u0000","n":1e400000}`, string(resp.Body))

			_, err = r.RunWorkflow(ctx, rideKey("old"), wf)
			require.NoError(t, err, "fail is false: finishes")
			_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET status = 'running', finished_at = NULL,
				response_status = NULL, response_headers = NULL, response_body = NULL,
				created_at = now() - interval '13 hours' WHERE key = 'old'`)
			require.NoError(t, err)
			resp, err = r.RunWorkflow(ctx, rideKey("old"), wf)
			require.NoError(t, err)
			require.Equal(t, 500, resp.Status)
			require.Equal(t, "application/problem+json", resp.Header.Get("Content-Type"))
		})
	}
}

func nil2xx(context.Context, pgx.Tx) (txn.Response, error) { return txn.Response{Status: 204}, nil }

// Operations on unrelated keys must not make each other fail: the key
// bookkeeping inside SERIALIZABLE phases takes no predicate locks on shared
// index pages (single-phase runs reserve an id and insert; workflow phases
// update their row by ctid, as HOT updates). Before that, 16 workers over
// fresh keys saw dozens of ErrConflict per thousand operations.
func TestUnrelatedKeysDoNotConflict(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	wf := txn.NewWorkflow("two_phases", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "one", func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, 1) })
	})
	require.NoError(t, e.reg.Register(wf))
	noop := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, 1) }
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 40 {
				key := txn.Key{Value: fmt.Sprintf("g%d-%d", g, i), Method: "POST", Path: "/x"}
				var err error
				if i%2 == 0 {
					_, err = e.runner.Run(ctx, key, noop)
				} else {
					_, err = e.runner.RunWorkflow(ctx, key, wf)
				}
				require.NoError(t, err)
			}
		})
	}
	wg.Wait()
	s := e.runner.Stats()
	require.Zero(t, s.Conflicts)
	require.Equal(t, uint64(640), s.Executed)
	t.Logf("serialization retries over 640 operations: %d", s.Retries)
}
