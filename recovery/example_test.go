package recovery_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

var errProviderDown = errors.New("payment provider unavailable")

// newChargeWorkflow is a two-phase workflow whose foreign call fails while
// down is set, leaving its key stalled after its first phase.
func newChargeWorkflow(down *atomic.Bool, finished chan<- string) *txn.Workflow {
	return txn.NewWorkflow("charge", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "reserved", func(ctx context.Context, tx pgx.Tx) (bool, error) {
			return true, nil // the business writes of the first phase
		}); err != nil {
			return txn.Response{}, err
		}
		chargeID, err := txn.Foreign(ctx, a, "charged", func(ctx context.Context, foreignKey string) (string, error) {
			if down.Load() {
				return "", errProviderDown
			}
			return "ch_1", nil // the provider, called with foreignKey as its idempotency key
		})
		if err != nil {
			return txn.Response{}, err // transient: the key stays at "reserved"
		}
		resp, err := a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			return txn.JSON(201, map[string]string{"charge": chargeID})
		})
		if err == nil && finished != nil {
			_, key := a.Key()
			finished <- key
		}
		return resp, err
	})
}

// newRunner gives an example a migrated schema of its own and a runner
// whose registry holds wf.
func newRunner(wf *txn.Workflow) (*txn.Runner, func()) {
	db, done := pgtest.Example(true)
	registry := txn.NewRegistry()
	if err := registry.Register(wf); err != nil {
		panic(err)
	}
	runner, err := txn.New(db.Pool, &txn.Config{Workflows: registry})
	if err != nil {
		panic(err)
	}
	return runner, done
}

// RunOnce runs a single round, for a cron job, an admin tool or a test: it
// resumes the stalled key through the same workflow, from its last
// committed phase, and a client retry then replays the stored response.
func ExampleResumer_RunOnce() {
	var down atomic.Bool
	down.Store(true)
	wf := newChargeWorkflow(&down, nil)
	runner, done := newRunner(wf)
	defer done()
	ctx := context.Background()
	key := txn.Key{Scope: "user_1", Value: "charge-1", Method: "POST", Path: "/charges"}

	_, err := runner.RunWorkflow(ctx, key, wf)
	fmt.Println("client's attempt:", err != nil && errors.Is(err, errProviderDown))

	down.Store(false)
	resumer, err := recovery.New(runner, &recovery.Config{
		// A microsecond, so that the key counts as stalled at once. In a
		// service keep it longer than clients' retry window (default 1m).
		ResumeDelay: time.Microsecond,
	})
	if err != nil {
		panic(err)
	}
	report, err := resumer.RunOnce(ctx)
	fmt.Println("resumed:", report.Resumed, "failed:", report.Failed(), "left:", report.Left, err)

	resp, err := runner.RunWorkflow(ctx, key, wf) // the client's retry
	fmt.Println("retry:", resp.Status, string(resp.Body), "replayed:", resp.Replayed, err)
	// Output:
	// client's attempt: true
	// resumed: 1 failed: 0 left: 0 <nil>
	// retry: 201 {"charge":"ch_1"} replayed: true <nil>
}

// A service resumes its own stalled workflows by running a Resumer
// in-process with the runner its request path uses: the same registry, the
// same lease and the same MaxAge. Start runs a round at once, then one
// every Config.Interval, until Stop.
func ExampleResumer_Start() {
	var down atomic.Bool
	down.Store(true)
	finished := make(chan string, 1)
	wf := newChargeWorkflow(&down, finished)
	runner, done := newRunner(wf)
	defer done()
	ctx := context.Background()

	// The request path: a client's attempt that stops after its first phase.
	_, err := runner.RunWorkflow(ctx, txn.Key{Scope: "user_1", Value: "charge-2", Method: "POST", Path: "/charges"}, wf)
	fmt.Println("client's attempt:", errors.Is(err, errProviderDown))
	down.Store(false)

	resumer, err := recovery.New(runner, &recovery.Config{ResumeDelay: time.Microsecond}) // see RunOnce's example
	if err != nil {
		panic(err)
	}
	if err := resumer.Start(ctx); err != nil {
		panic(err)
	}
	defer resumer.Stop()
	select {
	case key := <-finished:
		fmt.Println("resumed in the background:", key)
	case <-time.After(time.Minute):
		fmt.Println("not resumed")
	}
	// Output:
	// client's attempt: true
	// resumed in the background: charge-2
}
