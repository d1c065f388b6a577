package webhookin_test

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/inbox/webhookin"
	"github.com/atomicphase/atomicphase/internal/inboxtest"
	"github.com/atomicphase/atomicphase/internal/outboxtest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/webhook"
)

var secret = webhook.NewSecret()

type env struct {
	d   *pgtest.DB
	in  *inbox.Inbox
	h   *webhookin.Handler
	srv *httptest.Server
}

// newEnv starts a webhook receiver; its inbox uses pool(d) when given,
// else d's pool.
func newEnv(t *testing.T, pool func(*pgtest.DB) *pgxpool.Pool, fn webhookin.Func) *env {
	t.Helper()
	d := pgtest.New(t)
	inboxtest.CreateEffects(t, d)
	p := d.Pool
	if pool != nil {
		p = pool(d)
	}
	in, err := inbox.New(p, &inbox.Config{Consumer: "webhooks", Logger: inboxtest.Logger(t)})
	require.NoError(t, err)
	h, err := webhookin.New(in, fn, &webhookin.Config{Secrets: []string{secret}, Logger: inboxtest.Logger(t)})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &env{d: d, in: in, h: h, srv: srv}
}

func writeEffect(runs *atomic.Int64) webhookin.Func {
	return func(ctx context.Context, tx pgx.Tx, req webhookin.Request) error {
		runs.Add(1)
		return inboxtest.WriteEffect(ctx, tx, "webhooks", req.ID, req.Body)
	}
}

// publisher is atomicphase's own webhook sender, pointed at the handler.
func (e *env) publisher(t *testing.T) *webhook.Publisher {
	t.Helper()
	pub, err := webhook.New(webhook.Config{URL: e.srv.URL, Secrets: []string{webhook.NewSecret(), secret}})
	require.NoError(t, err)
	return pub
}

// sign returns the Standard Webhooks headers of a call, signed with key.
func sign(t *testing.T, key, id string, ts time.Time, body []byte) http.Header {
	t.Helper()
	k, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(key, "whsec_"))
	require.NoError(t, err)
	stamp := strconv.FormatInt(ts.Unix(), 10)
	mac := hmac.New(sha256.New, k)
	fmt.Fprintf(mac, "%s.%s.%s", id, stamp, body)
	return http.Header{
		"Webhook-Id":        {id},
		"Webhook-Timestamp": {stamp},
		"Webhook-Signature": {"v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil))},
	}
}

func (e *env) post(t *testing.T, method string, header http.Header, body []byte) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, e.srv.URL, bytes.NewReader(body))
	require.NoError(t, err)
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// Calls from atomicphase's webhook publisher verify and are handled; the
// same message sent again (a retry after a lost answer) is answered 2xx
// without running the handler. Message ids are the outbox's UUIDv7s.
func TestOutboxWebhooksAreHandledOnceAndRetriesAnswered2xx(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	e := newEnv(t, nil, writeEffect(&runs))
	pub := e.publisher(t)
	envs := []outbox.Envelope{
		{ID: uuid.Must(uuid.NewV7()), Topic: "ride.receipt", Payload: []byte(`{"ride_id":1}`), Attempt: 1},
		{ID: uuid.Must(uuid.NewV7()), Topic: "ride.receipt", Payload: []byte(`{"ride_id":2}`), Attempt: 1},
	}
	require.Equal(t, []error{nil, nil}, outboxtest.Publish(t, pub, envs...))
	envs[0].Attempt = 2
	require.Equal(t, []error{nil}, outboxtest.Publish(t, pub, envs[0]), "the retry is answered 2xx")
	require.EqualValues(t, 2, runs.Load())
	require.Equal(t, webhookin.Stats{Handled: 2, Duplicates: 1}, e.h.Stats())
	require.Equal(t, 2, e.d.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM effects WHERE message_id = $1 AND body = $2`,
		envs[0].ID.String(), envs[0].Payload))

	// The whole path: Enqueue, relay, webhook, inbox.
	d := pgtest.New(t)
	outboxtest.Enqueue(t, d.Pool, outbox.Message{Topic: "ride.receipt", Payload: []byte(`{"ride_id":3}`)})
	require.Equal(t, 1, outboxtest.Drain(t, outboxtest.NewRelay(t, d.Pool, pub, outbox.Config{})))
	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM effects WHERE body = '{"ride_id":3}'`))
	require.Equal(t, 3, e.d.Count(t, `SELECT count(*) FROM inbox_messages WHERE consumer = 'webhooks'`))
}

