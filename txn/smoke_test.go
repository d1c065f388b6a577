package txn_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

func TestSmoke(t *testing.T) {
	d := pgtest.New(t)
	r, err := txn.New(d.Pool, nil)
	require.NoError(t, err)
	resp, err := r.Run(context.Background(), txn.Key{Value: "k1", Method: "POST", Path: "/x", Params: []byte(`{"b":1,"a":2}`)},
		func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, map[string]int{"x": 1}) })
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	resp, err = r.Run(context.Background(), txn.Key{Value: "k1", Method: "POST", Path: "/x", Params: []byte(`{"a":2, "b":1}`)},
		func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { panic("no") })
	require.NoError(t, err)
	require.True(t, resp.Replayed)
}
