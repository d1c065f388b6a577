// Package webhookin receives webhooks through an inbox: an http.Handler
// that verifies Standard Webhooks signatures, handles each webhook-id once
// in the inbox's transaction, and answers 2xx only after that transaction
// committed, so that a sender's retry (after a timeout, a lost answer, a
// 5xx) is answered 2xx without running the handler again.
package webhookin

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/outbox/webhook"
)

// RedeliveryHorizonDefault is Config.RedeliveryHorizon's default: Stripe
// retries a webhook for up to three days. The outbox's relay, with its
// defaults, retries for about ten minutes (10 attempts, the waits doubling
// from 1 second), but a dead-lettered message can be redriven while the
// outbox keeps it (7 days by default): set the horizon, and the inbox's
// Retention, to cover a redrive if you do them.
const RedeliveryHorizonDefault = 3 * 24 * time.Hour

// MaxBodyBytesDefault is Config.MaxBodyBytes's default: the outbox's
// largest payload by default.
const MaxBodyBytesDefault = 1 << 20

// Config configures a Handler. Secrets is required; every other field has
// a default.
type Config struct {
	// Secrets are the Standard Webhooks secrets ("whsec_" and base64, as
	// webhook.NewSecret makes) a call may be signed with: one, or several
	// while one is rotated. Required.
	Secrets []string

	// RedeliveryHorizon is how long after a webhook was first delivered the
	// sender may deliver it again (retries, redrives). The inbox's Retention
	// must be longer: New refuses otherwise (inbox.ErrRetentionTooShort).
	// Default: RedeliveryHorizonDefault (3 days).
	RedeliveryHorizon time.Duration

	// MaxBodyBytes is the largest body accepted; a larger one is answered
	// 413. Default: MaxBodyBytesDefault (1 MiB).
	MaxBodyBytes int64

	// Logger receives rejected calls (INFO) and handler failures (WARN).
	// Default: the inbox's logger.
	Logger *slog.Logger
}

// withDefaults returns c with each zero field set to its default; the
// logger defaults to the inbox's.
func (c Config) withDefaults(in *inbox.Inbox) Config {
	c.Secrets = slices.Clone(c.Secrets)
	c.RedeliveryHorizon = cmp.Or(c.RedeliveryHorizon, RedeliveryHorizonDefault)
	c.MaxBodyBytes = cmp.Or(c.MaxBodyBytes, MaxBodyBytesDefault)
	c.Logger = cmp.Or(c.Logger, in.Config().Logger)
	return c
}

// validate reports a field outside its documented range, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	switch {
	case len(c.Secrets) == 0:
		return fmt.Errorf("%w: no Secrets", ErrInvalidConfig)
	case c.RedeliveryHorizon < 0, c.MaxBodyBytes < 0:
		return fmt.Errorf("%w: negative RedeliveryHorizon or MaxBodyBytes", ErrInvalidConfig)
	}
	// Verify checks the secrets before the call: a malformed one is
	// reported as a configuration error.
	if err := webhook.Verify(http.Header{}, nil, time.Now(), c.Secrets...); errors.Is(err, webhook.ErrInvalidConfig) {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return nil
}

// Request is a verified webhook call as a Func sees it.
type Request struct {
	// ID is the call's webhook-id: the outbox message's id for calls from
	// atomicphase's webhook publisher.
	ID string
	// Topic is the call's Webhook-Topic header ("" when absent).
	Topic string
	// Timestamp is the call's webhook-timestamp.
	Timestamp time.Time
	// Header holds the call's headers.
	Header http.Header
	// Body is the call's body, as signed.
	Body []byte
}

// Func writes a webhook's effects through tx; see inbox.Func. It may run
// more than once for a webhook (after a serialization failure, or on a
// retry after it failed) until one run commits, and never after that.
type Func func(ctx context.Context, tx pgx.Tx, req Request) error

// Stats counts what a Handler did since it was created.
type Stats struct {
	Handled    uint64 // calls answered 204 after the handler committed
	Duplicates uint64 // calls answered 204 without running the handler (webhook-id seen before)
	Rejected   uint64 // calls refused before any SQL: bad method, body, signature or id
	Failed     uint64 // calls answered 409, 500 or 503 after the handler failed or was cut short
	// Unavailable counts calls answered 503 because PostgreSQL could not be
	// reached or would not write (inbox.ErrUnavailable): not handler
	// failures; the sender's retry is handled once the database is back.
	Unavailable uint64
}

// Handler is an http.Handler that receives webhooks through an inbox.
type Handler struct {
	in      *inbox.Inbox
	fn      Func
	secrets []string
	cfg     Config
	log     *slog.Logger
	now     func() time.Time

	handled, duplicates, rejected, failed, unavailable atomic.Uint64
}

