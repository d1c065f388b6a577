package txn_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

func TestInvalidKeysAreRejectedBeforeAnySQL(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, qc := e.countingRunner(t, nil)
	var calls atomic.Int64
	for name, v := range map[string]string{
		"empty":         "",
		"256 bytes":     strings.Repeat("a", 256),
		"newline":       "abc\n",
		"tab":           "a\tb",
		"DEL":           "a\x7f",
		"non-ASCII":     "clé",
		"NUL":           "a\x00b",
		"bad scope":     "ok",
		"bad scope NUL": "ok",
	} {
		k := chargeKey(v, 1)
		switch name {
		case "bad scope":
			k.Scope = strings.Repeat("s", 256)
		case "bad scope NUL":
			k.Scope = "a\x00"
		}
		_, err := r.Run(ctx, k, insertCharge(&calls, "c", 1))
		require.ErrorIs(t, err, txn.ErrInvalidKey, name)
		require.Equal(t, http.StatusBadRequest, txn.HTTPStatus(err), name)
	}
	require.Equal(t, int64(0), qc.n.Load(), "no statement was sent")
	require.Equal(t, int64(0), calls.Load())
	require.NoError(t, txn.ValidateKey(strings.Repeat("a", 255)))
	require.NoError(t, txn.ValidateKey(" ~!valid key~ "))
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

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
