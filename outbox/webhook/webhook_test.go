package webhook_test

import (
	"context"
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/internal/outboxtest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/webhook"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// testSecret signs the test calls; the receivers check them with the
// Standard Webhooks reference library and with Verify.
var testSecret = webhook.NewSecret()

// receivedCall is what a test webhook receiver saw.
type receivedCall struct {
	header http.Header
	body   string
	// referenceError is what the Standard Webhooks reference library's
	// verifier said of the call, verifyError what Verify said.
	referenceError, verifyError error
}

// receiver is an httptest server that verifies signatures and answers as
// answer says (204 without it).
type receiver struct {
	*httptest.Server
	mu     sync.Mutex
	calls  []receivedCall
	answer func(call int, w http.ResponseWriter, r *http.Request)
}

func newReceiver(t *testing.T, answer func(call int, w http.ResponseWriter, r *http.Request)) *receiver {
	reference, err := standardwebhooks.NewWebhook(testSecret)
	require.NoError(t, err)
	rcv := &receiver{answer: answer}
	rcv.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		rcv.mu.Lock()
		rcv.calls = append(rcv.calls, receivedCall{
			header:         r.Header.Clone(),
			body:           string(body),
			referenceError: reference.Verify(body, r.Header),
			verifyError:    webhook.Verify(r.Header, body, time.Now(), testSecret),
		})
		n := len(rcv.calls)
		rcv.mu.Unlock()
		if rcv.answer != nil {
			rcv.answer(n, w, r)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(rcv.Close)
	return rcv
}

func (rcv *receiver) received() []receivedCall {
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	return append([]receivedCall(nil), rcv.calls...)
}

func newWebhook(t *testing.T, url string, timeout time.Duration) *webhook.Publisher {
	t.Helper()
	p, err := webhook.New(webhook.Config{URL: url, Secrets: []string{testSecret}, Timeout: timeout})
	require.NoError(t, err)
	return p
}

// A relayed webhook call carries the payload as body, the message id as
// Idempotency-Key, the topic, the message's headers, and a signature the
// receiver verifies with the shared secret.
func TestWebhookDeliversSignedCall(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	rcv := newReceiver(t, nil)
	outboxtest.Enqueue(t, d.Pool, outbox.Message{
		Topic:   "invoice.paid",
		Payload: []byte(`{"invoice":"in_1"}`),
		Headers: map[string]string{"Content-Type": "application/json", "X-Trace": "t-1"},
	})
	r := outboxtest.NewRelay(t, d.Pool, newWebhook(t, rcv.URL, 0), outbox.Config{})
	require.Equal(t, 1, outboxtest.Drain(t, r))

	calls := rcv.received()
	require.Len(t, calls, 1)
	c := calls[0]
	require.NoError(t, c.referenceError, "the Standard Webhooks reference verifier accepts the call")
	require.NoError(t, c.verifyError)
	require.Equal(t, `{"invoice":"in_1"}`, c.body)
	var id string
	require.NoError(t, d.Pool.QueryRow(context.Background(), "SELECT message_id::text FROM outbox_messages").Scan(&id))
	require.Equal(t, `"`+id+`"`, c.header.Get(webhook.HeaderIdempotencyKey), "the message id as an sf-string")
	key, err := httpidem.ParseKey(c.header.Get(webhook.HeaderIdempotencyKey))
	require.NoError(t, err)
	require.Equal(t, id, key, "as an idempotent receiver reads it")
	require.Equal(t, "invoice.paid", c.header.Get(webhook.HeaderWebhookTopic))
	require.Equal(t, "application/json", c.header.Get("Content-Type"))
	require.Equal(t, "t-1", c.header.Get("X-Trace"))
	ts, err := strconv.ParseInt(c.header.Get(webhook.HeaderWebhookTimestamp), 10, 64)
	require.NoError(t, err)
	require.InDelta(t, time.Now().Unix(), ts, 300)
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NOT NULL"))
}

// Every status the receiver can answer, one case each. 2xx is success.
// 408, 409, 423, 425, 429 and 5xx are retried: the message is published
// once the receiver accepts, with the failed answer's status in last_error.
// Any other answer, other 4xx and an unfollowed 3xx, dead-letters the
// message at once, keeping the status and the first 1 KiB of the body.
func TestWebhookStatusHandling(t *testing.T) {
	t.Parallel()
	body := strings.Repeat("~", 1024) + strings.Repeat("^", 3000) // only the ~ are kept
	cases := []struct {
		status int
		retry  bool
	}{
		{http.StatusOK, false}, {http.StatusAccepted, false}, {http.StatusNoContent, false},
		{http.StatusMovedPermanently, false}, {http.StatusFound, false}, {http.StatusTemporaryRedirect, false},
		{http.StatusBadRequest, false}, {http.StatusUnauthorized, false}, {http.StatusForbidden, false},
		{http.StatusNotFound, false}, {http.StatusMethodNotAllowed, false}, {http.StatusNotAcceptable, false},
		{http.StatusGone, false}, {http.StatusRequestEntityTooLarge, false},
		{http.StatusUnsupportedMediaType, false}, {http.StatusUnprocessableEntity, false},
		{http.StatusRequestTimeout, true}, {http.StatusConflict, true}, {http.StatusLocked, true},
		{http.StatusTooEarly, true}, {http.StatusTooManyRequests, true},
		{http.StatusInternalServerError, true}, {http.StatusNotImplemented, true},
		{http.StatusBadGateway, true}, {http.StatusServiceUnavailable, true}, // the receiver is down: no attempt counted
		{http.StatusGatewayTimeout, true}, {599, true},
	}
	for _, tc := range cases {
		t.Run(strconv.Itoa(tc.status), func(t *testing.T) {
			t.Parallel()
			d := pgtest.New(t)
			rcv := newReceiver(t, func(call int, w http.ResponseWriter, r *http.Request) {
				if call > 1 {
					w.WriteHeader(http.StatusNoContent)
					return
				}
				if tc.status/100 == 3 {
					w.Header().Set("Location", "/elsewhere")
				}
				w.WriteHeader(tc.status)
				_, _ = io.WriteString(w, body)
			})
			outboxtest.Enqueue(t, d.Pool, outbox.Message{Topic: "t", Payload: []byte("x")})
			r := outboxtest.NewRelay(t, d.Pool, newWebhook(t, rcv.URL, 0), outbox.Config{MaxAttempts: 5})
			outboxtest.Eventually(t, func() bool {
				_, err := r.RunOnce(context.Background())
				require.NoError(t, err)
				return d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NULL AND dead_at IS NULL") == 0
			})
			var (
				attempts  int
				published bool
				lastError *string
			)
			require.NoError(t, d.Pool.QueryRow(context.Background(),
				"SELECT attempts, published_at IS NOT NULL, last_error FROM outbox_messages").Scan(&attempts, &published, &lastError))
			calls := attempts
			switch {
			case tc.status/100 == 2:
				require.True(t, published)
				require.Equal(t, 1, attempts)
				require.Nil(t, lastError)
			case tc.status == http.StatusBadGateway || tc.status == http.StatusServiceUnavailable:
				require.True(t, published, "retried until accepted")
				require.Equal(t, 1, attempts, "an unavailable receiver costs the message no attempt")
				require.NotNil(t, lastError)
				require.Contains(t, *lastError, strconv.Itoa(tc.status))
				calls = 2
			case tc.retry:
				require.True(t, published, "retried until accepted")
				require.Equal(t, 2, attempts)
				require.NotNil(t, lastError)
				require.Contains(t, *lastError, strconv.Itoa(tc.status))
			default:
				require.False(t, published, "dead-lettered")
				require.Equal(t, 1, attempts)
				require.NotNil(t, lastError)
				require.Contains(t, *lastError, strconv.Itoa(tc.status))
				require.Contains(t, *lastError, body[:1024])
				require.NotContains(t, *lastError, "^", "only the first 1 KiB of the body")
			}
			require.Len(t, rcv.received(), calls)
		})
	}
}

// A receiver that is down (nothing listens on its address) is an outage,
// not the message's failure: however many tries it lasts, and with
// MaxAttempts 1, nothing is dead-lettered, and the message is delivered
// once the receiver is back on the same address.
func TestWebhookReceiverDownDeadLettersNothing(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // down: dials are refused
	outboxtest.Enqueue(t, d.Pool, outbox.Message{Topic: "t", Payload: []byte("x")})
	r := outboxtest.NewRelay(t, d.Pool, newWebhook(t, "http://"+addr+"/hook", 0),
		outbox.Config{MaxAttempts: 1, RetryBaseDelay: time.Millisecond, RetryMaxDelay: time.Millisecond})
	outboxtest.Eventually(t, func() bool {
		_, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		stats, err := r.Stats(context.Background())
		require.NoError(t, err)
		return stats.Unavailable >= 3
	})
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages
		WHERE attempts = 0 AND dead_at IS NULL AND published_at IS NULL AND last_error LIKE '%refused%'`))

	ln, err = net.Listen("tcp", addr)
	require.NoError(t, err)
	var calls atomic.Int64
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.WriteHeader(http.StatusNoContent)
	}), ReadHeaderTimeout: time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	outboxtest.Eventually(t, func() bool {
		_, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		return d.Count(t, `SELECT count(*) FROM outbox_messages WHERE published_at IS NOT NULL`) == 1
	})
	require.Equal(t, int64(1), calls.Load())
	require.Zero(t, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL`))
}