// Calls that fail verification, or carry an unusable webhook-id, are
// refused before any SQL: no statement reaches the database.
func TestBadCallsAreRejectedBeforeAnySQL(t *testing.T) {
	t.Parallel()
	var counter *inboxtest.Counter
	var runs atomic.Int64
	e := newEnv(t, func(d *pgtest.DB) *pgxpool.Pool {
		pool, c := inboxtest.CountingPool(t, d)
		counter = c
		return pool
	}, writeEffect(&runs))
	body := []byte(`{"ride_id":1}`)
	now := time.Now()
	good := sign(t, secret, "msg_1", now, body)
	for name, c := range map[string]struct {
		method string
		header http.Header
		body   []byte
		status int
	}{
		"no headers":       {"POST", http.Header{}, body, 400},
		"other secret":     {"POST", sign(t, webhook.NewSecret(), "msg_1", now, body), body, 400},
		"body changed":     {"POST", good, []byte(`{"ride_id":2}`), 400},
		"id changed":       {"POST", with(good, "Webhook-Id", "msg_2"), body, 400},
		"stale timestamp":  {"POST", sign(t, secret, "msg_1", now.Add(-10*time.Minute), body), body, 400},
		"empty id":         {"POST", sign(t, secret, "", now, body), body, 400},
		"oversized id":     {"POST", sign(t, secret, strings.Repeat("m", inbox.MaxMessageIDBytes+1), now, body), body, 400},
		"non-printable id": {"POST", sign(t, secret, "msg_\u00e9", now, body), body, 400},
		"GET":              {"GET", good, nil, 405},
		"body too large":   {"POST", good, bytes.Repeat([]byte("x"), 1<<20+1), 413},
	} {
		status, answer := e.post(t, c.method, c.header, c.body)
		require.Equal(t, c.status, status, name)
		require.Contains(t, answer, `"status":`+strconv.Itoa(c.status), name)
	}
	require.Zero(t, runs.Load())
	require.Zero(t, counter.N(), "no statement reached the server")
	require.EqualValues(t, 10, e.h.Stats().Rejected)

	status, _ := e.post(t, "POST", good, body)
	require.Equal(t, http.StatusNoContent, status, "the good call goes through")
	require.EqualValues(t, 1, runs.Load())
	require.NotZero(t, counter.N(), "the counter sees the good call's statements")
}

func with(h http.Header, k, v string) http.Header {
	h = h.Clone()
	h.Set(k, v)
	return h
}

// A handler failure, a panic, or a commit that fails is answered 5xx, not
// 2xx: the answer waits for the commit. Nothing is recorded, and the
// sender's retry is handled.
func TestFailuresAreAnswered5xxAndTheRetryIsHandled(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	var mode atomic.Value
	e := newEnv(t, nil, func(ctx context.Context, tx pgx.Tx, req webhookin.Request) error {
		if err := writeEffect(&runs)(ctx, tx, req); err != nil {
			return err
		}
		switch mode.Load() {
		case "error":
			return errors.New("downstream unavailable")
		case "panic":
			panic("handler bug")
		case "commit fails":
			// A deferred constraint fails at COMMIT, after the handler returned.
			_, err := tx.Exec(ctx, `INSERT INTO deferred_once (k) VALUES (1), (1)`)
			return err
		}
		return nil
	})
	_, err := e.d.Pool.Exec(context.Background(), `CREATE TABLE deferred_once (k int, UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)`)
	require.NoError(t, err)
	body := []byte(`{"ride_id":1}`)
	for _, m := range []string{"error", "panic", "commit fails"} {
		mode.Store(m)
		status, answer := e.post(t, "POST", sign(t, secret, "msg_1", time.Now(), body), body)
		require.Equal(t, http.StatusInternalServerError, status, m)
		require.NotContains(t, answer, "downstream", "no internals in the answer")
		require.Zero(t, e.d.Count(t, `SELECT count(*) FROM inbox_messages`), m)
		require.Zero(t, e.d.Count(t, `SELECT count(*) FROM effects`), m)
	}
	mode.Store("")
	status, _ := e.post(t, "POST", sign(t, secret, "msg_1", time.Now(), body), body)
	require.Equal(t, http.StatusNoContent, status)
	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, webhookin.Stats{Handled: 1, Failed: 3}, e.h.Stats())
}

