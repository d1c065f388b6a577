package txn_test

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

// Every pgx query exec mode works (DESIGN rule 15): in exec and simple
// protocol modes parameters go as text without type OIDs, so jsonb must be
// bound as text and bytea as bytes. Each mode runs a single-phase key with
// stored headers, a workflow whose foreign result jsonb cannot hold through
// a resume, and a key failed for its age.
func TestEveryQueryExecModeStoresResumesAndFailsKeys(t *testing.T) {
	t.Parallel()
	modes := map[string]pgx.QueryExecMode{
		"cache_statement": pgx.QueryExecModeCacheStatement,
		"cache_describe":  pgx.QueryExecModeCacheDescribe,
		"describe_exec":   pgx.QueryExecModeDescribeExec,
		"exec":            pgx.QueryExecModeExec,
		"simple_protocol": pgx.QueryExecModeSimpleProtocol,
	}
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			pool := e.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
			require.NoError(t, err)

			resp, err := r.Run(ctx, chargeKey("single", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				return txn.Response{Status: 201, Header: http.Header{"Location": {"/c/1"}}, Body: []byte("{}")}, nil
			})
			require.NoError(t, err)
			replay, err := r.Run(ctx, chargeKey("single", 1), nil2xx)
			require.NoError(t, err)
			require.True(t, replay.Replayed)
			require.Equal(t, resp.Header, replay.Header)

			var fail = true
			wf := txn.NewWorkflow("mode", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
				got, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (json.RawMessage, error) {
					return json.RawMessage(`{"memo":"\u0000","n":1e400000}`), nil
				})
				if err != nil {
					return txn.Response{}, err
				}
				if fail {
					return txn.Response{}, errInjected
				}
				return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
					return txn.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: got}, nil
				})
			})
			require.NoError(t, e.reg.Register(wf))
			_, err = r.RunWorkflow(ctx, rideKey("wf"), wf)
			require.ErrorIs(t, err, errInjected)
			fail = false
			resp, err = r.Resume(ctx, "user_1", "wf")
			require.NoError(t, err)
			require.Equal(t, `{"memo":"\u0000","n":1e400000}`, string(resp.Body))

			_, err = r.RunWorkflow(ctx, rideKey("old"), wf)
			require.NoError(t, err, "fail is false: finishes")
			_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET status = 'running', finished_at = NULL,
				response_status = NULL, response_headers = NULL, response_body = NULL,
				created_at = now() - interval '13 hours' WHERE key = 'old'`)
			require.NoError(t, err)
			resp, err = r.RunWorkflow(ctx, rideKey("old"), wf)
			require.NoError(t, err)
			require.Equal(t, 500, resp.Status)
			require.Equal(t, "application/problem+json", resp.Header.Get("Content-Type"))
		})
	}
}

func nil2xx(context.Context, pgx.Tx) (txn.Response, error) { return txn.Response{Status: 204}, nil }