// Retry-After, in seconds or as an HTTP date, sets the wait before the next
// attempt when it is longer than the relay's own backoff, capped by
// RetryMaxDelay.
func TestWebhookHonoursRetryAfter(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name           string
		retryAfter     func(now time.Time) string
		retryBaseDelay time.Duration // the first backoff is between half of it and it
		retryMaxDelay  time.Duration
		least, most    time.Duration
	}{
		{"seconds", func(time.Time) string { return "3" }, 100 * time.Millisecond, time.Hour, 2500 * time.Millisecond, 3 * time.Second},
		{"HTTP date", func(now time.Time) string { return now.Add(5 * time.Second).UTC().Format(http.TimeFormat) },
			100 * time.Millisecond, time.Hour, 3500 * time.Millisecond, 5 * time.Second},
		{"capped by RetryMaxDelay", func(time.Time) string { return "3600" }, 100 * time.Millisecond, 2 * time.Second, 1500 * time.Millisecond, 2 * time.Second},
		{"shorter than the backoff", func(time.Time) string { return "1" }, 10 * time.Second, time.Hour, 4500 * time.Millisecond, 10 * time.Second},
		{"unparsable: the backoff", func(time.Time) string { return "soon" }, 100 * time.Millisecond, time.Hour, 0, 100 * time.Millisecond},
	}
	// 429 counts an attempt; 503 (the receiver is down) does not, and its
	// Retry-After is honoured all the same.
	for _, status := range []struct{ code, attempts int }{{http.StatusTooManyRequests, 1}, {http.StatusServiceUnavailable, 0}} {
		for _, tc := range cases {
			t.Run(strconv.Itoa(status.code)+" "+tc.name, func(t *testing.T) {
				t.Parallel()
				d := pgtest.New(t)
				rcv := newReceiver(t, func(call int, w http.ResponseWriter, r *http.Request) {
					w.Header().Set("Retry-After", tc.retryAfter(time.Now()))
					w.WriteHeader(status.code)
				})
				outboxtest.Enqueue(t, d.Pool, outbox.Message{Topic: "t", Payload: []byte("x")})
				r := outboxtest.NewRelay(t, d.Pool, newWebhook(t, rcv.URL, 0), outbox.Config{
					RetryBaseDelay: tc.retryBaseDelay, RetryMaxDelay: tc.retryMaxDelay,
				})
				_, err := r.RunOnce(context.Background())
				require.NoError(t, err)
				var wait float64
				require.NoError(t, d.Pool.QueryRow(context.Background(),
					"SELECT extract(epoch FROM available_at - now()) FROM outbox_messages WHERE attempts = $1 AND last_error IS NOT NULL",
					status.attempts).Scan(&wait))
				got := time.Duration(wait * float64(time.Second))
				require.GreaterOrEqual(t, got, tc.least)
				require.LessOrEqual(t, got, tc.most)
			})
		}
	}
}

