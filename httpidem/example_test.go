package httpidem_test

import (
	"context"
	"errors"
	"net/http"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/txn"
)

func ExampleMiddleware_Wrap() {
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
	idem, err := httpidem.New(runner, &httpidem.Config{
		// The authenticated principal owns the key.
		Scope: func(r *http.Request) (string, error) {
			user, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if !ok {
				return "", errors.New("unauthenticated")
			}
			return user, nil
		},
	})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", idem.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := httpidem.Tx(r.Context()) // commits with the key and the stored response
		if _, err := tx.Exec(r.Context(), `INSERT INTO orders (sku) VALUES ('book-1')`); err != nil {
			http.Error(w, "storage failure", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"status":"created"}`))
	})))
	_ = http.ListenAndServe("127.0.0.1:8080", mux)
}
