package httpidem

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/internal/txnbridge"
	"github.com/atomicphase/atomicphase/txn"
)

// DefaultStore is txn.DefaultStore, the policy that decides which responses
// are stored. The middleware follows the runner's txn.Config.Store.
//
// Deprecated: use txn.DefaultStore.
func DefaultStore(status int) bool { return txn.DefaultStore(status) }

// Middleware runs requests under idempotency keys with a txn.Runner.
type Middleware struct {
	runner *txn.Runner
	cfg    Config
	store  func(status int) bool
	stored map[string]bool
}

// New returns middleware that runs keyed requests with runner. Invalid
// values give an error wrapping ErrInvalidConfig.
func New(runner *txn.Runner, cfg *Config) (*Middleware, error) {
	if runner == nil {
		return nil, fmt.Errorf("httpidem: new: %w: runner is nil", ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("httpidem: new: %w", err)
	}
	m := &Middleware{runner: runner, cfg: c, store: txnbridge.Of(runner).Store, stored: map[string]bool{}}
	for _, h := range c.StoreHeaders {
		m.stored[http.CanonicalHeaderKey(h)] = true
	}
	return m, nil
}

type txKey struct{}

// Tx returns the transaction a handler wrapped by Middleware.Wrap runs in:
// write through it so that the writes commit with the key and the response.
// ok is false when the request runs without a key (e.g. GET). The handler
// may run more than once for one request (after a serialization failure,
// with the same body each time); only one run's writes commit. It cannot
// commit or roll back the transaction itself.
func Tx(ctx context.Context) (tx pgx.Tx, ok bool) {
	tx, ok = ctx.Value(txKey{}).(pgx.Tx)
	return tx, ok
}

// request is a keyed request, checked, with its body read.
type request struct {
	key  txn.Key
	body []byte
}

// prepare reads the key, scope and body. It answers the client itself and
// returns false when the request cannot run; it returns a nil request when
// it runs without a key.
func (m *Middleware) prepare(w http.ResponseWriter, r *http.Request) (*request, bool) {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
		return nil, true
	}
	raw := r.Header.Values(HeaderName)
	if len(raw) == 0 {
		if m.cfg.Required(r) {
			problem(w, http.StatusBadRequest, problemMissingKey, "This request needs an Idempotency-Key header.", 0)
			return nil, false
		}
		return nil, true
	}
	if len(raw) > 1 {
		problem(w, http.StatusBadRequest, problemInvalidKey, "Send one Idempotency-Key header.", 0)
		return nil, false
	}
	value, err := ParseKey(raw[0])
	if err != nil {
		problem(w, http.StatusBadRequest, problemInvalidKey, "The Idempotency-Key header is invalid: "+strings.TrimPrefix(err.Error(), ErrInvalidHeader.Error()+": ")+".", 0)
		return nil, false
	}
	scope, err := m.cfg.Scope(r)
	if err != nil {
		m.cfg.Logger.DebugContext(r.Context(), "idempotent request without a principal", "method", r.Method, "path", r.URL.Path, "error", err)
		problem(w, http.StatusUnauthorized, problemUnauthorized, "The request's principal could not be established.", 0)
		return nil, false
	}
	if scope == "" && !m.cfg.AllowAnonymous {
		problem(w, http.StatusUnauthorized, problemUnauthorized, "An Idempotency-Key is only accepted from an authenticated principal.", 0)
		return nil, false
	}
	var reqErr *txn.RequestError
	if err := txn.ValidateScope(scope); errors.As(err, &reqErr) {
		problem(w, http.StatusBadRequest, problemBadRequest, "The request's principal cannot scope an Idempotency-Key: it is "+reqErr.Reason+".", 0)
		return nil, false
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.cfg.MaxBodyBytes))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			problem(w, http.StatusRequestEntityTooLarge, problemTooLarge, fmt.Sprintf("The body exceeds %d bytes.", m.cfg.MaxBodyBytes), 0)
		} else {
			problem(w, http.StatusBadRequest, problemBadRequest, "The body could not be read.", 0)
		}
		return nil, false
	}
	path := r.URL.EscapedPath()
	if r.URL.RawQuery != "" {
		path += "?" + r.URL.RawQuery
	}
	return &request{key: txn.Key{Scope: scope, Value: value, Method: r.Method, Path: path, Params: body}, body: body}, true
}

