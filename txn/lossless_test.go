package txn_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

// DESIGN rule 12: a foreign call's result is always recorded, and comes
// back byte for byte on a resume, even what jsonb cannot hold (\u0000, a
// number beyond numeric's range).
func TestForeignResultJSONBCannotHoldRoundTripsByteExactThroughResume(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	result := json.RawMessage(`{"memo":"a\u0000b <&>","amount":1e1000000,"fee":1.50,"ok":true}`)
	want, err := json.Marshal(result) // what encoding/json produces is what is stored
	require.NoError(t, err)

	var calls atomic.Int64
	var fail atomic.Bool
	fail.Store(true)
	seen := make(chan []byte, 2)
	wf := txn.NewWorkflow("provider_answer", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		got, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (json.RawMessage, error) {
			calls.Add(1)
			return result, nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		seen <- append([]byte(nil), got...)
		if fail.Load() {
			return txn.Response{}, errInjected // crash after the phase committed
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			return txn.Response{Status: 201, Body: got}, nil
		})
	})
	require.NoError(t, e.reg.Register(wf))
	_, err = e.runner.RunWorkflow(ctx, rideKey("k"), wf)
	require.ErrorIs(t, err, errInjected)
	require.Equal(t, "charge", readKey(t, e.Pool, "user_1", "k").RecoveryPoint, "the result was recorded")
	require.Equal(t, string(want), string(<-seen), "the first attempt sees the stored form")

	fail.Store(false)
	resp, err := e.runner.Resume(ctx, "user_1", "k")
	require.NoError(t, err)
	require.Equal(t, string(want), string(<-seen), "the resumed attempt sees the same bytes")
	require.Equal(t, string(want), string(resp.Body))
	require.Equal(t, int64(1), calls.Load(), "the provider was called once")
}

// Params: what PostgreSQL cannot hold is ErrInvalidRequest before any SQL,
// and a resumed attempt sees the params byte for byte as the first did.
func TestParamsPostgreSQLCannotHoldAreInvalidRequestBeforeAnySQL(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, qc := e.countingRunner(t, nil)
	for _, p := range []string{`{"amount":1e1000000}`, `[1e-20000]`, `{"a":"\u0000"}`} {
		k := chargeKey("k", 1)
		k.Params = []byte(p)
		_, err := r.Run(ctx, k, func(context.Context, pgx.Tx) (txn.Response, error) { return txn.JSON(201, 1) })
		require.ErrorIs(t, err, txn.ErrInvalidRequest, p)
		var reqErr *txn.RequestError
		require.True(t, errors.As(err, &reqErr), p)
		require.Equal(t, "params", reqErr.Field)
	}
	require.Zero(t, qc.n.Load(), "no statement was sent")
}

func TestResumedAttemptSeesByteIdenticalParams(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	params := []byte(`{ "z": "<b>", "amount": 1E+2, "items": [{"qty": 2.50, "sku": "a"}], "note": "\u00e9\/" }`)
	var fail atomic.Bool
	fail.Store(true)
	seen := make(chan string, 2)
	wf := txn.NewWorkflow("params", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		seen <- string(a.Params())
		if _, err := txn.Atomic(ctx, a, "one", func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		if fail.Load() {
			return txn.Response{}, errInjected
		}
		return txn.Response{Status: 201, Body: a.Params()}, nil
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, txn.Key{Scope: "s", Value: "k", Method: "POST", Path: "/p", Params: params}, wf)
	require.ErrorIs(t, err, errInjected)
	first := <-seen
	require.Equal(t, `{"amount":1E+2,"items":[{"qty":2.50,"sku":"a"}],"note":"é/","z":"<b>"}`, first,
		"canonical: keys sorted, literals as written, no HTML escaping")

	fail.Store(false)
	resp, err := e.runner.Resume(ctx, "s", "k")
	require.NoError(t, err)
	require.Equal(t, first, <-seen, "the resumed attempt sees the same bytes")
	require.Equal(t, first, string(resp.Body))
}

// Rows written before migration 00004 keep their params and phase results
// in jsonb only; they still resume, from those.
func TestKeyStoredBeforeLosslessColumnsStillResumes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("after_p1")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	// What the previous version stored: jsonb columns, no raw ones.
	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys
		SET request_params = convert_from(request_params_raw, 'UTF8')::jsonb,
		    phase_results = convert_from(phase_results_raw, 'UTF8')::jsonb,
		    request_params_raw = NULL, phase_results_raw = NULL`)
	require.NoError(t, err)
	f.failAt.Store("")
	resp, err := e.runner.Resume(ctx, "user_1", "k1")
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Contains(t, string(resp.Body), `"amount":1250`)
	require.Equal(t, int64(1), f.p1.Load(), "the phase committed before is not run again")
}
