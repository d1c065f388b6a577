package migrations_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/txn"
)

// Migration 00004's down would lose the exact params and phase results, so
// it refuses while they hold data, unless the session opts in; with the
// opt-in it keeps what jsonb can hold.
func TestLosslessColumnsDownRefusesToLoseDataWithoutOptIn(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	reg := txn.NewRegistry()
	fail := true
	wf := txn.NewWorkflow("w", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		for _, phase := range []string{"plain", "nul"} {
			if _, err := txn.Foreign(ctx, a, phase, func(context.Context, string) (json.RawMessage, error) {
				if phase == "nul" {
					return json.RawMessage(`{"memo":"\u0000"}`), nil
				}
				return json.RawMessage(`{"ok":true}`), nil
			}); err != nil {
				return txn.Response{}, err
			}
		}
		if fail {
			return txn.Response{}, context.DeadlineExceeded // left running, resumable
		}
		return a.Finish(ctx, func(context.Context, pgx.Tx) (txn.Response, error) { return txn.JSON(201, 1) })
	})
	require.NoError(t, reg.Register(wf))
	r, err := txn.New(d.Pool, &txn.Config{Workflows: reg})
	require.NoError(t, err)
	_, err = r.RunWorkflow(ctx, txn.Key{Value: "k", Method: "POST", Path: "/p", Params: []byte(`{"amount":1E+2}`)}, wf)
	require.ErrorIs(t, err, context.DeadlineExceeded)

	// 00010's down refuses while a key runs (see its own test): opt in.
	optIn := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["atomicphase.allow_data_loss"] = "on" })
	require.NoError(t, migrations.DownTo(ctx, optIn, 9))
	err = migrations.DownTo(ctx, d.Pool, 3)
	require.Error(t, err)
	require.Contains(t, err.Error(), "atomicphase.allow_data_loss")
	var raw []byte
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT request_params_raw FROM idempotency_keys`).Scan(&raw))
	require.Equal(t, `{"amount":1E+2}`, string(raw), "nothing was lost")

	// 00004 predates the guard: of the values the guard accepts, only "on"
	// opts in here, which is why the documentation names that one.
	notOn := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["atomicphase.allow_data_loss"] = "true" })
	require.ErrorContains(t, migrations.DownTo(ctx, notOn, 3), "atomicphase.allow_data_loss")
	require.NotErrorIs(t, migrations.DownTo(ctx, d.Pool, 3), migrations.ErrDataLossRefused, "no AP001 from 00004")

	require.NoError(t, migrations.DownTo(ctx, optIn, 3))
	var params, results string
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT request_params::text, phase_results::text FROM idempotency_keys`).Scan(&params, &results))
	require.Equal(t, `{"amount": 100}`, params, "kept as jsonb holds it")
	require.Equal(t, `{}`, results, "the results object held a NUL, which jsonb cannot hold: dropped")

	require.NoError(t, migrations.Up(ctx, d.Pool))
	fail = false
	resp, err := r.Resume(ctx, "", "k")
	require.NoError(t, err, "a key from before the columns existed resumes from jsonb")
	require.Equal(t, 201, resp.Status)
}

// Migration 00010's down would make a running key derive its foreign keys
// from its id instead of its seed, so that a resumed foreign call would
// reach the provider under a new key: it refuses while a seeded key runs,
// unless the session opts in, and goes once the key finished.
func TestForeignKeySeedDownRefusesWhileAKeyRuns(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	reg := txn.NewRegistry()
	fail := true
	wf := txn.NewWorkflow("w", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Foreign(ctx, a, "charge", func(context.Context, string) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		if fail {
			return txn.Response{}, context.DeadlineExceeded // left running, resumable
		}
		return a.Finish(ctx, func(context.Context, pgx.Tx) (txn.Response, error) { return txn.JSON(201, 1) })
	})
	require.NoError(t, reg.Register(wf))
	r, err := txn.New(d.Pool, &txn.Config{Workflows: reg})
	require.NoError(t, err)
	_, err = r.RunWorkflow(ctx, txn.Key{Value: "k", Method: "POST", Path: "/p"}, wf)
	require.ErrorIs(t, err, context.DeadlineExceeded)

	err = migrations.DownTo(ctx, d.Pool, 9)
	require.ErrorIs(t, err, migrations.ErrDataLossRefused)
	require.ErrorContains(t, err, "atomicphase.allow_data_loss")
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE foreign_key_seed IS NOT NULL`), "the seed is kept")

	fail = false
	_, err = r.Resume(ctx, "", "k")
	require.NoError(t, err)
	require.NoError(t, migrations.DownTo(ctx, d.Pool, 9), "no key runs: nothing to protect")
	require.NoError(t, migrations.Up(ctx, d.Pool))
}