// withBody returns a shallow copy of r whose body reads body from the start.
func withBody(ctx context.Context, r *http.Request, body []byte) *http.Request {
	r = r.WithContext(ctx)
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	r.ContentLength = int64(len(body))
	return r
}

// Wrap runs next under the request's idempotency key, in one transaction
// with the key (see Tx). Requests without a key that need none pass through.
//
// next may run more than once for one request: when its transaction meets a
// serialization failure or a deadlock (even one the handler swallowed, e.g.
// by answering 500), it is rolled back and next runs again with the full
// body and a fresh response; only the last run's response is sent, and
// nothing is stored until a run commits. When the conflict persists after
// txn.Config.MaxRetries, the answer is 409 with Retry-After. A response the
// runner's txn.Config.Store does not store (a client-correctable 4xx) is
// rolled back and passed through with all its headers.
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, ok := m.prepare(w, r)
		if !ok {
			return
		}
		if req == nil {
			next.ServeHTTP(w, r)
			return
		}
		var last *recorder
		resp, err := m.runner.Run(r.Context(), req.key, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			rec := newRecorder() // each run answers afresh, from the full body
			next.ServeHTTP(rec, withBody(context.WithValue(ctx, txKey{}, tx), r, req.body))
			last = rec
			return txn.Response{Status: rec.status, Header: m.storedHeader(rec.header), Body: rec.body.Bytes()}, nil
		})
		if err == nil && !resp.Replayed && !m.store(resp.Status) && last != nil {
			last.writeTo(w) // a rejection, not stored: with all its headers
			return
		}
		m.answer(w, r, resp, err)
	})
}

// Workflow returns a handler that runs wf (registered in the runner's
// registry) under the request's idempotency key, with the JSON body as the
// workflow's params (Attempt.Params). The key is always required.
func (m *Middleware) Workflow(wf *txn.Workflow) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, ok := m.prepare(w, r)
		if !ok {
			return
		}
		if req == nil {
			problem(w, http.StatusBadRequest, problemMissingKey, "This request needs an Idempotency-Key header.", 0)
			return
		}
		resp, err := m.runner.RunWorkflow(r.Context(), req.key, wf)
		m.answer(w, r, resp, err)
	})
}

func (m *Middleware) storedHeader(h http.Header) http.Header {
	out := http.Header{}
	for k, v := range h {
		if m.stored[k] {
			out[k] = v
		}
	}
	return out
}

