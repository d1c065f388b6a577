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
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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
	block chan struct{} // when set, handlers wait on it
	reg   *txn.Registry
}

// newServer serves POST /orders (single phase, writes an order), and
// POST /rides (a workflow), authenticated by "Authorization: Bearer <user>".
func newServer(t *testing.T, cfg *httpidem.Config) *server {
	t.Helper()
	d := pgtest.New(t)
	_, err := d.Pool.Exec(context.Background(), `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, owner text, sku text)`)
	require.NoError(t, err)
	s := &server{DB: d, reg: txn.NewRegistry()}
	logger := slog.New(slog.NewTextHandler(t.Output(), nil))
	runner, err := txn.New(d.Pool, &txn.Config{Workflows: s.reg, Logger: logger})
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
		if s.block != nil {
			<-s.block
		}
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

func TestFirstRequestExecutesRetryReplaysByteForByte(t *testing.T) {
	t.Parallel()
	s := newServer(t, nil)
	first := s.do(t, "POST", "/orders", "alice", `"k-1"`, `{"sku":"book"}`)
	require.Equal(t, 201, first.status)
	require.Empty(t, first.header.Get(httpidem.ReplayedHeader))
	require.Empty(t, first.header.Get("X-Not-Stored"), "a keyed response carries only stored headers")
	again := s.do(t, "POST", "/orders", "alice", `k-1`, `{ "sku" : "book" }`) // bare token, same key; reformatted body
	require.Equal(t, 201, again.status)
	require.Equal(t, "true", again.header.Get(httpidem.ReplayedHeader))
	require.Equal(t, first.body, again.body)
	require.Equal(t, first.header.Get("Location"), again.header.Get("Location"))
	require.Equal(t, first.header.Get("Content-Type"), again.header.Get("Content-Type"))
	require.Equal(t, int64(1), s.calls.Load())
	require.Equal(t, 1, s.Count(t, `SELECT count(*) FROM orders`))
}

func TestMissingKeyIs400AndNothingRuns(t *testing.T) {
	t.Parallel()
	s := newServer(t, nil)
	requireProblem(t, s.do(t, "POST", "/orders", "alice", "", `{"sku":"book"}`), 400, "idempotency-key-missing")
	require.Equal(t, int64(0), s.calls.Load())
	require.Equal(t, 0, s.Count(t, `SELECT count(*) FROM idempotency_keys`))
	// GET needs no key and runs without a transaction.
	r := s.do(t, "GET", "/orders", "alice", "", "")
	require.Equal(t, 200, r.status)
	require.Equal(t, "no", r.header.Get("X-Has-Tx"))
}

func TestInvalidKeyIs400(t *testing.T) {
	t.Parallel()
	s := newServer(t, nil)
	for _, key := range []string{`"unterminated`, `"a"b`, `two words`, `"bad\escape"`, `"` + strings.Repeat("k", 256) + `"`, `""`, `é`} {
		requireProblem(t, s.do(t, "POST", "/orders", "alice", key, `{"sku":"book"}`), 400, "idempotency-key-invalid")
	}
	require.Equal(t, int64(0), s.calls.Load())
}

func TestSameKeyOtherPayloadIs422(t *testing.T) {
	t.Parallel()
	s := newServer(t, nil)
	require.Equal(t, 201, s.do(t, "POST", "/orders", "alice", "k", `{"sku":"book"}`).status)
	requireProblem(t, s.do(t, "POST", "/orders", "alice", "k", `{"sku":"lamp"}`), 422, "idempotency-key-reused")
	require.Equal(t, int64(1), s.calls.Load())
}

func TestSameKeyWhileInFlightIs409WithRetryAfter(t *testing.T) {
	t.Parallel()
	s := newServer(t, nil)
	s.block = make(chan struct{})
	done := make(chan result, 1)
	go func() { done <- s.do(t, "POST", "/orders", "alice", "k", `{"sku":"book"}`) }()
	require.Eventually(t, func() bool { return s.calls.Load() == 1 }, 10*time.Second, 5*time.Millisecond)
	r := s.do(t, "POST", "/orders", "alice", "k", `{"sku":"book"}`)
	requireProblem(t, r, 409, "idempotency-key-in-use")
	require.NotEmpty(t, r.header.Get("Retry-After"))
	close(s.block)
	require.Equal(t, 201, (<-done).status)
	require.Equal(t, int64(1), s.calls.Load())
}

func TestOversizedBodyIs413AndNothingStored(t *testing.T) {
	t.Parallel()
	s := newServer(t, &httpidem.Config{MaxBodyBytes: 64})
	requireProblem(t, s.do(t, "POST", "/orders", "alice", "k", `{"sku":"`+strings.Repeat("x", 100)+`"}`), 413, "payload-too-large")
	require.Equal(t, 0, s.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

func TestSameKeyFromTwoPrincipalsIsTwoOperations(t *testing.T) {
	t.Parallel()
	s := newServer(t, nil)
	a := s.do(t, "POST", "/orders", "alice", "shared", `{"sku":"book"}`)
	b := s.do(t, "POST", "/orders", "bob", "shared", `{"sku":"book"}`)
	require.Equal(t, 201, a.status)
	require.Equal(t, 201, b.status)
	require.Empty(t, b.header.Get(httpidem.ReplayedHeader), "bob never sees alice's response")
	require.NotEqual(t, a.body, b.body)
	require.Equal(t, 2, s.Count(t, `SELECT count(*) FROM orders`))
	requireProblem(t, s.do(t, "POST", "/orders", "", "shared", `{"sku":"book"}`), 401, "unauthenticated")
}

func TestValidationRejectionIsNotStored(t *testing.T) {
	t.Parallel()
	s := newServer(t, nil)
	require.Equal(t, 400, s.do(t, "POST", "/orders", "alice", "k", `{"sku":""}`).status)
	require.Equal(t, 0, s.Count(t, `SELECT count(*) FROM idempotency_keys`))
	// The client fixes the request and retries with the same key.
	require.Equal(t, 201, s.do(t, "POST", "/orders", "alice", "k", `{"sku":"book"}`).status)
	requireProblem(t, s.do(t, "POST", "/orders", "alice", "k2", `not json`), 400, "invalid-request")
}

func TestTerminalErrorsAreStoredTransientOnesAreNot(t *testing.T) {
	t.Parallel()
	s := newServer(t, nil)
	d1 := s.do(t, "POST", "/orders", "alice", "declined", `{"sku":"declined"}`)
	require.Equal(t, 402, d1.status)
	d2 := s.do(t, "POST", "/orders", "alice", "declined", `{"sku":"declined"}`)
	require.Equal(t, 402, d2.status)
	require.Equal(t, "true", d2.header.Get(httpidem.ReplayedHeader))
	require.Equal(t, d1.body, d2.body)

	// A handler whose transaction broke: nothing is stored, the retry runs again.
	requireProblem(t, s.do(t, "POST", "/orders", "alice", "broken", `{"sku":"broken"}`), 500, "internal")
	requireProblem(t, s.do(t, "POST", "/orders", "alice", "broken", `{"sku":"broken"}`), 500, "internal")
	require.Equal(t, int64(3), s.calls.Load(), "declined once, broken twice")
	require.Equal(t, 1, s.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

func TestWorkflowHandlerRunsAndReplays(t *testing.T) {
	t.Parallel()
	s := newServer(t, nil)
	first := s.do(t, "POST", "/rides", "alice", "r1", `{"from":"A","to":"B"}`)
	require.Equal(t, 201, first.status, first.body)
	require.Contains(t, first.body, `"from":"A"`)
	again := s.do(t, "POST", "/rides", "alice", "r1", `{"to":"B","from":"A"}`)
	require.Equal(t, "true", again.header.Get(httpidem.ReplayedHeader))
	require.Equal(t, first.body, again.body)
	require.Equal(t, int64(1), s.calls.Load())
	requireProblem(t, s.do(t, "POST", "/rides", "alice", "", `{}`), 400, "idempotency-key-missing")
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	_, err := httpidem.New(nil, &httpidem.Config{})
	require.Error(t, err)
	d := pgtest.New(t)
	r, err := txn.New(d.Pool, nil)
	require.NoError(t, err)
	_, err = httpidem.New(r, &httpidem.Config{})
	require.ErrorIs(t, err, httpidem.ErrNoScope)
}
