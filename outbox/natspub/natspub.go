// Package natspub publishes outbox messages to NATS JetStream.
//
// A [Publisher] sets each message's id as its Nats-Msg-Id, so JetStream drops
// a republish that arrives within the stream's duplicate window and stores
// every message exactly once.
package natspub

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/internal/fanout"
	"github.com/atomicphase/atomicphase/outbox"
)

// Config configures a Publisher. The zero value is usable; every field
// states its default.
type Config struct {
	// SubjectPrefix is prepended to a message's topic to form its subject
	// ("billing." + "invoice.paid"). Default: "", the subject is the topic.
	SubjectPrefix string

	// Streams names the JetStream streams that store the subjects this
	// publisher publishes to. Before a relay publishes through it (see
	// PrepareRelay), the publisher reads each one's duplicate window and
	// refuses to run with a window too short for the relay. Default: every
	// stream whose subjects overlap SubjectPrefix + ">"; name the streams
	// when other streams on the server overlap that too.
	Streams []string

	// MaxInFlight bounds how many messages one Publish call has awaiting
	// their acknowledgement at once. Default: MaxInFlightDefault (64).
	MaxInFlight int
}

// Publisher publishes to NATS JetStream and waits for each message's
// acknowledgement (PubAck) from the stream.
//
// Each message goes to subject SubjectPrefix+Topic with its headers and
// Nats-Msg-Id set to the message's id, a UUID unique across outboxes (so
// several installations can share a stream). A republish of a message (after a crash, or a lost acknowledgement) carries
// the same Nats-Msg-Id, so JetStream drops it as a duplicate when it arrives
// within the stream's duplicate window (Duplicates in the stream
// configuration, 2 minutes by default) of the previous one: inside that
// window a message is stored in the stream exactly once. A duplicate
// acknowledgement counts as success.
//
// While relays run, a message is published again at most the relay's
// RepublishInterval after its previous attempt (outbox.RelayLimits:
// RetryMaxDelay + 2 × PublishTimeout + PollInterval, 10m21s with the
// defaults), so the publisher refuses to run (PrepareRelay) when a stream's
// window is shorter. A republish can still come later, when every relay was
// stopped for longer than the window after a crash between acknowledgement
// and record: consumers that must be exact then deduplicate on Nats-Msg-Id.
//
// An invalid subject or a message larger than the server or stream accepts is
// a permanent failure (outbox.ErrPermanent); a missing stream or a timeout is
// retried. A publish that meets a connection that is down (closed,
// reconnecting) is outbox.Unavailable: retried without counting an attempt,
// so a broker outage of any length dead-letters nothing.
type Publisher struct {
	js  jetstream.JetStream
	cfg Config
}

// New returns a publisher on js, for example jetstream.New(nc). cfg may be
// nil for the defaults.
func New(js jetstream.JetStream, cfg *Config) (*Publisher, error) {
	if js == nil {
		return nil, fmt.Errorf("%w: nil JetStream", ErrInvalidConfig)
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	c = c.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	return &Publisher{js: js, cfg: c}, nil
}

// MaxInFlightDefault is Config.MaxInFlight's default.
const MaxInFlightDefault = 64

// withDefaults returns c with each zero field set to its default, and its
// own copy of Streams.
func (c Config) withDefaults() Config {
	c.MaxInFlight = cmp.Or(c.MaxInFlight, MaxInFlightDefault)
	c.Streams = slices.Clone(c.Streams)
	return c
}

// validate reports a field outside its documented range, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	if c.MaxInFlight < 0 {
		return fmt.Errorf("%w: negative MaxInFlight", ErrInvalidConfig)
	}
	for _, name := range c.Streams {
		if name == "" || strings.ContainsAny(name, " \t\r\n.*>") {
			return fmt.Errorf("%w: stream name %q is empty or contains whitespace, '.', '*' or '>'", ErrInvalidConfig, name)
		}
	}
	if strings.ContainsAny(c.SubjectPrefix, " \t\r\n*>") {
		return fmt.Errorf("%w: SubjectPrefix %q contains whitespace or a wildcard", ErrInvalidConfig, c.SubjectPrefix)
	}
	return nil
}

