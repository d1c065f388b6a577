package txntest_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
	"github.com/atomicphase/atomicphase/txntest"
)

// envBroken names the broken-workflow test a child process of the verdict
// tests runs; the kit must fail it.
const envBroken = "TXNTEST_BROKEN_WORKFLOW"

// brokenOnly tells a broken-workflow test whether to run: only in the child
// process of the verdict test that inspects its failure.
func brokenOnly(t *testing.T) bool { return os.Getenv(envBroken) == t.Name() }

var checkoutKey = txn.Key{Scope: "customer_7", Value: "checkout-1", Method: "POST", Path: "/checkout", Params: []byte(`{}`)}

func createOrders(t testing.TB, env *txntest.Env) {
	_, err := env.Pool.Exec(context.Background(), `
		CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, cents bigint, charge_id text);
		CREATE TABLE charges (order_id bigint NOT NULL, charge_id text NOT NULL)`)
	require.NoError(t, err)
}

func chargedOnce(t testing.TB, env *txntest.Env, _ txn.Response) {
	require.Len(t, env.Provider.Effects(t), 1, "charged once")
}

// TestBrokenForeignKeyFromTheClock runs, in a child process of
// TestKitFailsAForeignKeyBuiltFromTheClock, a checkout whose foreign call
// builds the provider's idempotency key from the clock instead of passing
// the foreign key it is given.
func TestBrokenForeignKeyFromTheClock(t *testing.T) {
	if !brokenOnly(t) {
		return
	}
	txntest.CrashEveryBoundary(t, txntest.Options{
		Workflow: func(t testing.TB, env *txntest.Env) *txn.Workflow {
			return newCheckout(func(ctx context.Context, _ string, cents int64) (string, error) {
				key := fmt.Sprintf("charge-%d", time.Now().UnixNano()) // the bug: new on every attempt
				return env.Provider.Call(ctx, key, map[string]int64{"cents": cents})
			})
		},
		Setup: createOrders,
		Key:   checkoutKey,
		Check: chargedOnce,
	})
}

