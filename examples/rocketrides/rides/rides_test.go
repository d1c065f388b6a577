package rides_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/examples/rocketrides/rides"
	"github.com/atomicphase/atomicphase/txn"
	"github.com/atomicphase/atomicphase/txntest"
)

func TestMain(m *testing.M) { txntest.Main(m) }

// providerServer serves the rocketrides payment provider's API (POST
// /charges with an Idempotency-Key) in front of the kit's fake provider: a
// 503 stays a 503, and a lost reply is a connection closed without an
// answer.
func providerServer(t testing.TB, p *txntest.Provider) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			User        string `json:"user"`
			AmountCents int64  `json:"amount_cents"`
		}
		body, err := io.ReadAll(r.Body)
		if err == nil {
			err = json.Unmarshal(body, &req)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		id, err := p.Call(r.Context(), r.Header.Get("Idempotency-Key"), req)
		switch {
		case errors.Is(err, txntest.ErrUnavailable):
			http.Error(w, "unavailable", http.StatusServiceUnavailable)
		case errors.Is(err, txntest.ErrReplyLost):
			conn, _, herr := http.NewResponseController(w).Hijack()
			if herr == nil {
				_ = conn.Close()
			}
		case err != nil:
			http.Error(w, err.Error(), http.StatusInternalServerError)
		default:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			_ = json.NewEncoder(w).Encode(map[string]string{"id": id})
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// The create-ride workflow charges once and answers the same wherever the
// service dies, whether a client retry or the Resumer completes the ride.
func TestCreateRideSurvivesACrashAtEveryBoundary(t *testing.T) {
	ctx := context.Background()
	txntest.CrashEveryBoundary(t, txntest.Options{
		Workflow: func(t testing.TB, env *txntest.Env) *txn.Workflow {
			srv := providerServer(t, env.Provider)
			return rides.NewWorkflow(rides.Provider{URL: srv.URL, Client: srv.Client()}, "")
		},
		Setup: func(t testing.TB, env *txntest.Env) {
			_, err := env.Pool.Exec(ctx, rides.Schema)
			require.NoError(t, err)
		},
		Key: txn.Key{Scope: "rider-1", Value: "ride-1", Method: "POST", Path: "/rides",
			Params: []byte(`{"origin_lat":48.85,"origin_lon":2.35,"target_lat":48.86,"target_lon":2.29}`)},
		Check: func(t testing.TB, env *txntest.Env, resp txn.Response) {
			var created rides.Created
			require.NoError(t, json.Unmarshal(resp.Body, &created))
			effects := env.Provider.Effects(t)
			require.Len(t, effects, 1, "one charge")
			require.Equal(t, effects[0].ID, created.ChargeID, "the answer names the charge")
			var status, chargeID string
			require.NoError(t, env.Pool.QueryRow(ctx, `SELECT status, charge_id FROM rides WHERE id = $1`, created.ID).
				Scan(&status, &chargeID))
			require.Equal(t, "charged", status)
			require.Equal(t, created.ChargeID, chargeID)
			var receipts int
			require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_messages WHERE topic = $1`,
				rides.ReceiptTopic).Scan(&receipts))
			require.Equal(t, 1, receipts, "one receipt staged")
		},
	})
}
