package txn_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

// validatingFlow is a workflow that validates its params before any phase
// (400 when amount is not positive), then runs an atomic phase, a foreign
// call and the final phase. reject makes it answer 422 at a chosen point.
type validatingFlow struct {
	wf      *txn.Workflow
	reject  atomic.Value // "", "after_phase", "after_foreign_error", "in_finish"
	foreign atomic.Int64
}

func newValidatingFlow(t *testing.T, reg *txn.Registry) *validatingFlow {
	t.Helper()
	f := &validatingFlow{}
	f.reject.Store("")
	f.wf = txn.NewWorkflow("validating", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		var in struct {
			Amount int `json:"amount"`
		}
		if err := jsonUnmarshal(a.Params(), &in); err != nil || in.Amount <= 0 {
			return txn.JSON(400, map[string]string{"error": "amount must be positive"})
		}
		if f.reject.Load() == "after_foreign_error" {
			_, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (string, error) {
				f.foreign.Add(1)
				return "", errDeclined // the provider may have acted before failing
			})
			if errors.Is(err, errDeclined) {
				return txn.JSON(422, map[string]string{"error": "card rejected"})
			}
			return txn.Response{}, err
		}
		id, err := txn.Atomic(ctx, a, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO charges (ref, amount) VALUES ('reserve', $1) RETURNING id`, in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		if f.reject.Load() == "after_phase" {
			return txn.JSON(422, map[string]any{"error": "too late", "id": id})
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			return txn.JSON(201, map[string]any{"id": id})
		})
	})
	require.NoError(t, reg.Register(f.wf))
	return f
}

func amountKey(value, params string) txn.Key {
	return txn.Key{Scope: "user_1", Value: value, Method: "POST", Path: "/charges", Params: []byte(params)}
}

// A rejection a client is expected to correct (txn.DefaultStore), given
// before anything took effect, leaves no key: the corrected request runs
// under the same key. The same policy as a single-phase run.
func TestWorkflowRejectionBeforeAnyPhaseLeavesNoKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newValidatingFlow(t, e.reg)

	resp, err := e.runner.RunWorkflow(ctx, amountKey("k1", `{"amount":0}`), f.wf)
	require.NoError(t, err)
	require.Equal(t, 400, resp.Status)
	require.False(t, resp.Replayed)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`), "no key left")
	require.Equal(t, uint64(1), e.runner.Stats().NotStored)

	resp, err = e.runner.RunWorkflow(ctx, amountKey("k1", `{"amount":5}`), f.wf)
	require.NoError(t, err, "the corrected request is not ErrKeyReused")
	require.Equal(t, 201, resp.Status)
	replay, err := e.runner.RunWorkflow(ctx, amountKey("k1", `{"amount":5}`), f.wf)
	require.NoError(t, err)
	require.True(t, replay.Replayed)

	// Single phase: the same policy, and the function's writes roll back.
	resp, err = e.runner.Run(ctx, chargeKey("s1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('rejected', 1)`); err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(422, "unprocessable")
	})
	require.NoError(t, err)
	require.Equal(t, 422, resp.Status)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 's1'`))
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'rejected'`))
}

// A rejection from the final phase before anything took effect rolls back
// that phase's writes too, and leaves no key.
func TestFinishRejectionBeforeAnyPhaseRollsBackAndLeavesNoKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	wf := txn.NewWorkflow("finish_only", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('finish', 1)`); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(409, "out of stock")
		})
	})
	require.NoError(t, e.reg.Register(wf))
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, 409, resp.Status)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges`))
}

// Once something took effect (a phase committed, or a foreign call was
// made), every answer is stored, rejections included.
func TestWorkflowRejectionAfterSomethingTookEffectIsStored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newValidatingFlow(t, e.reg)
	for _, point := range []string{"after_phase", "after_foreign_error"} {
		f.reject.Store(point)
		resp, err := e.runner.RunWorkflow(ctx, amountKey(point, `{"amount":5}`), f.wf)
		require.NoError(t, err, point)
		require.Equal(t, 422, resp.Status, point)
		k := readKey(t, e.Pool, "user_1", point)
		require.Equal(t, "finished", k.Status, point)
		require.Equal(t, 422, *k.RespStatus, point)
		replay, err := e.runner.RunWorkflow(ctx, amountKey(point, `{"amount":5}`), f.wf)
		require.NoError(t, err, point)
		require.True(t, replay.Replayed, point)
		require.Equal(t, resp.Body, replay.Body, point)
	}
	require.Equal(t, int64(1), f.foreign.Load())
}

// An attempt that took over a key (a crash or transient error before) does
// not know whether an earlier one called the provider without recording
// it, so it stores even an early rejection rather than forget the key.
func TestRejectionByAnAttemptThatTookTheKeyOverIsStored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{Store: func(status int) bool { return status != 418 }})
	ctx := ctxT(t)
	var runs atomic.Int64
	wf := txn.NewWorkflow("flaky_then_rejects", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if runs.Add(1) == 1 {
			return txn.Response{}, errInjected
		}
		return txn.Response{Status: 418}, nil
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, errInjected)
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, 418, resp.Status)
	require.Equal(t, "finished", readKey(t, e.Pool, "user_1", "k1").Status)

	// Config.Store is the policy: 418 is not stored by a first attempt.
	resp, err = e.runner.RunWorkflow(ctx, rideKey("k2"), wf)
	require.NoError(t, err)
	require.Equal(t, 418, resp.Status)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'k2'`))
}

// Concurrent attempts on one key, some with a rejected body and some with
// the corrected one: a rejection never removes a key another attempt
// created or took effect under, the corrected operation runs exactly once,
// and its response is the one every later retry gets.
func TestConcurrentRejectionsAndCorrectedRequestsOnOneKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newValidatingFlow(t, e.reg)
	var mu sync.Mutex
	outcomes := map[string]int{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 40 {
		wg.Go(func() {
			<-start
			params := `{"amount":5}`
			if i%2 == 0 {
				params = `{"amount":0}`
			}
			resp, err := e.runner.RunWorkflow(ctx, amountKey("k", params), f.wf)
			var out string
			switch {
			case errors.Is(err, txn.ErrKeyInUse):
				out = "in_use"
			case errors.Is(err, txn.ErrKeyReused):
				out = "reused"
			case err != nil:
				out = "error: " + err.Error()
			case resp.Replayed:
				out = "replayed " + strconv.Itoa(resp.Status)
			default:
				out = strconv.Itoa(resp.Status)
			}
			mu.Lock()
			outcomes[out]++
			mu.Unlock()
		})
	}
	close(start)
	wg.Wait()
	t.Logf("outcomes: %v", outcomes)
	for out := range outcomes {
		require.NotContains(t, out, "error", "no attempt failed")
	}
	require.LessOrEqual(t, outcomes["201"], 1, "the operation ran at most once")
	require.LessOrEqual(t, e.Count(t, `SELECT count(*) FROM charges`), 1)
	resp, err := e.runner.RunWorkflow(ctx, amountKey("k", `{"amount":5}`), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`), "exactly one reservation in the end")
	require.Equal(t, "finished", readKey(t, e.Pool, "user_1", "k").Status)
}
