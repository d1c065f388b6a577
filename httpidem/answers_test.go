package httpidem_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

// An empty principal would share one keyspace with every other caller
// without one, letting them replay each other's responses: 401, unless the
// middleware is told anonymous callers are fine.
func TestEmptyScopeIs401UnlessAnonymousAllowed(t *testing.T) {
	t.Parallel()
	anonymous := func(*http.Request) (string, error) { return "", nil }
	s := newServer(t, &httpidem.Config{Scope: anonymous})
	requireProblem(t, s.do(t, "POST", "/orders", "", "k", `{"sku":"book"}`), 401, "unauthenticated")
	requireProblem(t, s.do(t, "POST", "/rides", "", "k", `{}`), 401, "unauthenticated")
	require.Zero(t, s.calls.Load())
	require.Zero(t, s.Count(t, `SELECT count(*) FROM idempotency_keys`))

	open := newServer(t, &httpidem.Config{Scope: anonymous, AllowAnonymous: true})
	require.Equal(t, 201, open.do(t, "POST", "/orders", "", "k", `{"sku":"book"}`).status)
	replay := open.do(t, "POST", "/orders", "", "k", `{"sku":"book"}`)
	require.Equal(t, "true", replay.header.Get(httpidem.ReplayedHeader))
}

func problemDetail(t *testing.T, r result) string {
	t.Helper()
	var p struct {
		Detail string `json:"detail"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.body), &p), r.body)
	return p.Detail
}

// Each answer names the actual problem.
func TestProblemsNameTheActualProblem(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("u", 300)
	s := newServer(t, &httpidem.Config{Scope: func(r *http.Request) (string, error) {
		if r.Header.Get("Authorization") == "Bearer long" {
			return long, nil
		}
		return "alice", nil
	}})
	cases := []struct {
		user, key, body, kind string
		says                  []string
	}{
		{"long", "k", `{"sku":"book"}`, "invalid-request", []string{"principal", "300 bytes"}},
		{"alice", "k", `{"sku":"a","sku":"b"}`, "invalid-request", []string{`duplicate object key "sku"`}},
		{"alice", "k", `{"sku":1e1000000}`, "invalid-request", []string{"numeric range"}},
		{"alice", "k", `{"sku":`, "invalid-request", []string{"not valid JSON"}},
		{"alice", `"` + strings.Repeat("k", 256) + `"`, `{}`, "idempotency-key-invalid", []string{"256 bytes"}},
	}
	for _, c := range cases {
		r := s.do(t, "POST", "/orders", c.user, c.key, c.body)
		requireProblem(t, r, 400, c.kind)
		detail := problemDetail(t, r)
		for _, want := range c.says {
			require.Contains(t, detail, want)
		}
		require.NotContains(t, detail, "httpidem:", "no package prefixes sent to clients")
		require.NotContains(t, detail, "txn:")
		if c.user == "long" {
			require.NotContains(t, detail, "JSON", "the body is fine")
		}
	}
	require.Zero(t, s.calls.Load())
}

// The middleware logs what the runner does not: a workflow that is not
// registered is an ERROR that says so, not "the key stays resumable" (no key
// exists). A transient failure is one WARN across runner and middleware; a
// client-correctable answer that is not stored is DEBUG.
func TestMiddlewareAndRunnerLogEachFailureOnce(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	_, err := d.Pool.Exec(context.Background(), `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY, sku text)`)
	require.NoError(t, err)
	logs := &records{}
	logger := slog.New(logs)
	runner, err := txn.New(d.Pool, &txn.Config{Logger: logger})
	require.NoError(t, err)
	mw, err := httpidem.New(runner, &httpidem.Config{Logger: logger, Scope: func(*http.Request) (string, error) { return "alice", nil }})
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("POST /fail", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		panic("handler bug") // a transient failure: nothing stored, retry runs again
	})))
	mux.Handle("POST /reject", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("WWW-Authenticate", "Bearer")
		w.WriteHeader(http.StatusUnauthorized)
	})))
	unregistered := txn.NewWorkflow("unregistered", func(context.Context, *txn.Attempt) (txn.Response, error) {
		return txn.JSON(201, 1)
	})
	mux.Handle("POST /wf", mw.Workflow(unregistered))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	post := func(path string) *http.Response {
		req, err := http.NewRequest("POST", srv.URL+path, strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "k"+path)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_ = resp.Body.Close()
		return resp
	}

	require.Equal(t, 500, post("/fail").StatusCode)
	warns := logs.take(slog.LevelWarn)
	require.Len(t, warns, 1, "one WARN for one transient failure: %v", warns)

	resp := post("/reject")
	require.Equal(t, 401, resp.StatusCode)
	require.Equal(t, "Bearer", resp.Header.Get("WWW-Authenticate"), "an unstored rejection keeps its headers")
	require.Empty(t, logs.take(slog.LevelInfo), "not stored: DEBUG only")
	require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys`))

	require.Equal(t, 500, post("/wf").StatusCode)
	errs := logs.take(slog.LevelError)
	require.Len(t, errs, 1)
	require.Contains(t, errs[0], "not registered")
	require.NotContains(t, errs[0], "resumable")
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
func (h *records) WithGroup(string) slog.Handler      { return h }

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

func TestNewWrapsErrInvalidConfig(t *testing.T) {
	t.Parallel()
	_, err := httpidem.New(nil, &httpidem.Config{})
	require.ErrorIs(t, err, httpidem.ErrInvalidConfig)
	require.Equal(t, 1, strings.Count(err.Error(), "httpidem:"), err.Error())
	r, err := txn.New(pgtest.Pool(t), nil)
	require.NoError(t, err)
	_, err = httpidem.New(r, &httpidem.Config{})
	require.True(t, errors.Is(err, httpidem.ErrInvalidConfig) && errors.Is(err, httpidem.ErrNoScope), "%v", err)
	require.Equal(t, "httpidem: new: invalid config: Config.Scope is required", err.Error())
}
