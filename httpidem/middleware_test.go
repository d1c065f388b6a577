package httpidem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

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
	// The key is taken with the handler's first statement.
	require.Eventually(t, func() bool { return s.held.Load() == 1 }, 10*time.Second, 5*time.Millisecond)
	r := s.do(t, "POST", "/orders", "alice", "k", `{"sku":"book"}`)
	requireProblem(t, r, 409, "idempotency-key-in-use")
	require.NotEmpty(t, r.header.Get("Retry-After"))
	close(s.block)
	require.Equal(t, 201, (<-done).status)
	// The second handler ran up to its insert, which went out with the
	// key's insert and never ran: the key was taken.
	require.Equal(t, int64(2), s.calls.Load())
	require.Equal(t, int64(1), s.held.Load())
	require.Equal(t, 1, s.Count(t, `SELECT count(*) FROM orders`))
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

// The acceptance test of Wrap under contention: 200 orders from 20
// concurrent clients, each decrementing one stock row, so SERIALIZABLE
// transactions conflict all the time. The handler cannot return an error;
// when its statement fails it answers 500 itself, as handlers do. Every
// request must end 201, or 409 with Retry-After once the conflict outlasted
// the retries; none 500. The handler sees the full body on every run, and
// the stock falls by exactly the number of 201s.
func TestWrapUnderContentionAnswers201Or409NeverA500(t *testing.T) {
	t.Parallel()
	const requests, clients, stock = 200, 20, 1000
	d := pgtest.New(t)
	ctx := context.Background()
	_, err := d.Pool.Exec(ctx, `CREATE TABLE stock (sku text PRIMARY KEY, qty int NOT NULL)`)
	require.NoError(t, err)
	_, err = d.Pool.Exec(ctx, `INSERT INTO stock VALUES ('book', $1)`, stock)
	require.NoError(t, err)
	runner, err := txn.New(d.Pool, &txn.Config{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	mw, err := httpidem.New(runner, &httpidem.Config{
		Scope:  func(r *http.Request) (string, error) { return r.Header.Get("X-User"), nil },
		Logger: slog.New(slog.DiscardHandler),
	})
	require.NoError(t, err)

	var runs, shortBodies atomic.Int64
	handler := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		var in struct {
			SKU string `json:"sku"`
			Qty int    `json:"qty"`
			Pad string `json:"pad"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.SKU == "" || len(in.Pad) != 512 {
			shortBodies.Add(1)
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		tx, _ := httpidem.Tx(r.Context())
		var left int
		err := tx.QueryRow(r.Context(), `SELECT qty FROM stock WHERE sku = $1`, in.SKU).Scan(&left)
		if err == nil {
			_, err = tx.Exec(r.Context(), `UPDATE stock SET qty = $1 WHERE sku = $2`, left-in.Qty, in.SKU)
		}
		if err != nil {
			http.Error(w, "storage failed", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"left":%d}`, left-in.Qty)
	}))
	srv := httptest.NewServer(handler)
	defer srv.Close()

	body := `{"sku":"book","qty":1,"pad":"` + strings.Repeat("p", 512) + `"}`
	var created, conflicted atomic.Int64
	var mu sync.Mutex
	others := map[int]int{}
	next := make(chan int, requests)
	for i := range requests {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range next {
				req, err := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(body))
				require.NoError(t, err)
				req.Header.Set("X-User", "client-"+strconv.Itoa(c))
				req.Header.Set("Idempotency-Key", "order-"+strconv.Itoa(i))
				resp, err := http.DefaultClient.Do(req)
				require.NoError(t, err)
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				switch {
				case resp.StatusCode == 201:
					created.Add(1)
				case resp.StatusCode == 409 && resp.Header.Get("Retry-After") != "":
					conflicted.Add(1)
				default:
					mu.Lock()
					others[resp.StatusCode]++
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	t.Logf("201: %d, 409: %d, handler runs: %d, serialization retries: %d",
		created.Load(), conflicted.Load(), runs.Load(), runner.Stats().Retries)
	require.Empty(t, others, "every request ends 201 or 409 with Retry-After")
	require.Equal(t, int64(requests), created.Load()+conflicted.Load())
	require.Zero(t, shortBodies.Load(), "every run saw the full body")
	var left int
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT qty FROM stock`).Scan(&left))
	require.Equal(t, stock-int(created.Load()), left, "stock fell by exactly the number of 201s")
	require.Equal(t, int(created.Load()), d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE response_status = 201`))
	require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE response_status <> 201`), "nothing else stored")
	require.Greater(t, runner.Stats().Retries, uint64(0), "the test did contend")
}

// A handler run again after a serialization failure gets the whole body
// again and a fresh response: nothing the failed run wrote leaks into it.
func TestRetriedHandlerSeesFullBodyAndFreshResponse(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	_, err := d.Pool.Exec(ctx, `CREATE SEQUENCE tries`)
	require.NoError(t, err)
	runner, err := txn.New(d.Pool, &txn.Config{RetryBaseDelay: time.Millisecond})
	require.NoError(t, err)
	mw, err := httpidem.New(runner, &httpidem.Config{Scope: func(*http.Request) (string, error) { return "alice", nil }})
	require.NoError(t, err)
	var bodies []string
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		bodies = append(bodies, string(b))
		w.Header().Set("X-Run", strconv.Itoa(len(bodies)))
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte("run " + strconv.Itoa(len(bodies)) + ";"))
		tx, _ := httpidem.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), `DO $$ BEGIN IF nextval('tries') = 1 THEN
			RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END IF; END $$`); err != nil {
			w.WriteHeader(http.StatusInternalServerError) // too late: a 200 is written
			return
		}
	})))
	defer srv.Close()
	req, err := http.NewRequest("POST", srv.URL, strings.NewReader(`{"sku":"book"}`))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "k")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, []string{`{"sku":"book"}`, `{"sku":"book"}`}, bodies)
	require.Equal(t, 200, resp.StatusCode)
	require.Equal(t, "run 2;", string(got), "the first run's output is gone")
}

// Every error the runner returns is answered with the status txn.HTTPStatus
// gives it, so an API that maps errors itself and one behind the middleware
// answer alike.
func TestRunnerErrorsAreAnsweredWithTxnsHTTPStatus(t *testing.T) {
	t.Parallel()
	runner, err := txn.New(pgtest.Pool(t), nil)
	require.NoError(t, err)
	m, err := httpidem.New(runner, &httpidem.Config{
		Scope:  func(*http.Request) (string, error) { return "u", nil },
		Logger: slog.New(slog.DiscardHandler),
	})
	require.NoError(t, err)
	wrap := func(err error) error { return fmt.Errorf("txn: run: %w", err) }
	for _, c := range []struct {
		err  error
		kind string
	}{
		{&txn.KeyStateError{Err: txn.ErrKeyInUse, Status: txn.KeyRunning, RetryAfter: 3 * time.Second}, "idempotency-key-in-use"},
		{&txn.KeyStateError{Err: txn.ErrKeyReused, Status: txn.KeyFinished}, "idempotency-key-reused"},
		{&txn.RequestError{Err: txn.ErrRequestTooLarge, Field: "params", Reason: "2000 bytes"}, "payload-too-large"},
		{&txn.RequestError{Err: txn.ErrInvalidRequest, Field: "params", Reason: "not JSON"}, "invalid-request"},
		{&txn.RequestError{Err: txn.ErrInvalidKey, Field: "key", Reason: "empty"}, "invalid-request"},
		{txn.ErrConflict, "conflict"},
		{txn.ErrLeaseLost, "conflict"},
		{txn.ErrUnknownWorkflow, "internal"},
		{txn.ErrInvalidUse, "internal"},
		{&txn.PanicError{Value: "boom"}, "internal"},
		{errors.New("connection refused"), "internal"},
	} {
		err := wrap(c.err)
		rec := httptest.NewRecorder()
		httpidem.Answer(m, rec, httptest.NewRequest("POST", "/x", nil), err)
		require.Equal(t, txn.HTTPStatus(err), rec.Code, "%v", err)
		var body struct {
			Type   string `json:"type"`
			Status int    `json:"status"`
		}
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &body))
		require.Equal(t, rec.Code, body.Status)
		require.Equal(t, httpidem.ProblemTypePrefix+c.kind, body.Type, "%v", err)
	}
}

// A database outage is answered 503 with Retry-After and problem type
// "unavailable", not 500: the client retries with the same key, and the
// retry once the database is back creates the order once.
func TestDatabaseOutageIs503WithRetryAfter(t *testing.T) {
	t.Parallel()
	var proxy *pgtest.Proxy
	s := newServerOn(t, nil, func(d *pgtest.DB) *pgxpool.Pool {
		var pool *pgxpool.Pool
		proxy, pool = d.NewProxy(t)
		return pool
	})
	proxy.Unreachable()
	r := s.do(t, "POST", "/orders", "alice", "k1", `{"sku":"book"}`)
	requireProblem(t, r, http.StatusServiceUnavailable, "unavailable")
	require.NotEmpty(t, r.header.Get("Retry-After"))
	require.Zero(t, s.calls.Load(), "the handler did not run without a database")

	proxy.Reachable()
	r = s.do(t, "POST", "/orders", "alice", "k1", `{"sku":"book"}`)
	require.Equal(t, http.StatusCreated, r.status, r.body)
	require.Equal(t, 1, s.Count(t, `SELECT count(*) FROM orders`))
}

// A key cleaned up after its TTL (a tombstone left by the cleaner) is
// answered 422 with its own problem type, and the handler does not run.
func TestExpiredKeyIs422AndNothingRuns(t *testing.T) {
	t.Parallel()
	s := newServer(t, nil)
	r := s.do(t, "POST", "/orders", "alice", "k1", `{"sku":"book"}`)
	require.Equal(t, http.StatusCreated, r.status, r.body)
	_, err := s.Pool.Exec(context.Background(), `
		WITH gone AS (DELETE FROM idempotency_keys WHERE key = 'k1' RETURNING scope, key, fingerprint, finished_at, response_status)
		INSERT INTO idempotency_key_tombstones (scope, key_hash, fingerprint, finished_at, response_status, expires_at)
		SELECT scope, sha256(convert_to(key, 'UTF8')), fingerprint, finished_at, response_status, now() + interval '30 days' FROM gone`)
	require.NoError(t, err)
	r = s.do(t, "POST", "/orders", "alice", "k1", `{"sku":"book"}`)
	requireProblem(t, r, http.StatusUnprocessableEntity, "idempotency-key-expired")
	require.Equal(t, int64(1), s.calls.Load(), "the handler ran for the first request only")
	require.Equal(t, 1, s.Count(t, `SELECT count(*) FROM orders`))
}