// A receiver that does not answer within the timeout fails the attempt,
// which is retried and then succeeds.
func TestWebhookTimeoutIsRetried(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	var stalled atomic.Bool
	rcv := newReceiver(t, func(call int, w http.ResponseWriter, r *http.Request) {
		if call == 1 {
			stalled.Store(true)
			<-r.Context().Done() // hangs until the publisher gives up
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	outboxtest.Enqueue(t, d.Pool, outbox.Message{Topic: "t", Payload: []byte("slow")})
	r := outboxtest.NewRelay(t, d.Pool, newWebhook(t, rcv.URL, 150*time.Millisecond), outbox.Config{})

	n, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, n)
	require.True(t, stalled.Load())
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages
		WHERE attempts = 1 AND published_at IS NULL AND dead_at IS NULL AND last_error LIKE '%deadline exceeded%'`))
	outboxtest.Eventually(t, func() bool {
		n, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		return n == 1
	})
	require.Len(t, rcv.received(), 2)
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE attempts = 2 AND published_at IS NOT NULL"))
}

// New validates its configuration.
func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	for _, cfg := range []webhook.Config{
		{URL: "", Secrets: []string{testSecret}},
		{URL: "ftp://example.invalid/hook", Secrets: []string{testSecret}},
		{URL: "/relative", Secrets: []string{testSecret}},
		{URL: "http://127.0.0.1/hook"},
		{URL: "http://127.0.0.1/hook", Secrets: []string{testSecret}, Timeout: -1},
		{URL: "http://127.0.0.1/hook", Secrets: []string{}},
		{URL: "http://127.0.0.1/hook", Secrets: []string{testSecret, ""}},
		{URL: "http://127.0.0.1/hook", Secrets: []string{strings.TrimPrefix(testSecret, webhook.SecretPrefix)}},
		{URL: "http://127.0.0.1/hook", Secrets: []string{"whsec_not base64!"}},
		{URL: "http://127.0.0.1/hook", Secrets: []string{"whsec_" + base64.StdEncoding.EncodeToString(make([]byte, 16))}},
		{URL: "http://127.0.0.1/hook", Secrets: []string{"whsec_" + base64.StdEncoding.EncodeToString(make([]byte, 65))}},
	} {
		_, err := webhook.New(cfg)
		require.ErrorIs(t, err, webhook.ErrInvalidConfig, "%+v", cfg)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%+v", cfg)
	}
	p, err := webhook.New(webhook.Config{URL: "http://127.0.0.1/hook", Secrets: []string{testSecret}})
	require.NoError(t, err)
	c := webhook.ConfigOf(p)
	require.Equal(t, 5*time.Second, c.Timeout)
	require.Equal(t, webhook.TimeoutDefault, c.Timeout)
	require.Equal(t, 4, c.Concurrency)
	require.Equal(t, webhook.ConcurrencyDefault, c.Concurrency)
	require.NotNil(t, c.Client)
	require.Nil(t, c.Secrets, "kept only as keys")
}

// With one call at a time, a receiver that hangs on one message until the
// publish deadline costs the message queued behind it nothing: that one is
// not sent, keeps its attempt count, and goes out with the next batch.
func TestWebhookQueuedCallIsNotChargedForASlowOne(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	rcv := newReceiver(t, func(call int, w http.ResponseWriter, r *http.Request) {
		if call == 1 {
			<-r.Context().Done() // hangs until the publisher gives up
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	outboxtest.Enqueue(t, d.Pool, outbox.Message{Topic: "t", Payload: []byte("slow")}, outbox.Message{Topic: "t", Payload: []byte("queued")})
	pub, err := webhook.New(webhook.Config{URL: rcv.URL, Secrets: []string{testSecret}, Concurrency: 1, Timeout: 1500 * time.Millisecond})
	require.NoError(t, err)
	r := outboxtest.NewRelay(t, d.Pool, pub, outbox.Config{PublishTimeout: 2 * time.Second})
	n, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, n)
	require.Len(t, rcv.received(), 1)
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE payload = 'slow' AND attempts = 1 AND last_error IS NOT NULL"))
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE payload = 'queued' AND attempts = 0 AND last_error IS NULL"))
	outboxtest.Eventually(t, func() bool {
		_, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		return d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NULL") == 0
	})
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE payload = 'queued' AND attempts = 1"))
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE payload = 'slow' AND attempts = 2"))
}

// The defaults fit together, and a relay whose publish deadline is shorter
// than the webhook's own timeout (so that every call needing the full
// timeout would be cut off and, in the end, dead-lettered) is refused.
func TestRelayRefusesWebhookTimeoutLongerThanItsPublishDeadline(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	defaults, err := webhook.New(webhook.Config{URL: "http://127.0.0.1/hook", Secrets: []string{testSecret}})
	require.NoError(t, err)
	_, err = outbox.New(d.Pool, defaults, nil)
	require.NoError(t, err, "the default timeout fits the default publish deadline")

	slow, err := webhook.New(webhook.Config{URL: "http://127.0.0.1/hook", Secrets: []string{testSecret}, Timeout: 10 * time.Second})
	require.NoError(t, err)
	_, err = outbox.New(d.Pool, slow, &outbox.Config{PublishTimeout: 10 * time.Second})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "10s")
	require.ErrorContains(t, err, "7.5s")
	_, err = outbox.New(d.Pool, slow, &outbox.Config{PublishTimeout: 40 * time.Second / 3})
	require.NoError(t, err, "a deadline of exactly the timeout fits")
}