// TestBrokenEffectOutsideAnyPhase runs, in a child process of
// TestKitFailsAnEffectWrittenOutsideAnyPhase, a checkout that records the
// charge through the pool between its phases instead of in Finish's
// transaction.
func TestBrokenEffectOutsideAnyPhase(t *testing.T) {
	if !brokenOnly(t) {
		return
	}
	txntest.CrashEveryBoundary(t, txntest.Options{
		Workflow: func(t testing.TB, env *txntest.Env) *txn.Workflow {
			return txn.NewWorkflow("checkout", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
				order, err := txn.Atomic(ctx, a, "order_created", func(ctx context.Context, tx pgx.Tx) (int64, error) {
					var id int64
					err := tx.QueryRow(ctx, `INSERT INTO orders (cents) VALUES (1250) RETURNING id`).Scan(&id)
					return id, err
				})
				if err != nil {
					return txn.Response{}, err
				}
				charge, err := txn.Foreign(ctx, a, "charged", func(ctx context.Context, foreignKey string) (string, error) {
					return env.Provider.Call(ctx, foreignKey, map[string]int64{"cents": 1250})
				})
				if err != nil {
					return txn.Response{}, err
				}
				// The bug: written through the pool, outside any phase, it
				// commits on its own and runs again on every resume.
				if _, err := env.Pool.Exec(ctx, `INSERT INTO charges VALUES ($1, $2)`, order, charge); err != nil {
					return txn.Response{}, err
				}
				return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
					return txn.JSON(201, map[string]any{"order": order, "charge": charge})
				})
			})
		},
		Setup: createOrders,
		Key:   checkoutKey,
		Check: func(t testing.TB, env *txntest.Env, resp txn.Response) {
			var n int
			require.NoError(t, env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM charges`).Scan(&n))
			require.Equal(t, 1, n, "one charge row")
		},
	})
}

// TestBrokenCallInsideAPhase runs, in a child process of
// TestKitFailsAProviderCallInsideAPhase, a checkout that charges inside
// its first phase's transaction, under the id of the order it inserts.
func TestBrokenCallInsideAPhase(t *testing.T) {
	if !brokenOnly(t) {
		return
	}
	txntest.CrashEveryBoundary(t, txntest.Options{
		Workflow: func(t testing.TB, env *txntest.Env) *txn.Workflow {
			return txn.NewWorkflow("checkout", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
				charge, err := txn.Atomic(ctx, a, "order_charged", func(ctx context.Context, tx pgx.Tx) (string, error) {
					var id int64
					if err := tx.QueryRow(ctx, `INSERT INTO orders (cents) VALUES (1250) RETURNING id`).Scan(&id); err != nil {
						return "", err
					}
					// The bug: a foreign call in a transaction, keyed by an id
					// the transaction drew; a crash before its commit rolls
					// the order back, and production's retry draws a new id.
					return env.Provider.Call(ctx, fmt.Sprintf("order-%d", id), map[string]int64{"cents": 1250})
				})
				if err != nil {
					return txn.Response{}, err
				}
				return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
					return txn.JSON(201, map[string]any{"charge": charge})
				})
			})
		},
		Setup: createOrders,
		Key:   checkoutKey,
		Check: chargedOnce,
	})
}

// runBroken runs a broken-workflow test in a child process, only the runs
// named by boundaries (a -run pattern's second level), and returns its
// verbose output; the test must fail.
func runBroken(t *testing.T, name, boundaries string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+name+"$/^("+boundaries+")$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), envBroken+"="+name, pgtest.EnvURL+"="+pgtest.ServerURL(t))
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "the kit must fail %s:\n%s", name, out)
	require.Equal(t, 1, exit.ExitCode(), "the test fails (exit 1), nothing crashes:\n%s", out)
	return string(out)
}

func requireVerdict(t *testing.T, out, verdict, test string) {
	t.Helper()
	require.Regexp(t, regexp.MustCompile(`(?m)^\s*--- `+verdict+`: `+regexp.QuoteMeta(test)+` `), out,
		"%s must be %s", test, verdict)
}

// A foreign call whose provider key comes from the clock is new on every
// attempt: the kit says so after the two clean runs, and shows the double
// charge where a death after the call makes a retry call again.
func TestKitFailsAForeignKeyBuiltFromTheClock(t *testing.T) {
	t.Parallel()
	const name = "TestBrokenForeignKeyFromTheClock"
	out := runBroken(t, name, "after_call_charged|provider_503_call_1|provider_reply_lost_call_1|before_call_charged|after_commit_order_created")
	require.Contains(t, out, "two clean runs of the same request called the provider under different idempotency keys")
	for _, rec := range []string{"retry", "resumer"} {
		// The call is made again under a new key: a second charge.
		requireVerdict(t, out, "FAIL", name+"/after_call_charged/"+rec)
		requireVerdict(t, out, "FAIL", name+"/provider_reply_lost_call_1/"+rec)
		// No second charge, but a new key where a lost reply would charge twice.
		requireVerdict(t, out, "FAIL", name+"/provider_503_call_1/"+rec)
		// A death before the call: one call.
		requireVerdict(t, out, "PASS", name+"/before_call_charged/"+rec)
		requireVerdict(t, out, "PASS", name+"/after_commit_order_created/"+rec)
	}
	require.Contains(t, out, `the process died just after the foreign call of phase "charged" returned`)
	require.Contains(t, out, "the provider was called under 2 different keys, the clean run under 1")
	require.Contains(t, out, "the provider performed 2 effect(s), the clean run 1")
	require.Contains(t, out, "charged once") // the test's own check
}

// A write made through the pool between phases commits on its own: a death
// after it and before the next commit makes the resume write it again.
func TestKitFailsAnEffectWrittenOutsideAnyPhase(t *testing.T) {
	t.Parallel()
	const name = "TestBrokenEffectOutsideAnyPhase"
	out := runBroken(t, name, "before_commit_finish|after_call_charged|after_commit_finish")
	for _, rec := range []string{"retry", "resumer"} {
		requireVerdict(t, out, "FAIL", name+"/before_commit_finish/"+rec)
		requireVerdict(t, out, "PASS", name+"/after_call_charged/"+rec)
		requireVerdict(t, out, "PASS", name+"/after_commit_finish/"+rec)
	}
	require.Contains(t, out, `the process died just before the commit of the final phase (Finish)`)
	require.Contains(t, out, `table "charges" holds 2 rows, the clean run left 1`)
	require.Contains(t, out, "one charge row") // the test's own check
	require.NotContains(t, out, "two clean runs")
}

// A call to the provider inside a phase's transaction, keyed by an id the
// transaction drew, charges twice in production after a crash before the
// commit (the retry draws another id). The kit rewinds sequences before
// recovering, so the retry reuses the id: it must find the call by where it
// is made.
func TestKitFailsAProviderCallInsideAPhase(t *testing.T) {
	t.Parallel()
	const name = "TestBrokenCallInsideAPhase"
	out := runBroken(t, name, "before_commit_order_charged")
	require.Contains(t, out, "txntest: clean run: env.Provider was called outside the function of any Foreign phase")
	for _, rec := range []string{"retry", "resumer"} {
		requireVerdict(t, out, "FAIL", name+"/before_commit_order_charged/"+rec)
	}
	require.Contains(t, out, `the process died just before the commit of phase "order_charged"`)
	require.Contains(t, out, `(under the keys ["order-1" "order-1"])`)
}
