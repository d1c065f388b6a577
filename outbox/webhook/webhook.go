// Package webhook delivers outbox messages as signed HTTP POST calls.
package webhook

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/atomicphase/atomicphase/internal/fanout"
	"github.com/atomicphase/atomicphase/outbox"
)

// Headers of a webhook call.
const (
	// HeaderIdempotencyKey carries the message's id, a UUID, as an RFC 9651
	// sf-string ("\"0193...\"", as the IETF Idempotency-Key draft asks): the
	// same on every retry of a message, so receivers deduplicate on it.
	HeaderIdempotencyKey = "Idempotency-Key"
	// HeaderWebhookID carries the message's id, the UUID without quotes
	// (Standard Webhooks' webhook-id).
	HeaderWebhookID = "Webhook-Id"
	// HeaderWebhookTimestamp carries the send time in Unix seconds.
	HeaderWebhookTimestamp = "Webhook-Timestamp"
	// HeaderWebhookSignature carries the Standard Webhooks signatures, one
	// "v1,<base64>" per secret, separated by spaces (see Verify).
	HeaderWebhookSignature = "Webhook-Signature"
	// HeaderWebhookTopic carries the message's topic.
	HeaderWebhookTopic = "Webhook-Topic"
)

// Config configures a Publisher.
type Config struct {
	// URL receives one POST per message. Required; http or https.
	URL string

	// Secrets sign every call, each in Standard Webhooks form: "whsec_"
	// and the standard base64 of 24 to 64 random bytes (NewSecret makes
	// one). Required. Share them with the receiver, which checks calls with
	// Verify or any Standard Webhooks library. The call carries one
	// signature per secret: to rotate, add the new secret, move receivers
	// to it, then remove the old one.
	Secrets []string

	// Client sends the calls. Default: a client that does not follow
	// redirects (a redirect is answered as the 3xx status it is).
	Client *http.Client

	// Timeout bounds one call, from sending the request to reading the
	// response; a call that runs out of time is retried. It must not be
	// longer than the relay's publish deadline (three quarters of its
	// PublishTimeout, 7.5 s by default): outbox.New refuses a relay whose
	// deadline would cut off every call that needs the full Timeout.
	// Default: TimeoutDefault (5 seconds).
	Timeout time.Duration

	// Concurrency bounds how many calls one Publish makes at once (the
	// messages of one call never share an ordering key). Default:
	// ConcurrencyDefault (4).
	Concurrency int
}

// Publisher POSTs each message to a URL.
//
// The request body is the payload. The message's headers become request
// headers, then the publisher sets Content-Type (application/octet-stream,
// unless the message has its own), Idempotency-Key (the message id as an
// sf-string), Webhook-Topic, and the Standard Webhooks headers webhook-id
// (the message id), webhook-timestamp (Unix seconds) and webhook-signature:
//
//	v1,<base64(HMAC-SHA256(key, webhook-id + "." + webhook-timestamp + "." + body))>
//
// for each secret's key, separated by spaces.
//
// A 2xx answer is success. 408, 409, 423, 425, 429 and 5xx answers,
// timeouts and network errors are retried, no sooner than a Retry-After
// header asks (in seconds or as an HTTP date; the relay caps the wait at its
// RetryMaxDelay). A receiver that is down (a refused or failed dial, an
// unresolved name, 502 or 503) is outbox.Unavailable: retried without
// counting an attempt, so an outage dead-letters nothing. Any other answer (another 4xx, or an unfollowed 3xx) is a
// permanent failure: the relay dead-letters the message, with the status and
// the first 1 KiB of the response body in last_error.
type Publisher struct {
	url    string
	keys   [][]byte
	client *http.Client
	cfg    Config
	now    func() time.Time
}

// New returns a publisher that calls cfg.URL.
func New(cfg Config) (*Publisher, error) {
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	keys := make([][]byte, len(c.Secrets))
	for i, secret := range c.Secrets {
		keys[i], _ = parseSecret(secret) // validate checked them
	}
	c.Secrets = nil // kept only as keys
	return &Publisher{
		url:    c.URL,
		keys:   keys,
		client: c.Client,
		cfg:    c,
		now:    time.Now,
	}, nil
}

// withDefaults returns c with each zero field set to its default.
func (c Config) withDefaults() Config {
	if c.Client == nil {
		c.Client = &http.Client{
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		}
	}
	c.Timeout = cmp.Or(c.Timeout, TimeoutDefault)
	c.Concurrency = cmp.Or(c.Concurrency, ConcurrencyDefault)
	return c
}

