package txn_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/txnhook"
	"github.com/atomicphase/atomicphase/txn"
)

// seenAt is a boundary with what another connection saw of the key there.
type seenAt struct {
	txnhook.Event
	state string // the key's committed recovery point and status; "" before the key exists
}

// watch installs a hook on the env's runner that records each boundary and
// the key's committed recovery point and status, read on another connection.
func watch(t *testing.T, e *env) *[]seenAt {
	var seen []seenAt
	txnhook.Install(e.runner, func(ev txnhook.Event) {
		var state string
		err := e.Pool.QueryRow(context.Background(), `SELECT recovery_point || ' ' || status FROM idempotency_keys`).Scan(&state)
		if !errors.Is(err, pgx.ErrNoRows) {
			require.NoError(t, err)
		}
		seen = append(seen, seenAt{ev, state})
	})
	return &seen
}

// The test kit crashes a process at these boundaries: each commit is
// reported before it (nothing of it visible yet) and after it (visible),
// and each foreign call before and after, with the key it is given.
func TestHookReportsEachCommitFromBothSidesAndEachForeignCall(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	seen := watch(t, e)
	var given string
	wf := txn.NewWorkflow("hooked", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "reserved", func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		if _, err := txn.Foreign(ctx, a, "charged", func(ctx context.Context, fk string) (string, error) {
			given = fk
			return "ch_1", nil
		}); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, "ok") })
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctxT(t), chargeKey("hooked-1", 1), wf)
	require.NoError(t, err)

	// Two commits: the key goes in with the first phase, and the foreign
	// result with the final one.
	require.Equal(t, []seenAt{
		ev(txnhook.BeforeCommit, txnhook.CommitPhase, "reserved", "", ""),
		ev(txnhook.AfterCommit, txnhook.CommitPhase, "reserved", "", "reserved running"),
		ev(txnhook.BeforeCall, 0, "charged", given, "reserved running"),
		ev(txnhook.AfterCall, 0, "charged", given, "reserved running"),
		ev(txnhook.BeforeCommit, txnhook.CommitResponse, "", "", "reserved running"),
		ev(txnhook.AfterCommit, txnhook.CommitResponse, "", "", "finished finished"),
	}, *seen)
	require.NotEmpty(t, given)
	require.Equal(t, `{"reserved":1,"charged":"ch_1"}`, storedResults(t, e, "hooked-1"))
}

// ev is a boundary of a first attempt, with the key's state seen there.
func ev(p txnhook.Point, c txnhook.Commit, phase, fk, state string) seenAt {
	return seenAt{txnhook.Event{Point: p, Commit: c, Phase: phase, Attempt: 1, ForeignKey: fk}, state}
}

// storedResults returns a key's stored phase results, as their bytes.
func storedResults(t *testing.T, e *env, key string) string {
	t.Helper()
	var raw []byte
	require.NoError(t, e.Pool.QueryRow(context.Background(),
		`SELECT phase_results_raw FROM idempotency_keys WHERE key = $1`, key).Scan(&raw))
	return string(raw)
}

// A Foreign phase that comes first must hold the lease before it calls
// out: the key commits on its own first.
func TestHookReportsTheKeysOwnCommitBeforeAForeignPhaseThatComesFirst(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	seen := watch(t, e)
	var given string
	wf := txn.NewWorkflow("charge_first", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Foreign(ctx, a, "charged", func(ctx context.Context, fk string) (string, error) {
			given = fk
			return "ch_1", nil
		}); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, "ok") })
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctxT(t), chargeKey("first-1", 1), wf)
	require.NoError(t, err)

	require.Equal(t, []seenAt{
		ev(txnhook.BeforeCommit, txnhook.CommitKey, "", "", ""),
		ev(txnhook.AfterCommit, txnhook.CommitKey, "", "", "started running"),
		ev(txnhook.BeforeCall, 0, "charged", given, "started running"),
		ev(txnhook.AfterCall, 0, "charged", given, "started running"),
		ev(txnhook.BeforeCommit, txnhook.CommitResponse, "", "", "started running"),
		ev(txnhook.AfterCommit, txnhook.CommitResponse, "", "", "finished finished"),
	}, *seen)
	require.Equal(t, `{"charged":"ch_1"}`, storedResults(t, e, "first-1"))
}

// A terminal response returned without Finish (a declined card) commits on
// its own, after the phase the workflow stopped at.
func TestHookReportsAResponseStoredWithoutFinish(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	seen := watch(t, e)
	wf := txn.NewWorkflow("declined", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "reserved", func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(402, "declined")
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctxT(t), chargeKey("declined-1", 1), wf)
	require.NoError(t, err)
	last := (*seen)[len(*seen)-2:]
	require.Equal(t, []seenAt{
		{txnhook.Event{Point: txnhook.BeforeCommit, Commit: txnhook.CommitResponse, Phase: "reserved", Attempt: 1}, "reserved running"},
		{txnhook.Event{Point: txnhook.AfterCommit, Commit: txnhook.CommitResponse, Phase: "reserved", Attempt: 1}, "reserved finished"},
	}, last)
}
