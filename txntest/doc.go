// Package txntest lets you prove, in your own tests, that your workflows
// take effect exactly once wherever the process running them dies.
//
// [CrashEveryBoundary] runs a registered workflow on a request once to
// learn its boundaries (before and after each commit, before and after each
// foreign call), then kills a child process running it with SIGKILL at each
// boundary in turn and completes the operation both ways a service does: a
// client retry, and the recovery Resumer. Every run must end as the clean
// run did: the same response, one effect at the provider, the same row
// counts, and whatever your Check asserts. [Provider] is the fake payment
// provider (or e-mail service) the workflow calls: it deduplicates by
// idempotency key like a real one, records every call, survives the
// process that called it, and fails calls on request (a 503 before the
// effect; the effect, then a lost reply). [DB] gives a test a migrated
// schema of its own on real PostgreSQL.
//
// A test of a checkout workflow:
//
//	func TestCheckoutChargesOnceWhateverCrashes(t *testing.T) {
//		txntest.CrashEveryBoundary(t, txntest.Options{
//			Workflow: func(t testing.TB, env *txntest.Env) *txn.Workflow {
//				return newCheckout(func(ctx context.Context, key string, cents int64) (string, error) {
//					return env.Provider.Call(ctx, key, map[string]int64{"cents": cents})
//				})
//			},
//			Setup: createOrdersTable, // func(t testing.TB, env *txntest.Env)
//			Key:   txn.Key{Scope: "customer_7", Value: "checkout-1", Method: "POST", Path: "/checkout", Params: []byte(`{}`)},
//			Check: func(t testing.TB, env *txntest.Env, resp txn.Response) {
//				if n := len(env.Provider.Effects(t)); n != 1 {
//					t.Errorf("charged %d times", n)
//				}
//			},
//		})
//	}
//
// Its failures name the boundary and the recovery, say what the process had
// done when it died, and what broke: "the process died just after the
// foreign call of phase "charged" returned (the result in hand, not
// recorded), then it was recovered by a client retry ...: the provider
// performed 2 effect(s), the clean run 1". One boundary can be run on its
// own: go test -run 'TestCheckoutChargesOnceWhateverCrashes/after_call_charged/retry'.
//
// # TestMain
//
// DB and CrashEveryBoundary find a PostgreSQL server once per test binary:
// TEST_DATABASE_URL when set, else a container (testcontainers-go) when a
// Docker engine answers, else a throwaway cluster from the installed server
// binaries. Call [Main] from TestMain so that a container or cluster the
// kit started is stopped when the tests end:
//
//	func TestMain(m *testing.M) { txntest.Main(m) }
//
// CrashEveryBoundary re-executes the test binary to run the calling test in
// a child process; the child runs TestMain and the test function up to the
// call, so keep both free of effects that must not happen twice. The child
// is given the parent's server (TEST_DATABASE_URL), so it never starts one.
package txntest