// validate reports a missing or out-of-range field, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	u, err := url.Parse(c.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%w: URL %q is not an absolute http(s) URL", ErrInvalidConfig, c.URL)
	}
	if len(c.Secrets) == 0 {
		return fmt.Errorf("%w: no Secrets", ErrInvalidConfig)
	}
	for i, secret := range c.Secrets {
		if _, err := parseSecret(secret); err != nil {
			return fmt.Errorf("%w: Secrets[%d]: %w", ErrInvalidConfig, i, err)
		}
	}
	if c.Timeout < 0 || c.Concurrency < 0 {
		return fmt.Errorf("%w: negative Timeout or Concurrency", ErrInvalidConfig)
	}
	return nil
}

// TimeoutDefault is Config.Timeout's default, within the publish deadline of
// a relay with the default PublishTimeout.
const TimeoutDefault = 5 * time.Second

// ConcurrencyDefault is Config.Concurrency's default.
const ConcurrencyDefault = 4

// CheckRelay implements outbox.Checker: a call's Timeout must end within the
// relay's publish deadline.
func (p *Publisher) CheckRelay(limits outbox.RelayLimits) error {
	if p.cfg.Timeout > limits.PublishDeadline {
		return fmt.Errorf("webhook: Timeout %v is longer than the relay's publish deadline %v (three quarters of its PublishTimeout): lower Timeout or raise PublishTimeout",
			p.cfg.Timeout, limits.PublishDeadline)
	}
	return nil
}

// Publish implements outbox.Publisher: it calls the URL for each message,
// at most Concurrency calls at once, and reports each answer as it arrives.
// Once ctx ends or the relay stops it starts no further call; it returns
// when every call it started has been answered or has failed.
func (p *Publisher) Publish(ctx context.Context, msgs []outbox.Envelope, res *outbox.Results) {
	fanout.Publish(ctx, msgs, res, p.cfg.Concurrency, p.call)
}

func (p *Publisher) call(ctx context.Context, e *outbox.Envelope) error {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url, bytes.NewReader(e.Payload))
	if err != nil {
		return outbox.Permanent(fmt.Errorf("webhook: %w", err))
	}
	for k, v := range e.Headers {
		req.Header.Set(k, v)
	}
	if req.Header.Get("Content-Type") == "" {
		req.Header.Set("Content-Type", "application/octet-stream")
	}
	id := e.ID.String()
	ts := strconv.FormatInt(p.now().Unix(), 10)
	req.Header.Set(HeaderIdempotencyKey, `"`+id+`"`) // an RFC 9651 sf-string
	req.Header.Set(HeaderWebhookTopic, e.Topic)
	req.Header.Set(HeaderWebhookID, id)
	req.Header.Set(HeaderWebhookTimestamp, ts)
	req.Header.Set(HeaderWebhookSignature, signatureHeader(p.keys, id, ts, e.Payload))

	resp, err := p.client.Do(req)
	if err != nil {
		// Timeouts, refused connections, resets: all worth retrying. A call
		// that could not even connect says nothing about the message.
		err = fmt.Errorf("webhook: %w", err)
		if notConnected(err) {
			return outbox.Unavailable(err)
		}
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // lets the connection be reused
	code := resp.StatusCode
	if code >= 200 && code < 300 {
		return nil
	}
	err = fmt.Errorf("webhook: %s: %s", resp.Status, body)
	if !retryable(code) {
		return outbox.Permanent(err)
	}
	if d, ok := parseRetryAfter(resp.Header.Get("Retry-After"), p.now()); ok {
		err = outbox.RetryAfter(err, d)
	}
	if code == http.StatusBadGateway || code == http.StatusServiceUnavailable {
		// The receiver (or the gateway before it) is down, not refusing
		// this message: an outage must not dead-letter what it delays.
		return outbox.Unavailable(err)
	}
	return err
}

// notConnected reports whether a call failed before a connection to the
// receiver was made: the dial was refused or timed out, or the name did not
// resolve. Nothing was sent.
func notConnected(err error) bool {
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return true
	}
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// maxErrorBody is how much of a failed call's response body its error, and
// so the message's last_error, keeps.
const maxErrorBody = 1024

// retryable reports whether an answer other than 2xx is worth another
// attempt: a timeout (408), a conflict with a request still in flight,
// as an idempotent receiver answers while an earlier delivery of the same
// Idempotency-Key runs (409), a locked resource (423), a request that came
// too early (425), rate limiting (429), and every server error (5xx).
func retryable(code int) bool {
	switch code {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusLocked,
		http.StatusTooEarly, http.StatusTooManyRequests:
		return true
	}
	return code >= 500 && code < 600
}

// parseRetryAfter reads a Retry-After header (RFC 9110): delay-seconds or
// an HTTP date, which it turns into a wait from now.
func parseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if secs, err := strconv.ParseUint(v, 10, 63); err == nil {
		return time.Duration(min(secs, uint64(math.MaxInt64/time.Second))) * time.Second, true
	}
	if at, err := http.ParseTime(v); err == nil {
		return max(at.Sub(now), 0), true
	}
	return 0, false
}
