// Package rides is the rocketrides example's ride-hailing payment flow, built
// only on atomicphase's public packages: a ride is created (atomic phase),
// the card is charged at the payment provider with a derived idempotency key
// (foreign phase), then the charge is recorded and a receipt staged in the
// outbox (final atomic phase). The service binary, its reaper and the demo
// share it.
package rides

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/txn"
)

// WorkflowName is the name create-ride keys are stored under.
const WorkflowName = "create_ride"

// ReceiptTopic is the outbox topic of ride receipts.
const ReceiptTopic = "ride.receipt"

// Schema creates the service's own table.
const Schema = `
CREATE TABLE IF NOT EXISTS rides (
	id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	user_id      text NOT NULL,
	origin_lat   double precision NOT NULL,
	origin_lon   double precision NOT NULL,
	target_lat   double precision NOT NULL,
	target_lon   double precision NOT NULL,
	amount_cents bigint NOT NULL,
	status       text NOT NULL DEFAULT 'created',
	charge_id    text,
	created_at   timestamptz NOT NULL DEFAULT now()
)`

// Request is the body of POST /rides.
type Request struct {
	OriginLat *float64 `json:"origin_lat"`
	OriginLon *float64 `json:"origin_lon"`
	TargetLat *float64 `json:"target_lat"`
	TargetLon *float64 `json:"target_lon"`
}

func (r Request) validate() error {
	for name, v := range map[string]*float64{"origin_lat": r.OriginLat, "target_lat": r.TargetLat} {
		if v == nil || *v < -90 || *v > 90 {
			return fmt.Errorf("%s must be a latitude", name)
		}
	}
	for name, v := range map[string]*float64{"origin_lon": r.OriginLon, "target_lon": r.TargetLon} {
		if v == nil || *v < -180 || *v > 180 {
			return fmt.Errorf("%s must be a longitude", name)
		}
	}
	return nil
}

// Created is the 201 answer of POST /rides.
type Created struct {
	ID          int64  `json:"id"`
	ChargeID    string `json:"charge_id"`
	AmountCents int64  `json:"amount_cents"`
}

// Receipt is the payload of a ride.receipt message.
type Receipt struct {
	RideID      int64  `json:"ride_id"`
	User        string `json:"user"`
	ChargeID    string `json:"charge_id"`
	AmountCents int64  `json:"amount_cents"`
}

// Price is €5 plus €1 per kilometre, in cents.
func Price(r Request) int64 {
	const earthKm = 6371.0
	rad := func(d float64) float64 { return d * math.Pi / 180 }
	dLat, dLon := rad(*r.TargetLat-*r.OriginLat), rad(*r.TargetLon-*r.OriginLon)
	a := math.Sin(dLat/2)*math.Sin(dLat/2) + math.Cos(rad(*r.OriginLat))*math.Cos(rad(*r.TargetLat))*math.Sin(dLon/2)*math.Sin(dLon/2)
	km := 2 * earthKm * math.Asin(math.Sqrt(a))
	return 500 + int64(math.Round(km*100))
}

// ErrDeclined is the provider's definitive "no" for a card.
var ErrDeclined = errors.New("rides: card declined")

// Provider charges cards at the payment provider over HTTP.
type Provider struct {
	URL    string
	Client *http.Client
}

