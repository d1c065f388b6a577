package txn_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/txn"
)

// A single-phase endpoint: the key, the order and the response commit together.
func ExampleRunner_Run() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	runner, err := txn.New(pool, nil)
	if err != nil {
		panic(err)
	}

	key := txn.Key{
		Scope:  "account_42",       // the authenticated principal
		Value:  "0f8c2b7e-order-1", // the client's Idempotency-Key
		Method: http.MethodPost, Path: "/orders",
		Params: []byte(`{"sku":"book-1","quantity":2}`),
	}
	resp, err := runner.Run(ctx, key, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO orders (sku, quantity) VALUES ('book-1', 2) RETURNING id`).Scan(&id); err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(http.StatusCreated, map[string]int64{"id": id})
	})
	switch {
	case err != nil:
		fmt.Println("answer", txn.HTTPStatus(err), err)
	default:
		fmt.Println(resp.Status, string(resp.Body), "replayed:", resp.Replayed)
	}
}

var errDeclinedCard = errors.New("card declined")

// A multi-phase workflow: create the ride, charge the card at the provider
// with a derived idempotency key, then record the charge and answer.
func ExampleNewWorkflow() {
	type ride struct {
		ID          int64 `json:"id"`
		AmountCents int64 `json:"amount_cents"`
	}
	createRide := txn.NewWorkflow("create_ride", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		r, err := txn.Atomic(ctx, a, "ride_created", func(ctx context.Context, tx pgx.Tx) (ride, error) {
			var r ride
			err := tx.QueryRow(ctx, `INSERT INTO rides (amount_cents) VALUES (1250) RETURNING id, amount_cents`).Scan(&r.ID, &r.AmountCents)
			return r, err
		})
		if err != nil {
			return txn.Response{}, err // transient: the key is released and resumable
		}
		chargeID, err := txn.Foreign(ctx, a, "charge_created", func(ctx context.Context, foreignKey string) (string, error) {
			return chargeCard(ctx, foreignKey, r.AmountCents) // the provider deduplicates on foreignKey
		})
		if errors.Is(err, errDeclinedCard) {
			return txn.JSON(http.StatusPaymentRequired, map[string]string{"error": "card_declined"}) // terminal: stored
		}
		if err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `UPDATE rides SET charge_id = $1 WHERE id = $2`, chargeID, r.ID); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(http.StatusCreated, r)
		})
	})

	registry := txn.NewRegistry()
	if err := registry.Register(createRide); err != nil {
		panic(err)
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	runner, err := txn.New(pool, &txn.Config{Workflows: registry})
	if err != nil {
		panic(err)
	}
	resp, err := runner.RunWorkflow(ctx, txn.Key{Scope: "user_7", Value: "ride-123", Method: "POST", Path: "/rides"}, createRide)
	fmt.Println(resp.Status, err)
}

func chargeCard(context.Context, string, int64) (string, error) { return "ch_1", nil }

// MaxAge bounds how late a foreign call may be repeated, so it must stay
// under the payment providers' 24-hour idempotency window: New rejects
// longer values.
func ExampleNew_maxAgeLimit() {
	pool, err := pgxpool.New(context.Background(), "postgres://localhost/none") // connects lazily
	if err != nil {
		return
	}
	defer pool.Close()
	_, err = txn.New(pool, &txn.Config{MaxAge: 36 * time.Hour})
	fmt.Println(err)
	// Output:
	// txn: new: invalid config: MaxAge 36h0m0s must be shorter than 24h0m0s, the payment providers' idempotency window
}
