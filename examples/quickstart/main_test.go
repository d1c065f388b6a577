package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
	"github.com/atomicphase/atomicphase/txntest"
)

func TestMain(m *testing.M) { txntest.Main(m) }

// The quickstart's 3-phase ride workflow writes its ride and its receipt
// once, and answers the same, wherever the process running it dies.
func TestRideWorkflowSurvivesACrashAtEveryBoundary(t *testing.T) {
	ctx := context.Background()
	key := txn.Key{Scope: "customer_42", Value: "ride-1", Method: "POST", Path: "/rides",
		Params: []byte(`{"amount_cents": 1800}`)}
	txntest.CrashEveryBoundary(t, txntest.Options{
		Workflow: func(testing.TB, *txntest.Env) *txn.Workflow { return newRideFlow().wf },
		Setup: func(t testing.TB, env *txntest.Env) {
			_, err := env.Pool.Exec(ctx, chargesTable)
			require.NoError(t, err)
		},
		Key: key,
		Check: func(t testing.TB, env *txntest.Env, resp txn.Response) {
			rows, err := env.Pool.Query(ctx, `SELECT what FROM quickstart_charges WHERE idempotency_key = $1 ORDER BY id`,
				key.Scope+"/"+key.Value)
			require.NoError(t, err)
			var what []string
			for rows.Next() {
				var w string
				require.NoError(t, rows.Scan(&w))
				what = append(what, w)
			}
			require.NoError(t, rows.Err())
			require.Equal(t, []string{"ride", "receipt"}, what, "one ride, one receipt")
		},
	})
}