// answer writes a stored or fresh response, or the problem for err. The
// runner has logged transient failures already; only what it does not log
// is logged here.
func (m *Middleware) answer(w http.ResponseWriter, r *http.Request, resp txn.Response, err error) {
	if err == nil {
		for k, v := range resp.Header {
			w.Header()[k] = v
		}
		if resp.Replayed {
			w.Header().Set(ReplayedHeader, "true")
		}
		w.WriteHeader(resp.Status)
		_, _ = w.Write(resp.Body)
		return
	}
	// The status is txn's, so an API that answers with txn.HTTPStatus and
	// one behind this middleware answer alike.
	status := txn.HTTPStatus(err)
	var (
		kse    *txn.KeyStateError
		reqErr *txn.RequestError
	)
	switch {
	case errors.Is(err, txn.ErrKeyInUse):
		retry := time.Second
		if errors.As(err, &kse) {
			retry = kse.RetryAfter
		}
		problem(w, status, problemInUse, "A request with this Idempotency-Key is being processed; retry later.", retry)
	case errors.Is(err, txn.ErrKeyReused):
		problem(w, status, problemReused, "This Idempotency-Key was used with a different request.", 0)
	case errors.Is(err, txn.ErrKeyExpired):
		problem(w, status, problemExpired, "This Idempotency-Key was used for an operation that finished and expired; use a new key for a new operation.", 0)
	case errors.As(err, &reqErr) && reqErr.Err == txn.ErrRequestTooLarge:
		problem(w, status, problemTooLarge, "The body is too large: "+reqErr.Reason+".", 0)
	case errors.As(err, &reqErr) && reqErr.Field == "params":
		problem(w, status, problemBadRequest, "The body is not acceptable JSON: "+reqErr.Reason+".", 0)
	case errors.As(err, &reqErr):
		problem(w, status, problemBadRequest, fmt.Sprintf("The request's %s is invalid: %s.", reqErr.Field, reqErr.Reason), 0)
	case errors.Is(err, txn.ErrConflict), errors.Is(err, txn.ErrLeaseLost):
		problem(w, status, problemConflict, "The request conflicted with concurrent work; retry with the same key.", time.Second)
	case errors.Is(err, txn.ErrUnavailable):
		problem(w, status, problemUnavailable, "The service cannot reach its database; retry with the same key.", 2*time.Second)
	case errors.Is(err, txn.ErrUnknownWorkflow):
		// Returned before any key was written: the runner logged nothing.
		m.cfg.Logger.ErrorContext(r.Context(), "idempotent request cannot run: its workflow is not registered with the runner",
			"method", r.Method, "path", r.URL.Path, "error", err)
		problem(w, status, problemInternal, "The server cannot process this request.", 0)
	case errors.Is(err, txn.ErrInvalidUse):
		problem(w, status, problemInternal, "The server cannot process this request.", 0)
	default:
		problem(w, status, problemInternal, "The request could not be completed; retry with the same key.", 0)
	}
}

// Problem types: stable URIs, one per case.
const (
	problemMissingKey   = "idempotency-key-missing"
	problemInvalidKey   = "idempotency-key-invalid"
	problemInUse        = "idempotency-key-in-use"
	problemReused       = "idempotency-key-reused"
	problemExpired      = "idempotency-key-expired"
	problemTooLarge     = "payload-too-large"
	problemBadRequest   = "invalid-request"
	problemUnauthorized = "unauthenticated"
	problemConflict     = "conflict"
	problemInternal     = "internal"
	problemUnavailable  = "unavailable"
)

// ProblemTypePrefix prefixes each problem's type URI, e.g.
// "urn:atomicphase:problem:idempotency-key-in-use".
const ProblemTypePrefix = "urn:atomicphase:problem:"

var problemTitle = map[string]string{
	problemMissingKey: "Idempotency-Key is missing", problemInvalidKey: "Idempotency-Key is invalid",
	problemInUse: "Idempotency-Key is in use", problemReused: "Idempotency-Key was reused",
	problemExpired:  "Idempotency-Key has expired",
	problemTooLarge: "Payload too large", problemBadRequest: "Invalid request", problemUnauthorized: "Unauthenticated",
	problemConflict: "Conflict", problemInternal: "Internal error", problemUnavailable: "Service unavailable",
}

// problem writes an RFC 9457 problem+json response.
func problem(w http.ResponseWriter, status int, kind, detail string, retryAfter time.Duration) {
	body, _ := json.Marshal(map[string]any{
		"type": ProblemTypePrefix + kind, "title": problemTitle[kind], "status": status, "detail": detail,
	})
	w.Header().Set("Content-Type", "application/problem+json")
	if retryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(int((retryAfter+time.Second-1)/time.Second)))
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// recorder buffers a handler's response so it can be stored.
type recorder struct {
	header http.Header
	status int
	wrote  bool
	body   bytes.Buffer
}

func newRecorder() *recorder { return &recorder{header: http.Header{}, status: http.StatusOK} }

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(status int) {
	if !r.wrote {
		r.status, r.wrote = status, true
	}
}

func (r *recorder) Write(b []byte) (int, error) {
	r.wrote = true
	return r.body.Write(b)
}

func (r *recorder) writeTo(w http.ResponseWriter) {
	for k, v := range r.header {
		w.Header()[k] = v
	}
	w.WriteHeader(r.status)
	_, _ = w.Write(r.body.Bytes())
}
