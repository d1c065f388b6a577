package txntest_test

import (
	"bytes"
	"context"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
	"github.com/atomicphase/atomicphase/txntest"
)

// newCheckout is a service's workflow, as its own package would define it:
// an order, a charge at the payment provider under the phase's foreign
// key, then the charge recorded with the response.
func newCheckout(charge func(ctx context.Context, key string, cents int64) (string, error)) *txn.Workflow {
	return txn.NewWorkflow("checkout", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		order, err := txn.Atomic(ctx, a, "order_created", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO orders (cents) VALUES (1250) RETURNING id`).Scan(&id)
			return id, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		chargeID, err := txn.Foreign(ctx, a, "charged", func(ctx context.Context, foreignKey string) (string, error) {
			return charge(ctx, foreignKey, 1250)
		})
		if err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `UPDATE orders SET charge_id = $1 WHERE id = $2`, chargeID, order); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(201, map[string]any{"order": order, "charge": chargeID})
		})
	})
}

// The README's "Testing your own workflows" quotes this test.
func TestCheckoutChargesOnceWhateverCrashes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	txntest.CrashEveryBoundary(t, txntest.Options{
		// The workflow the service registers, charging through the kit's fake provider.
		Workflow: func(t testing.TB, env *txntest.Env) *txn.Workflow {
			return newCheckout(func(ctx context.Context, key string, cents int64) (string, error) {
				return env.Provider.Call(ctx, key, map[string]int64{"cents": cents})
			})
		},
		Setup: func(t testing.TB, env *txntest.Env) { // each run gets a fresh schema
			_, err := env.Pool.Exec(ctx, `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY
				PRIMARY KEY, cents bigint NOT NULL, charge_id text)`)
			require.NoError(t, err)
		},
		Key: txn.Key{Scope: "customer_7", Value: "checkout-1", Method: "POST", Path: "/checkout", Params: []byte(`{}`)},
		Check: func(t testing.TB, env *txntest.Env, resp txn.Response) { // after every recovery
			require.Len(t, env.Provider.Effects(t), 1, "charged once")
			var charged int
			require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE charge_id IS NOT NULL`).Scan(&charged))
			require.Equal(t, 1, charged, "one order, charged")
		},
	})
}

// quoted returns the text of the function named name in example_test.go.
func quoted(t *testing.T, name string) string {
	src, err := os.ReadFile("example_test.go")
	require.NoError(t, err)
	_, body, ok := bytes.Cut(src, []byte("\nfunc "+name+"("))
	require.True(t, ok, "example_test.go has no func %s", name)
	body, _, ok = bytes.Cut(body, []byte("\n}\n"))
	require.True(t, ok)
	return "func " + name + "(" + string(body) + "\n}\n"
}

func TestReadmeQuotesTheCheckoutTest(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	_, section, ok := bytes.Cut(readme, []byte("\n## Testing your own workflows\n"))
	require.True(t, ok, "README has no section Testing your own workflows")
	_, block, ok := bytes.Cut(section, []byte("\n```go\n"))
	require.True(t, ok, "the section has no Go block")
	block, _, ok = bytes.Cut(block, []byte("\n```\n"))
	require.True(t, ok, "the section's Go block is not closed")
	require.Equal(t, quoted(t, "TestCheckoutChargesOnceWhateverCrashes"), string(block)+"\n",
		"copy TestCheckoutChargesOnceWhateverCrashes from txntest/example_test.go into the README")
}
