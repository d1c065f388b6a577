// Command provider is a small payment provider for the rocketrides example:
// a separate HTTP server, idempotent on the Idempotency-Key it is given (the
// same key returns the same charge, however often it is sent), keeping its
// charges in its own table, with fault injection to exercise the service's
// retries: an error rate, added latency, and "charge then drop the
// connection", the ambiguous case where the charge happened but the caller
// never hears so.
//
//	go run ./examples/rocketrides/provider -addr 127.0.0.1:8091 -database-url "$DATABASE_URL"
//
// POST /charges   {"user":"u1","amount_cents":1250} with Idempotency-Key
//
//	→ 201 {"id":"ch_…","user":"u1","amount_cents":1250}, or 402 for users
//	  named declined-*; the same key always gives the same answer.
//
// GET /charges?user=u1 lists a user's charges, for audit.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

type faults struct {
	errorRate float64       // share of requests answered 503 before doing anything
	dropRate  float64       // share of charges made and then answered by a dropped connection
	latency   time.Duration // added to every request, up to this much (uniform)
}

func run(args []string) int {
	fs := flag.NewFlagSet("provider", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:8091", "listen address")
	dbURL := fs.String("database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL (env DATABASE_URL)")
	var f faults
	fs.Float64Var(&f.errorRate, "error-rate", 0, "share of requests failed with 503 before charging (0-1)")
	fs.Float64Var(&f.dropRate, "drop-rate", 0, "share of charges made and then answered by dropping the connection (0-1)")
	fs.DurationVar(&f.latency, "latency", 0, "added latency per request, uniform in [0, latency]")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if *dbURL == "" {
		logger.Error("provider: -database-url or DATABASE_URL is required")
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	pool, err := pgxpool.New(ctx, *dbURL)
	if err != nil {
		logger.Error("provider: connect", "error", err)
		return 1
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, schema); err != nil {
		logger.Error("provider: schema", "error", err)
		return 1
	}
	srv := &http.Server{Addr: *addr, Handler: newHandler(pool, f, logger), ReadHeaderTimeout: 5 * time.Second}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		logger.Error("provider: listen", "error", err)
		return 1
	}
	logger.Info("provider listening", "addr", ln.Addr().String(), "error_rate", f.errorRate, "drop_rate", f.dropRate, "latency", f.latency.String())
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		logger.Error("provider: serve", "error", err)
		return 1
	}
	return 0
}

const schema = `
CREATE TABLE IF NOT EXISTS provider_charges (
	id              text PRIMARY KEY,
	idempotency_key text NOT NULL UNIQUE,
	user_id         text NOT NULL,
	amount_cents    bigint NOT NULL,
	status          text NOT NULL,
	created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS provider_charges_user_idx ON provider_charges (user_id);`

type charge struct {
	ID          string `json:"id"`
	User        string `json:"user"`
	AmountCents int64  `json:"amount_cents"`
	Status      string `json:"status"`
}

func newHandler(pool *pgxpool.Pool, f faults, logger *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		if f.latency > 0 {
			time.Sleep(rand.N(f.latency))
		}
		if f.errorRate > 0 && rand.Float64() < f.errorRate {
			http.Error(w, `{"error":"temporarily_unavailable"}`, http.StatusServiceUnavailable)
			return
		}
		key := r.Header.Get("Idempotency-Key")
		var in struct {
			User        string `json:"user"`
			AmountCents int64  `json:"amount_cents"`
		}
		if key == "" || json.NewDecoder(r.Body).Decode(&in) != nil || in.User == "" || in.AmountCents <= 0 {
			http.Error(w, `{"error":"invalid_request"}`, http.StatusBadRequest)
			return
		}
		status := "succeeded"
		if strings.HasPrefix(in.User, "declined-") {
			status = "declined"
		}
		// Idempotent on the key: the first request decides, later ones read it.
		c := charge{ID: "ch_" + randomID(), User: in.User, AmountCents: in.AmountCents, Status: status}
		var err error
		// A concurrent first request with the same key may commit after this
		// statement's snapshot: then neither branch sees a row; look again.
		for range 3 {
			err = pool.QueryRow(r.Context(), `
			WITH ins AS (
				INSERT INTO provider_charges (id, idempotency_key, user_id, amount_cents, status)
				VALUES ($1, $2, $3, $4, $5) ON CONFLICT (idempotency_key) DO NOTHING
				RETURNING id, user_id, amount_cents, status)
			SELECT id, user_id, amount_cents, status FROM ins
			UNION ALL
			SELECT id, user_id, amount_cents, status FROM provider_charges WHERE idempotency_key = $2
			LIMIT 1`, c.ID, key, c.User, c.AmountCents, c.Status).Scan(&c.ID, &c.User, &c.AmountCents, &c.Status)
			if !errors.Is(err, pgx.ErrNoRows) {
				break
			}
		}
		if err != nil {
			logger.Error("charge failed", "error", err)
			http.Error(w, `{"error":"internal"}`, http.StatusInternalServerError)
			return
		}
		if f.dropRate > 0 && rand.Float64() < f.dropRate {
			// The ambiguous case: charged, but the caller never hears so.
			if hj, ok := w.(http.Hijacker); ok {
				if conn, _, err := hj.Hijack(); err == nil {
					_ = conn.Close()
					return
				}
			}
		}
		w.Header().Set("Content-Type", "application/json")
		if c.Status == "declined" {
			w.WriteHeader(http.StatusPaymentRequired)
			_ = json.NewEncoder(w).Encode(map[string]string{"error": "card_declined"})
			return
		}
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(c)
	})
	mux.HandleFunc("GET /charges", func(w http.ResponseWriter, r *http.Request) {
		rows, err := pool.Query(r.Context(), `SELECT id, user_id, amount_cents, status FROM provider_charges
			WHERE ($1 = '' OR user_id = $1) ORDER BY created_at, id`, r.URL.Query().Get("user"))
		if err != nil {
			http.Error(w, `{"error":"internal"}`, http.StatusInternalServerError)
			return
		}
		list, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (charge, error) {
			var c charge
			err := row.Scan(&c.ID, &c.User, &c.AmountCents, &c.Status)
			return c, err
		})
		if err != nil {
			http.Error(w, `{"error":"internal"}`, http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"charges": list})
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	return mux
}

func randomID() string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 16)
	for i := range b {
		b[i] = alphabet[rand.N(len(alphabet))]
	}
	return string(b)
}
