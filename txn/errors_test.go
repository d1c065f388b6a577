package txn_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

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