// New returns a Handler that runs fn for each verified webhook, through
// in. It checks the secrets, and that the inbox's Retention outlasts
// cfg.RedeliveryHorizon.
func New(in *inbox.Inbox, fn Func, cfg *Config) (*Handler, error) {
	switch {
	case in == nil:
		return nil, fmt.Errorf("webhookin: new: %w: nil inbox", ErrInvalidConfig)
	case fn == nil:
		return nil, fmt.Errorf("webhookin: new: %w: nil func", ErrInvalidConfig)
	case cfg == nil:
		return nil, fmt.Errorf("webhookin: new: %w: no Secrets", ErrInvalidConfig)
	}
	c := cfg.withDefaults(in)
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("webhookin: new: %w", err)
	}
	if err := in.CheckHorizon(c.RedeliveryHorizon, "the webhook sender (webhookin.Config.RedeliveryHorizon)"); err != nil {
		return nil, fmt.Errorf("webhookin: new: %w", err)
	}
	return &Handler{in: in, fn: fn, secrets: c.Secrets, cfg: c, log: c.Logger, now: time.Now}, nil
}

// Stats returns the handler's counters.
func (h *Handler) Stats() Stats {
	return Stats{Handled: h.handled.Load(), Duplicates: h.duplicates.Load(), Rejected: h.rejected.Load(),
		Failed: h.failed.Load(), Unavailable: h.unavailable.Load()}
}

// ServeHTTP receives one webhook call. Before any SQL it answers 405 to a
// method other than POST, 413 to a body over MaxBodyBytes, and 400 to a
// call whose Standard Webhooks signature does not verify (missing headers,
// no signature by any of the secrets, a timestamp more than
// webhook.Tolerance from now) or whose webhook-id is not a valid message id
// (see inbox.ValidateMessageID). A verified call is handled through the
// inbox with webhook-id as the message id, and answered:
//
//   - 204 once the handler's writes committed, or at once when the
//     webhook-id was handled before (the handler does not run again);
//   - 409 with Retry-After when its transaction kept conflicting
//     (inbox.ErrConflict), 503 with Retry-After when the database could not
//     be reached or would not write (inbox.ErrUnavailable: an outage or a
//     failover, not the handler's failure), 503 when the call was cut
//     short, and 500 when the handler failed: nothing was written, and the
//     sender's retry is handled.
//
// Senders retry 409 and 5xx (atomicphase's webhook publisher does).
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		h.reject(w, r, http.StatusMethodNotAllowed, "method not allowed", "method "+r.Method)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, h.cfg.MaxBodyBytes+1))
	if err != nil {
		h.failed.Add(1)
		h.problem(w, http.StatusBadRequest, "unreadable body")
		return
	}
	if int64(len(body)) > h.cfg.MaxBodyBytes {
		h.reject(w, r, http.StatusRequestEntityTooLarge, "body too large", fmt.Sprintf("more than %d bytes", h.cfg.MaxBodyBytes))
		return
	}
	if err := webhook.Verify(r.Header, body, h.now(), h.secrets...); err != nil {
		h.reject(w, r, http.StatusBadRequest, "invalid signature", err.Error())
		return
	}
	id := r.Header.Get(webhook.HeaderWebhookID)
	if err := inbox.ValidateMessageID(id); err != nil {
		h.reject(w, r, http.StatusBadRequest, "invalid webhook-id", err.Error())
		return
	}
	ts, _ := strconv.ParseInt(r.Header.Get(webhook.HeaderWebhookTimestamp), 10, 64) // verified above
	req := Request{ID: id, Topic: r.Header.Get(webhook.HeaderWebhookTopic), Timestamp: time.Unix(ts, 0),
		Header: r.Header.Clone(), Body: body}
	out, err := h.in.Handle(r.Context(), id, func(ctx context.Context, tx pgx.Tx) error { return h.fn(ctx, tx, req) })
	if err == nil {
		if out == inbox.Duplicate {
			h.duplicates.Add(1)
		} else {
			h.handled.Add(1)
		}
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if errors.Is(err, inbox.ErrUnavailable) && r.Context().Err() == nil {
		h.unavailable.Add(1)
		w.Header().Set("Retry-After", "2")
		h.problem(w, http.StatusServiceUnavailable, "database unavailable, retry")
		h.log.WarnContext(r.Context(), "webhookin: database unavailable; the sender's retry will be handled",
			"inbox_consumer", h.in.Config().Consumer, "webhook_id", id, "topic", req.Topic, "error", err)
		return
	}
	h.failed.Add(1)
	switch {
	case errors.Is(err, inbox.ErrConflict):
		w.Header().Set("Retry-After", "1")
		h.problem(w, http.StatusConflict, "conflict, retry")
	case r.Context().Err() != nil:
		h.problem(w, http.StatusServiceUnavailable, "request cut short, retry")
		return // the caller went away: nothing to log
	default:
		h.problem(w, http.StatusInternalServerError, "handler failed, retry")
	}
	h.log.WarnContext(r.Context(), "webhookin: handler failed; the sender's retry will be handled",
		"inbox_consumer", h.in.Config().Consumer, "webhook_id", id, "topic", req.Topic, "error", err)
}

// reject answers a call refused before any SQL.
func (h *Handler) reject(w http.ResponseWriter, r *http.Request, status int, title, detail string) {
	h.rejected.Add(1)
	h.log.InfoContext(r.Context(), "webhookin: call rejected", "status", status, "reason", title, "detail", detail,
		"remote_addr", r.RemoteAddr)
	h.problem(w, status, title)
}

// problem writes an application/problem+json answer that names the
// problem and nothing about the server's internals.
func (h *Handler) problem(w http.ResponseWriter, status int, title string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_, _ = fmt.Fprintf(w, `{"title":%q,"status":%d}`+"\n", title, status)
}