// A database outage is not a handler failure: the call is answered 503
// with Retry-After (the sender's retry is handled once PostgreSQL is back),
// not 500, and the outage is counted apart from handler failures.
func TestDatabaseOutageIsAnswered503WithRetryAfter(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	var proxy *pgtest.Proxy
	e := newEnv(t, func(d *pgtest.DB) *pgxpool.Pool {
		var pool *pgxpool.Pool
		proxy, pool = d.NewProxy(t)
		return pool
	}, writeEffect(&runs))
	body := []byte(`{"ride_id":7}`)

	proxy.Unreachable()
	req, err := http.NewRequest("POST", e.srv.URL, bytes.NewReader(body))
	require.NoError(t, err)
	for k, v := range sign(t, secret, "msg_outage", time.Now(), body) {
		req.Header[k] = v
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	answer, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, string(answer))
	require.NotEmpty(t, resp.Header.Get("Retry-After"))
	require.Zero(t, runs.Load(), "the handler did not run without a database")
	require.Equal(t, webhookin.Stats{Unavailable: 1}, e.h.Stats())

	proxy.Reachable()
	status, _ := e.post(t, "POST", sign(t, secret, "msg_outage", time.Now(), body), body)
	require.Equal(t, http.StatusNoContent, status)
	require.Equal(t, int64(1), runs.Load())
	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, webhookin.Stats{Handled: 1, Unavailable: 1}, e.h.Stats())
}

// A sender that retries while its first call is still running gets 204 on
// both; the handler runs once.
func TestConcurrentRetriesOfOneWebhookRunTheHandlerOnce(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	release := make(chan struct{})
	e := newEnv(t, nil, func(ctx context.Context, tx pgx.Tx, req webhookin.Request) error {
		runs.Add(1)
		<-release
		return inboxtest.WriteEffect(ctx, tx, "webhooks", req.ID, req.Body)
	})
	body := []byte(`{"ride_id":1}`)
	var wg sync.WaitGroup
	statuses := make(chan int, 5)
	for range 5 {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodPost, e.srv.URL, bytes.NewReader(body))
			for k, v := range sign(t, secret, "msg_1", time.Now(), body) {
				req.Header[k] = v
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Errorf("post: %v", err)
				return
			}
			resp.Body.Close()
			statuses <- resp.StatusCode
		})
	}
	outboxtest.Eventually(t, func() bool { return runs.Load() == 1 })
	close(release)
	wg.Wait()
	close(statuses)
	for s := range statuses {
		require.Equal(t, http.StatusNoContent, s)
	}
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, webhookin.Stats{Handled: 1, Duplicates: 4}, e.h.Stats())
}

func TestNewValidatesSecretsAndTheRedeliveryHorizon(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	in, err := inbox.New(d.Pool, &inbox.Config{Consumer: "webhooks", Retention: 24 * time.Hour})
	require.NoError(t, err)
	fn := func(context.Context, pgx.Tx, webhookin.Request) error { return nil }
	for name, cfg := range map[string]*webhookin.Config{
		"nil":          nil,
		"no secrets":   {},
		"bad secret":   {Secrets: []string{"not-a-secret"}},
		"short secret": {Secrets: []string{"whsec_" + base64.StdEncoding.EncodeToString([]byte("short"))}},
		"negative":     {Secrets: []string{secret}, MaxBodyBytes: -1},
	} {
		_, err := webhookin.New(in, fn, cfg)
		require.ErrorIs(t, err, webhookin.ErrInvalidConfig, name)
		require.ErrorIs(t, err, inbox.ErrInvalidConfig, name)
	}
	_, err = webhookin.New(in, fn, &webhookin.Config{Secrets: []string{secret}})
	require.ErrorIs(t, err, inbox.ErrRetentionTooShort, "24 h retention, 3 days of retries")
	require.ErrorContains(t, err, "RedeliveryHorizon")
	_, err = webhookin.New(in, fn, &webhookin.Config{Secrets: []string{secret}, RedeliveryHorizon: 12 * time.Hour})
	require.NoError(t, err)
	_, err = webhookin.New(in, nil, &webhookin.Config{Secrets: []string{secret}})
	require.ErrorIs(t, err, webhookin.ErrInvalidConfig)
}
