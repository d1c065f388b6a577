// Command orders creates an order exactly once per Idempotency-Key, however
// often its client retries: the README's quickstart, complete.
//
//	DATABASE_URL=postgres://localhost/app go run ./examples/orders
//	curl -i localhost:8080/orders -H 'X-User: alice' -H 'Idempotency-Key: order-1' -d '{"sku":"book","quantity":2}'
package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/txn"
)

func main() {
	if err := run(context.Background()); err != nil {
		slog.Error("orders", "error", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := setUp(ctx, pool); err != nil {
		return err
	}
	runner, err := txn.New(pool, &txn.Config{Logger: slog.Default()})
	if err != nil {
		return err
	}
	http.Handle("POST /orders", createOrder(runner))
	return http.ListenAndServe("localhost:8080", nil)
}

// setUp applies atomicphase's migrations (or run the goose CLI in a deploy
// step) and creates the service's own table.
func setUp(ctx context.Context, pool *pgxpool.Pool) error {
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (
		id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, sku text NOT NULL, quantity int NOT NULL)`)
	return err
}

type order struct {
	ID       int64  `json:"id"`
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
}

func createOrder(runner *txn.Runner) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
		if err != nil {
			http.Error(w, "request body too large or unreadable", http.StatusRequestEntityTooLarge)
			return
		}
		key := txn.Key{
			Scope:  r.Header.Get("X-User"), // the authenticated principal: take it from your authentication
			Value:  r.Header.Get("Idempotency-Key"),
			Method: r.Method, Path: r.URL.Path, Params: body, // the same key with another body is ErrKeyReused
		}
		resp, err := runner.Run(r.Context(), key, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			// May run more than once (after a serialization failure); only
			// one run commits. Write through tx only: calls to other systems
			// belong in a workflow's Foreign phase.
			var o order
			if err := json.Unmarshal(body, &o); err != nil || o.SKU == "" || o.Quantity < 1 {
				// A rejection the client can correct: not stored, no key left.
				return txn.JSON(http.StatusUnprocessableEntity, map[string]string{"error": `want {"sku": "...", "quantity": 1 or more}`})
			}
			err := tx.QueryRow(ctx, `INSERT INTO orders (sku, quantity) VALUES ($1, $2) RETURNING id`, o.SKU, o.Quantity).Scan(&o.ID)
			if err != nil {
				return txn.Response{}, err // rolled back, nothing stored: a retry runs again
			}
			return txn.JSON(http.StatusCreated, o) // stored with the order, replayed to every retry
		})
		if err != nil {
			// The runner has logged what needs logging. Never send err's
			// text to the client: answer its status (or use httpidem, which
			// answers application/problem+json for you).
			var kse *txn.KeyStateError
			if errors.As(err, &kse) && kse.RetryAfter > 0 {
				w.Header().Set("Retry-After", strconv.Itoa(int(kse.RetryAfter.Seconds())))
			}
			status := txn.HTTPStatus(err)
			http.Error(w, http.StatusText(status), status)
			return
		}
		for name, values := range resp.Header {
			w.Header()[name] = values
		}
		if resp.Replayed {
			w.Header().Set("Idempotent-Replayed", "true")
		}
		w.WriteHeader(resp.Status)
		_, _ = w.Write(resp.Body)
	})
}
