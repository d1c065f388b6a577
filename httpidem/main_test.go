package httpidem_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type server struct {
	*pgtest.DB
	url   string
	calls atomic.Int64
	held  atomic.Int64  // handlers whose insert (and so the key's) went out
	block chan struct{} // when set, handlers wait on it after their insert
	reg   *txn.Registry
}

// newServer serves POST /orders (single phase, writes an order), and
// POST /rides (a workflow), authenticated by "Authorization: Bearer <user>".
func newServer(t *testing.T, cfg *httpidem.Config) *server {
	t.Helper()
	return newServerOn(t, cfg, nil)
}

// newServerOn is newServer with the runner on pool(d) when pool is not nil.
func newServerOn(t *testing.T, cfg *httpidem.Config, pool func(*pgtest.DB) *pgxpool.Pool) *server {
	t.Helper()
	d := pgtest.New(t)
	_, err := d.Pool.Exec(context.Background(), `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, owner text, sku text)`)
	require.NoError(t, err)
	s := &server{DB: d, reg: txn.NewRegistry()}
	logger := slog.New(slog.NewTextHandler(t.Output(), nil))
	p := d.Pool
	if pool != nil {
		p = pool(d)
	}
	runner, err := txn.New(p, &txn.Config{Workflows: s.reg, Logger: logger})
	require.NoError(t, err)
	if cfg == nil {
		cfg = &httpidem.Config{}
	}
	cfg.Logger = logger
	if cfg.Scope == nil {
		cfg.Scope = func(r *http.Request) (string, error) {
			user, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if !ok || user == "" {
				return "", errors.New("no user")
			}
			return user, nil
		}
	}
	mw, err := httpidem.New(runner, cfg)
	require.NoError(t, err)

	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.calls.Add(1)
		var in struct {
			SKU string `json:"sku"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.SKU == "" {
			w.WriteHeader(http.StatusBadRequest) // validation: not stored
			return
		}
		tx, ok := httpidem.Tx(r.Context())
		if !ok {
			http.Error(w, "no tx", 500)
			return
		}
		var id int64
		if err := tx.QueryRow(r.Context(), `INSERT INTO orders (owner, sku) VALUES ($1, $2) RETURNING id`, r.Header.Get("Authorization"), in.SKU).Scan(&id); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		s.held.Add(1)
		if s.block != nil {
			<-s.block
		}
		switch in.SKU {
		case "declined":
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusPaymentRequired)
			_, _ = w.Write([]byte(`{"error":"card_declined"}`))
			return
		case "broken":
			_, _ = tx.Exec(r.Context(), `SELECT 1/0`) // aborts the transaction
			http.Error(w, "division by zero", 500)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/"+jsonInt(id))
		w.Header().Set("X-Not-Stored", "1")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":` + jsonInt(id) + `,"sku":"` + in.SKU + `"}`))
	})))
	mux.Handle("GET /orders", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, ok := httpidem.Tx(r.Context())
		w.Header().Set("X-Has-Tx", map[bool]string{true: "yes", false: "no"}[ok])
		w.WriteHeader(200)
	})))
	wf := txn.NewWorkflow("ride", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		id, err := txn.Atomic(ctx, a, "ride", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			s.calls.Add(1)
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO orders (owner, sku) VALUES ('ride', 'ride') RETURNING id`).Scan(&id)
			return id, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(201, map[string]any{"ride_id": id, "params": a.Params()})
	})
	require.NoError(t, s.reg.Register(wf))
	mux.Handle("POST /rides", mw.Workflow(wf))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	s.url = srv.URL
	return s
}

func jsonInt(v int64) string { b, _ := json.Marshal(v); return string(b) }

type result struct {
	status int
	header http.Header
	body   string
}

func (s *server) do(t *testing.T, method, path, user, key, body string) result {
	t.Helper()
	req, err := http.NewRequest(method, s.url+path, strings.NewReader(body))
	require.NoError(t, err)
	if user != "" {
		req.Header.Set("Authorization", "Bearer "+user)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return result{resp.StatusCode, resp.Header, string(b)}
}

func requireProblem(t *testing.T, r result, status int, kind string) {
	t.Helper()
	require.Equal(t, status, r.status, r.body)
	require.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
	var p map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.body), &p))
	require.Equal(t, httpidem.ProblemTypePrefix+kind, p["type"])
	require.Equal(t, float64(status), p["status"])
}

func problemDetail(t *testing.T, r result) string {
	t.Helper()
	var p struct {
		Detail string `json:"detail"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.body), &p), r.body)
	return p.Detail
}

// records is a slog.Handler keeping messages by level.
type records struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (h *records) Enabled(context.Context, slog.Level) bool { return true }

func (h *records) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.recs = append(h.recs, r.Clone())
	return nil
}

func (h *records) WithAttrs([]slog.Attr) slog.Handler { return h }

func (h *records) WithGroup(string) slog.Handler { return h }

// take returns the messages logged at level or above since the last take,
// and forgets every record.
func (h *records) take(level slog.Level) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var msgs []string
	for _, r := range h.recs {
		if r.Level >= level {
			msgs = append(msgs, r.Message)
		}
	}
	h.recs = nil
	return msgs
}