// Publish implements outbox.Publisher: it publishes msgs concurrently (they
// never share an ordering key), at most MaxInFlight at a time, and reports
// each acknowledgement as it arrives. Once ctx ends or the relay stops it
// sends no further message; it returns when every message it sent is
// acknowledged or failed.
func (p *Publisher) Publish(ctx context.Context, msgs []outbox.Envelope, res *outbox.Results) {
	fanout.Publish(ctx, msgs, res, p.cfg.MaxInFlight, p.publishOne)
}

func (p *Publisher) publishOne(ctx context.Context, e *outbox.Envelope) error {
	subject := p.cfg.SubjectPrefix + e.Topic
	if !validSubject(subject) {
		return outbox.Permanent(fmt.Errorf("nats: invalid subject %q", subject))
	}
	m := nats.NewMsg(subject)
	m.Data = e.Payload
	for k, v := range e.Headers {
		m.Header.Set(k, v)
	}
	m.Header.Set(jetstream.MsgIDHeader, e.ID.String())
	if _, err := p.js.PublishMsg(ctx, m); err != nil {
		var apiErr *jetstream.APIError
		if errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, nats.ErrBadSubject) ||
			(errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum) {
			return outbox.Permanent(err)
		}
		if p.disconnected(err) {
			return outbox.Unavailable(fmt.Errorf("natspub: connection %v: %w", p.js.Conn().Status(), err))
		}
		return err
	}
	return nil
}

// disconnected reports whether a failed publish met a connection that is
// down (closed, reconnecting or draining): an outage of the broker or of the
// way to it, which says nothing about the message. A stream that does not
// answer while connected (no stream stores the subject, or JetStream is
// unavailable on a connected server) is not one: it counts an attempt, so a
// topic with no stream is dead-lettered rather than retried for ever.
func (p *Publisher) disconnected(err error) bool {
	if errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrNoServers) ||
		errors.Is(err, nats.ErrDisconnected) || errors.Is(err, nats.ErrConnectionDraining) {
		return true
	}
	return p.js.Conn().Status() != nats.CONNECTED
}

// PrepareRelay implements outbox.Preparer: it reads the duplicate window of
// each stream (Config.Streams, or the streams that store SubjectPrefix+">")
// and returns an error matching ErrDuplicateWindow, naming both durations,
// when one is shorter than the relay's RepublishInterval. A stream that does
// not exist, or no stream at all, is an error too.
func (p *Publisher) PrepareRelay(ctx context.Context, limits outbox.RelayLimits) error {
	names, discovered := p.cfg.Streams, false
	if len(names) == 0 {
		filter := p.cfg.SubjectPrefix + ">"
		lister := p.js.StreamNames(ctx, jetstream.WithStreamListSubject(filter))
		for name := range lister.Name() {
			names = append(names, name)
		}
		if err := lister.Err(); err != nil {
			return fmt.Errorf("natspub: list streams for %q: %w", filter, err)
		}
		if len(names) == 0 {
			return fmt.Errorf("natspub: no JetStream stream stores subjects %q", filter)
		}
		discovered = true
	}
	for _, name := range names {
		stream, err := p.js.Stream(ctx, name)
		if discovered && errors.Is(err, jetstream.ErrStreamNotFound) {
			continue // deleted since it was listed: it stores nothing
		}
		if err != nil {
			return fmt.Errorf("natspub: stream %s: %w", name, err)
		}
		if window := stream.CachedInfo().Config.Duplicates; window < limits.RepublishInterval {
			return fmt.Errorf("%w: stream %s remembers message ids for %v (Duplicates), less than the relay's republish interval of %v (RetryMaxDelay + 2 x PublishTimeout + PollInterval); raise the stream's Duplicates to at least %v or lower the relay's RetryMaxDelay",
				ErrDuplicateWindow, name, window, limits.RepublishInterval, limits.RepublishInterval)
		}
	}
	return nil
}

// validSubject reports whether s is a NATS subject one can publish to:
// dot-separated non-empty tokens, no whitespace, no wildcards.
func validSubject(s string) bool {
	if s == "" || strings.ContainsAny(s, " \t\r\n\f\v") {
		return false
	}
	for tok := range strings.SplitSeq(s, ".") {
		if tok == "" || tok == "*" || tok == ">" {
			return false
		}
	}
	return true
}
