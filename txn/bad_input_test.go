package txn_test

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

func TestBadInputGetsClearErrorAndWritesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{MaxParamsBytes: 1024})
	ctx := ctxT(t)
	var calls atomic.Int64
	withParams := func(p string) txn.Key { k := chargeKey("k1", 1); k.Params = []byte(p); return k }
	cases := []struct {
		name   string
		key    txn.Key
		target error
		status int
	}{
		{"malformed JSON", withParams(`{"amount": 1`), txn.ErrInvalidRequest, 400},
		{"trailing data", withParams(`{"a":1} {"b":2}`), txn.ErrInvalidRequest, 400},
		{"duplicate keys", withParams(`{"a":1,"a":2}`), txn.ErrInvalidRequest, 400},
		{"NUL in string", withParams(`{"a":"x\u0000y"}`), txn.ErrInvalidRequest, 400},
		{"invalid UTF-8", withParams("{\"a\":\"\xff\"}"), txn.ErrInvalidRequest, 400},
		{"oversized", withParams(`{"a":"` + strings.Repeat("x", 2000) + `"}`), txn.ErrRequestTooLarge, 413},
		{"NUL in path", func() txn.Key { k := chargeKey("k1", 1); k.Path = "/a\x00"; return k }(), txn.ErrInvalidRequest, 400},
	}
	for _, c := range cases {
		_, err := e.runner.Run(ctx, c.key, insertCharge(&calls, "c", 1))
		require.ErrorIs(t, err, c.target, c.name)
		require.Equal(t, c.status, txn.HTTPStatus(err), c.name)
	}

	_, err := e.runner.Run(ctx, chargeKey("k1", 1), nil)
	require.ErrorIs(t, err, txn.ErrInvalidUse)

	unregistered := txn.NewWorkflow("nobody_registered_me", func(context.Context, *txn.Attempt) (txn.Response, error) {
		calls.Add(1)
		return txn.Response{Status: 200}, nil
	})
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), unregistered)
	require.ErrorIs(t, err, txn.ErrUnknownWorkflow)
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), nil)
	require.ErrorIs(t, err, txn.ErrInvalidUse)

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, err = e.runner.Run(cancelled, chargeKey("k1", 1), insertCharge(&calls, "c", 1))
	require.ErrorIs(t, err, context.Canceled)

	// A response with no status is a programming error, not a stored answer.
	_, err = e.runner.Run(ctx, chargeKey("k1", 1), func(context.Context, pgx.Tx) (txn.Response, error) { return txn.Response{}, nil })
	require.ErrorIs(t, err, txn.ErrInvalidUse)

	// A closed pool.
	closed := e.NewPool(t, nil)
	rc, err := txn.New(closed, nil)
	require.NoError(t, err)
	closed.Close()
	_, err = rc.Run(ctx, chargeKey("k1", 1), insertCharge(&calls, "c", 1))
	require.Error(t, err)
	require.Equal(t, http.StatusInternalServerError, txn.HTTPStatus(err))

	require.Equal(t, int64(0), calls.Load())
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM charges`))
}

func TestConfigAndRegistryValidation(t *testing.T) {
	t.Parallel()
	_, err := txn.New(nil, nil)
	require.ErrorIs(t, err, txn.ErrInvalidConfig)
	e := newEnv(t, nil)
	_, err = txn.New(e.Pool, &txn.Config{LeaseDuration: -1})
	require.ErrorIs(t, err, txn.ErrInvalidConfig)
	_, err = txn.New(e.Pool, &txn.Config{LeaseDuration: time.Millisecond})
	require.ErrorIs(t, err, txn.ErrInvalidConfig)

	reg := txn.NewRegistry()
	noop := func(context.Context, *txn.Attempt) (txn.Response, error) { return txn.Response{Status: 200}, nil }
	require.ErrorIs(t, reg.Register(nil), txn.ErrInvalidUse)
	require.ErrorIs(t, reg.Register(txn.NewWorkflow("", noop)), txn.ErrInvalidUse)
	require.ErrorIs(t, reg.Register(txn.NewWorkflow("x", nil)), txn.ErrInvalidUse)
	require.NoError(t, reg.Register(txn.NewWorkflow("x", noop)))
	require.ErrorIs(t, reg.Register(txn.NewWorkflow("x", noop)), txn.ErrInvalidUse, "duplicate name")
	require.Equal(t, []string{"x"}, reg.Names())
}

func TestPhaseMisuseIsReportedAndTransient(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	for name, body := range map[string]txn.WorkflowFunc{
		"repeated phase": func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
			if _, err := txn.Atomic(ctx, a, "p", func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
				return txn.Response{}, err
			}
			_, err := txn.Atomic(ctx, a, "p", func(context.Context, pgx.Tx) (int, error) { return 1, nil })
			return txn.Response{Status: 200}, err
		},
		"reserved name": func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
			_, err := txn.Atomic(ctx, a, "finished", func(context.Context, pgx.Tx) (int, error) { return 1, nil })
			return txn.Response{Status: 200}, err
		},
		"unencodable result": func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
			_, err := txn.Atomic(ctx, a, "p", func(context.Context, pgx.Tx) (chan int, error) { return make(chan int), nil })
			return txn.Response{Status: 200}, err
		},
	} {
		wf := txn.NewWorkflow(strings.ReplaceAll(name, " ", "_"), body)
		require.NoError(t, e.reg.Register(wf))
		_, err := e.runner.RunWorkflow(ctx, rideKey(wf.Name()), wf)
		require.ErrorIs(t, err, txn.ErrInvalidUse, name)
		require.False(t, readKey(t, e.Pool, "user_1", wf.Name()).LeaseHeld, name)
	}
}

func TestFingerprintMatchesEquivalentJSONOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64
	base := txn.Key{Scope: "s", Value: "fp", Method: "POST", Path: "/p", Params: []byte(`{"b":[1,{"y":2,"x":"é"}],"a":"\u00e9\/"}`)}
	_, err := e.runner.Run(ctx, base, insertCharge(&calls, "c", 1))
	require.NoError(t, err)

	same := []string{
		`{"a":"é/","b":[1,{"x":"é","y":2}]}`,
		"{ \"b\" : [ 1 , { \"x\" : \"\\u00e9\", \"y\" : 2 } ] ,\n \"a\" : \"é\\/\" }",
	}
	for _, p := range same {
		k := base
		k.Params = []byte(p)
		resp, err := e.runner.Run(ctx, k, insertCharge(&calls, "c", 1))
		require.NoError(t, err, p)
		require.True(t, resp.Replayed, p)
	}
	different := []string{
		`{"a":"é/","b":[1,{"x":"é","y":3}]}`,   // a value
		`{"a":"é/","b":[{"x":"é","y":2},1]}`,   // array order
		`{"a":"é/","b":[1,{"x":"é","y":2.0}]}`, // number literal
		`{"a":"é/","b":[1,{"x":"é","y":2}],"c":null}`,
	}
	for _, p := range different {
		k := base
		k.Params = []byte(p)
		_, err := e.runner.Run(ctx, k, insertCharge(&calls, "c", 1))
		require.ErrorIs(t, err, txn.ErrKeyReused, p)
	}
	for _, change := range []func(*txn.Key){
		func(k *txn.Key) { k.Method = "PATCH" },
		func(k *txn.Key) { k.Path = "/q" },
	} {
		k := base
		change(&k)
		_, err := e.runner.Run(ctx, k, insertCharge(&calls, "c", 1))
		require.ErrorIs(t, err, txn.ErrKeyReused)
	}
	require.Equal(t, int64(1), calls.Load())

	// The stored params are the canonical form, byte for byte.
	var stored []byte
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT request_params_raw FROM idempotency_keys`).Scan(&stored))
	require.Equal(t, `{"a":"é/","b":[1,{"x":"é","y":2}]}`, string(stored))
}

// A function that rewrites its own key row breaks the single-phase run's
// bookkeeping: nothing may commit then, although COMMIT is pipelined.
func TestSinglePhaseCommitsNothingIfItsKeyRowChanged(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	_, err := e.runner.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('x', 1)`); err != nil {
			return txn.Response{}, err
		}
		_, err := tx.Exec(ctx, `UPDATE idempotency_keys SET request_path = request_path`) // moves the row
		return txn.Response{Status: 201}, err
	})
	require.Error(t, err)
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM charges`), "the business write did not commit")
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
}
