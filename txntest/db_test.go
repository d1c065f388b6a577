package txntest_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
	"github.com/atomicphase/atomicphase/txntest"
)

func currentSchema(t testing.TB, pool *pgxpool.Pool) string {
	var s string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT current_schema()`).Scan(&s))
	return s
}

func schemaExists(t testing.TB, pool *pgxpool.Pool, name string) bool {
	var ok bool
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)`, name).Scan(&ok))
	return ok
}

func TestDBGivesEachTestAMigratedSchemaOfItsOwn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, b := txntest.DB(t), txntest.DB(t)
	require.NotEqual(t, currentSchema(t, a), currentSchema(t, b))
	for _, pool := range []*pgxpool.Pool{a, b} {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&n), "migrated")
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_messages`).Scan(&n), "migrated")
	}
	_, err := a.Exec(ctx, `CREATE TABLE only_in_a (id int)`)
	require.NoError(t, err)
	_, err = b.Exec(ctx, `SELECT * FROM only_in_a`)
	require.Error(t, err, "isolated")
}

func TestDBDropsTheSchemaWhenTheTestEnds(t *testing.T) {
	t.Parallel()
	var schema string
	t.Run("user", func(t *testing.T) { schema = currentSchema(t, txntest.DB(t)) })
	require.False(t, schemaExists(t, txntest.DB(t), schema))
}

// The kit's child processes run the test function from its start, so a DB
// called before CrashEveryBoundary creates a schema in each child, which
// dies before its cleanup: the parent drops it.
func TestSchemasAChildCreatesBeforeTheKitAreDropped(t *testing.T) {
	t.Parallel()
	pool := txntest.DB(t) // in each child too
	ctx := context.Background()
	mine := currentSchema(t, pool)
	var checked atomic.Int64
	txntest.CrashEveryBoundary(t, txntest.Options{
		Workflow: func(t testing.TB, env *txntest.Env) *txn.Workflow {
			// In a child, pool is the child's own schema: note it.
			_, err := env.Pool.Exec(ctx, `INSERT INTO seen_schemas VALUES ($1)`, currentSchema(t, pool))
			require.NoError(t, err)
			return txn.NewWorkflow("receipt", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
				return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
					return txn.JSON(201, "ok")
				})
			})
		},
		Setup: func(t testing.TB, env *txntest.Env) {
			_, err := env.Pool.Exec(ctx, `CREATE TABLE seen_schemas (name text NOT NULL)`)
			require.NoError(t, err)
		},
		IgnoreTables: []string{"seen_schemas"}, // one row per process that built the workflow
		Key:          txn.Key{Value: "receipt-1", Method: "POST", Path: "/receipts", Params: []byte(`{}`)},
		Check: func(t testing.TB, env *txntest.Env, _ txn.Response) {
			rows, err := env.Pool.Query(ctx, `SELECT name FROM seen_schemas WHERE name <> $1`, mine)
			require.NoError(t, err)
			names, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			for _, name := range names {
				require.False(t, schemaExists(t, env.Pool, name), "the child's schema %s is dropped", name)
				checked.Add(1)
			}
		},
	})
	require.Positive(t, checked.Load(), "children created schemas, and the test looked at them")
}
