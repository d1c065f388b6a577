package outbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/internal/fanout"
)

// NATSConfig configures a NATSPublisher. The zero value is usable; every
// field states its default.
type NATSConfig struct {
	// SubjectPrefix is prepended to a message's topic to form its subject
	// ("billing." + "invoice.paid"). Default: "", the subject is the topic.
	SubjectPrefix string

	// MsgIDPrefix is prepended to the message id in the Nats-Msg-Id header.
	// Set it when several outbox tables (several databases or schemas)
	// publish into one stream, whose ids would otherwise collide and be
	// dropped as duplicates. Default: "", the header is the decimal id.
	MsgIDPrefix string

	// MaxInFlight bounds how many messages one Publish call has awaiting
	// their acknowledgement at once. Default: 64.
	MaxInFlight int
}

// NATSPublisher publishes to NATS JetStream and waits for each message's
// acknowledgement (PubAck) from the stream.
//
// Each message goes to subject SubjectPrefix+Topic with its headers and
// Nats-Msg-Id set to MsgIDPrefix plus the message id in decimal ("42"). A
// republish of a message (after a crash, or a lost acknowledgement) carries
// the same Nats-Msg-Id, so JetStream drops it as a duplicate when it arrives
// within the stream's duplicate window (Duplicates in the stream
// configuration, 2 minutes by default): inside that window a message is
// stored in the stream exactly once. A duplicate acknowledgement counts as
// success. A republish comes at the latest RetryMaxDelay plus PublishTimeout
// after the first attempt (sooner after a crash, once a relay runs again), so
// a window longer than that keeps the stream free of duplicates; consumers
// that must also survive republishes outside the window deduplicate on
// Nats-Msg-Id.
//
// An invalid subject or a message larger than the server or stream accepts is
// a permanent failure (ErrPermanent); a missing stream, a timeout or a
// disconnection is retried.
type NATSPublisher struct {
	js  jetstream.JetStream
	cfg NATSConfig
}

// NewNATSPublisher returns a publisher on js, for example
// jetstream.New(nc). cfg may be nil for the defaults.
func NewNATSPublisher(js jetstream.JetStream, cfg *NATSConfig) (*NATSPublisher, error) {
	if js == nil {
		return nil, fmt.Errorf("%w: nil JetStream", ErrInvalidConfig)
	}
	var c NATSConfig
	if cfg != nil {
		c = *cfg
	}
	if c.MaxInFlight < 0 {
		return nil, fmt.Errorf("%w: negative MaxInFlight", ErrInvalidConfig)
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 64
	}
	if strings.ContainsAny(c.SubjectPrefix, " \t\r\n*>") {
		return nil, fmt.Errorf("%w: SubjectPrefix %q contains whitespace or a wildcard", ErrInvalidConfig, c.SubjectPrefix)
	}
	if !validHeaderValue(c.MsgIDPrefix) {
		return nil, fmt.Errorf("%w: MsgIDPrefix %q contains a control character", ErrInvalidConfig, c.MsgIDPrefix)
	}
	return &NATSPublisher{js: js, cfg: c}, nil
}

// MsgID returns the Nats-Msg-Id this publisher gives the message with id.
func (p *NATSPublisher) MsgID(id int64) string {
	return p.cfg.MsgIDPrefix + strconv.FormatInt(id, 10)
}

// Publish implements Publisher: it publishes msgs concurrently (they never
// share an ordering key) and returns when every one is acknowledged or failed.
func (p *NATSPublisher) Publish(ctx context.Context, msgs []Envelope) []error {
	return fanout.Each(ctx, msgs, p.cfg.MaxInFlight, p.publishOne)
}

func (p *NATSPublisher) publishOne(ctx context.Context, e *Envelope) error {
	subject := p.cfg.SubjectPrefix + e.Topic
	if !validSubject(subject) {
		return Permanent(fmt.Errorf("nats: invalid subject %q", subject))
	}
	m := nats.NewMsg(subject)
	m.Data = e.Payload
	for k, v := range e.Headers {
		m.Header.Set(k, v)
	}
	m.Header.Set(jetstream.MsgIDHeader, p.MsgID(e.ID))
	if _, err := p.js.PublishMsg(ctx, m); err != nil {
		var apiErr *jetstream.APIError
		if errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, nats.ErrBadSubject) ||
			(errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum) {
			return Permanent(err)
		}
		return err
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

func validHeaderValue(s string) bool { return !hasControl(s, true) }
