package txn_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

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
func (c *capture) WithGroup(string) slog.Handler      { return c }

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

// Every error carries its package's prefix once, and names the problem.
func TestErrorsCarryOnePrefixAndNameTheProblem(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{MaxRetries: 1, RetryBaseDelay: 1})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	check := func(err error, contains string) {
		t.Helper()
		require.Error(t, err)
		msg := err.Error()
		require.Equal(t, 1, strings.Count(msg, "txn:"), "one prefix: %s", msg)
		require.True(t, strings.HasPrefix(msg, "txn: "), msg)
		require.Contains(t, msg, contains)
	}
	noop := func(context.Context, pgx.Tx) (txn.Response, error) { return txn.JSON(201, 1) }

	_, err := txn.New(nil, nil)
	check(err, "pool is nil")
	_, err = e.runner.Run(ctx, txn.Key{}, noop)
	check(err, "key: empty")
	_, err = e.runner.Run(ctx, txn.Key{Scope: strings.Repeat("s", 300), Value: "k"}, noop)
	check(err, "scope: 300 bytes")
	_, err = e.runner.Run(ctx, txn.Key{Value: "k", Params: []byte(`{"a":1,"a":2}`)}, noop)
	check(err, `duplicate object key "a"`)
	_, err = e.runner.Run(ctx, txn.Key{Value: "k", Params: []byte(`{"a":1e1000000}`)}, noop)
	check(err, "out of PostgreSQL's numeric range")
	_, err = e.runner.Run(ctx, chargeKey("panics", 1), func(context.Context, pgx.Tx) (txn.Response, error) { panic("boom") })
	check(err, "operation panicked: boom")
	_, err = e.runner.Run(ctx, chargeKey("conflict", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END $$`)
		return txn.Response{}, err
	})
	check(err, "transaction conflict persisted after retries")
	unregistered := txn.NewWorkflow("unregistered", func(context.Context, *txn.Attempt) (txn.Response, error) {
		return txn.JSON(201, 1)
	})
	_, err = e.runner.RunWorkflow(ctx, rideKey("u"), unregistered)
	check(err, "workflow not registered")
	require.NotContains(t, err.Error(), "resumable", "no key exists to resume")
	_, err = e.runner.Resume(ctx, "user_1", "missing")
	check(err, "idempotency key not found")

	f.failAt.Store("after_p1")
	_, err = e.runner.RunWorkflow(ctx, rideKey("held"), f.wf)
	require.ErrorIs(t, err, errInjected)
	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET lease_token = gen_random_uuid(),
		leased_until = now() + interval '1 minute' WHERE key = 'held'`)
	require.NoError(t, err)
	_, err = e.runner.RunWorkflow(ctx, rideKey("held"), f.wf)
	check(err, "in use by another attempt")

	repeated := txn.NewWorkflow("repeated", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		one := func(context.Context, pgx.Tx) (int, error) { return 1, nil }
		if _, err := txn.Atomic(ctx, a, "p", one); err != nil {
			return txn.Response{}, err
		}
		_, err := txn.Atomic(ctx, a, "p", one)
		return txn.Response{}, err
	})
	require.NoError(t, e.reg.Register(repeated))
	_, err = e.runner.RunWorkflow(ctx, rideKey("rep"), repeated)
	check(err, `phase "p" used twice`)
	require.True(t, errors.Is(err, txn.ErrInvalidUse))
}