// Charge asks the provider to charge user, idempotently on key. A 402 is
// ErrDeclined; anything else that is not a 201 is a transient error.
func (p Provider) Charge(ctx context.Context, key, user string, amountCents int64) (string, error) {
	body, _ := json.Marshal(map[string]any{"user": user, "amount_cents": amountCents})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.URL+"/charges", bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := p.Client.Do(req)
	if err != nil {
		return "", fmt.Errorf("rides: provider: %w", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	switch resp.StatusCode {
	case http.StatusCreated:
		var c struct {
			ID string `json:"id"`
		}
		if err := json.Unmarshal(b, &c); err != nil || c.ID == "" {
			return "", fmt.Errorf("rides: provider: bad answer %q", b)
		}
		return c.ID, nil
	case http.StatusPaymentRequired:
		return "", ErrDeclined
	default:
		return "", fmt.Errorf("rides: provider: status %d", resp.StatusCode)
	}
}

// NewWorkflow returns the create-ride workflow charging through p.
// crashAfter, when not empty, names a phase after which the process kills
// itself with SIGKILL (once the phase returned: an Atomic phase committed,
// a Foreign phase's result in hand, recorded by the next commit): fault
// injection for tests and the demo, never set in production.
func NewWorkflow(p Provider, crashAfter string) *txn.Workflow {
	crash := func(phase string) {
		if phase == crashAfter {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	}
	type ride struct {
		ID          int64 `json:"id"`
		AmountCents int64 `json:"amount_cents"`
	}
	return txn.NewWorkflow(WorkflowName, func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		user, _ := a.Key()
		var in Request
		if err := json.Unmarshal(a.Params(), &in); err != nil || in.validate() != nil {
			// Validated before the key was created; a stored request that
			// no longer parses is a bug, answered and stored as such.
			return txn.JSON(http.StatusUnprocessableEntity, map[string]string{"error": "invalid stored request"})
		}
		r, err := txn.Atomic(ctx, a, "ride_created", func(ctx context.Context, tx pgx.Tx) (ride, error) {
			r := ride{AmountCents: Price(in)}
			err := tx.QueryRow(ctx, `INSERT INTO rides (user_id, origin_lat, origin_lon, target_lat, target_lon, amount_cents)
				VALUES ($1, $2, $3, $4, $5, $6) RETURNING id`,
				user, *in.OriginLat, *in.OriginLon, *in.TargetLat, *in.TargetLon, r.AmountCents).Scan(&r.ID)
			return r, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		crash("ride_created")
		chargeID, err := txn.Foreign(ctx, a, "charge_created", func(ctx context.Context, foreignKey string) (string, error) {
			return p.Charge(ctx, foreignKey, user, r.AmountCents)
		})
		if errors.Is(err, ErrDeclined) {
			return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				if _, err := tx.Exec(ctx, `UPDATE rides SET status = 'declined' WHERE id = $1`, r.ID); err != nil {
					return txn.Response{}, err
				}
				return txn.JSON(http.StatusPaymentRequired, map[string]any{"error": "card_declined", "ride_id": r.ID})
			})
		}
		if err != nil {
			return txn.Response{}, err // transient: the key stays resumable at ride_created
		}
		crash("charge_created")
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `UPDATE rides SET status = 'charged', charge_id = $1 WHERE id = $2`, chargeID, r.ID); err != nil {
				return txn.Response{}, err
			}
			payload, _ := json.Marshal(Receipt{RideID: r.ID, User: user, ChargeID: chargeID, AmountCents: r.AmountCents})
			if err := outbox.Enqueue(ctx, tx, outbox.Message{
				Topic: ReceiptTopic, OrderingKey: "user:" + user, Payload: payload,
				Headers: map[string]string{"Content-Type": "application/json"},
			}); err != nil {
				return txn.Response{}, err
			}
			resp, err := txn.JSON(http.StatusCreated, Created{ID: r.ID, ChargeID: chargeID, AmountCents: r.AmountCents})
			resp.Header.Set("Location", "/rides/"+strconv.FormatInt(r.ID, 10))
			return resp, err
		})
	})
}

// Handler serves POST /rides (under the idempotency middleware), GET
// /rides/{id} and GET /healthz.
func Handler(pool *pgxpool.Pool, mw *httpidem.Middleware, wf *txn.Workflow) http.Handler {
	mux := http.NewServeMux()
	create := mw.Workflow(wf)
	mux.HandleFunc("POST /rides", func(w http.ResponseWriter, r *http.Request) {
		// Validate before anything is stored: an invalid body is a 400
		// the client can correct and retry with the same key.
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<16))
		var in Request
		if err == nil {
			err = json.Unmarshal(body, &in)
		}
		if err == nil {
			err = in.validate()
		}
		if err != nil {
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusBadRequest)
			_ = json.NewEncoder(w).Encode(map[string]any{"type": "urn:rocketrides:problem:invalid-ride",
				"title": "Invalid ride", "status": 400, "detail": err.Error()})
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		create.ServeHTTP(w, r)
	})
	mux.HandleFunc("GET /rides/{id}", func(w http.ResponseWriter, r *http.Request) {
		id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
		if err != nil {
			http.NotFound(w, r)
			return
		}
		var out struct {
			ID          int64     `json:"id"`
			User        string    `json:"user"`
			AmountCents int64     `json:"amount_cents"`
			Status      string    `json:"status"`
			ChargeID    *string   `json:"charge_id"`
			CreatedAt   time.Time `json:"created_at"`
		}
		err = pool.QueryRow(r.Context(), `SELECT id, user_id, amount_cents, status, charge_id, created_at FROM rides WHERE id = $1`, id).
			Scan(&out.ID, &out.User, &out.AmountCents, &out.Status, &out.ChargeID, &out.CreatedAt)
		if errors.Is(err, pgx.ErrNoRows) {
			http.NotFound(w, r)
			return
		}
		if err != nil {
			http.Error(w, "internal error", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(out)
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		if err := pool.Ping(r.Context()); err != nil {
			http.Error(w, "database unavailable", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})
	return mux
}
