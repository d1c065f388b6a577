package outbox

import (
	"encoding/json"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
)

// MaxPayloadBytes is the largest payload Enqueue accepts; a larger one fails
// with ErrPayloadTooLarge. Default: 1 MiB. Set it once at program start,
// before any Enqueue; brokers have limits of their own (NATS: 1 MiB by
// default), and large payloads make every relay batch heavier.
var MaxPayloadBytes = 1 << 20

// Limits on a message's topic and ordering key, in bytes.
const (
	MaxTopicBytes       = 1024
	MaxOrderingKeyBytes = 1024
)

// Message is one message to stage with Enqueue.
type Message struct {
	// Topic names the destination: the NATS subject (after the publisher's
	// prefix), or a header of the webhook call. Required.
	Topic string

	// OrderingKey, when not empty, puts the message in a sequence: messages
	// with the same ordering key are published in the order their
	// transactions committed, one at a time, and a message that fails holds
	// back the key's later messages until it is published or dead-lettered.
	// Use the entity the messages are about ("order:1234"). Messages without
	// one are published independently, as soon as possible.
	OrderingKey string

	// Payload is the message body, published as is. At most MaxPayloadBytes.
	Payload []byte

	// Headers are published with the message (NATS headers, HTTP headers of
	// a webhook call). Names must be HTTP tokens; values must be valid UTF-8
	// without control characters other than tab. The publishers' own headers
	// (Nats-Msg-Id, Idempotency-Key, Webhook-*) take precedence.
	Headers map[string]string

	// Delay postpones the message's first publish by this long after the
	// commit, by the database clock. A delayed message with an ordering key
	// also delays the key's later messages. Default: 0, publish at once.
	Delay time.Duration
}

// Envelope is a staged message as the relay hands it to a Publisher.
type Envelope struct {
	// ID is the message's globally unique id, a UUIDv7 drawn when the
	// message was staged: the same on every publish of the message, and
	// never given to another, in this outbox or any other, even after a
	// restore or a failover. Brokers and receivers deduplicate on it (it is
	// the NATS Nats-Msg-Id and the webhook Idempotency-Key).
	ID uuid.UUID
	// RowID is the message's row id in the outbox table (outbox_messages.id),
	// for finding it there. It is unique only within that table.
	RowID int64
	// Topic, OrderingKey, Payload and Headers are as enqueued.
	Topic       string
	OrderingKey string
	Payload     []byte
	Headers     map[string]string
	// Attempt counts publish attempts, starting at 1.
	Attempt int
	// CreatedAt is when the message was staged, by the database clock.
	CreatedAt time.Time
}

// validate checks msgs[i] and returns its headers encoded as a JSON object.
func validate(i int, m *Message) (string, error) {
	switch {
	case m.Topic == "":
		return "", invalid(ErrInvalidTopic, i, "topic is empty")
	case len(m.Topic) > MaxTopicBytes:
		return "", invalid(ErrInvalidTopic, i, "topic is %d bytes, more than %d", len(m.Topic), MaxTopicBytes)
	case !utf8.ValidString(m.Topic) || hasControl(m.Topic, false):
		return "", invalid(ErrInvalidTopic, i, "topic %q is not UTF-8 text without control characters", m.Topic)
	case len(m.OrderingKey) > MaxOrderingKeyBytes:
		return "", invalid(ErrInvalidMessage, i, "ordering key is %d bytes, more than %d", len(m.OrderingKey), MaxOrderingKeyBytes)
	case !utf8.ValidString(m.OrderingKey) || strings.IndexByte(m.OrderingKey, 0) >= 0:
		return "", invalid(ErrInvalidMessage, i, "ordering key %q is not UTF-8 text without NUL", m.OrderingKey)
	case len(m.Payload) > MaxPayloadBytes:
		return "", invalid(ErrPayloadTooLarge, i, "payload is %d bytes, more than %d", len(m.Payload), MaxPayloadBytes)
	case m.Delay < 0:
		return "", invalid(ErrInvalidMessage, i, "negative delay %v", m.Delay)
	}
	if len(m.Headers) == 0 {
		return "{}", nil
	}
	seen := make(map[string]string, len(m.Headers))
	for name, value := range m.Headers {
		if !isToken(name) {
			return "", invalid(ErrInvalidHeader, i, "header name %q is not an HTTP token", name)
		}
		if !utf8.ValidString(value) || hasControl(value, true) {
			return "", invalid(ErrInvalidHeader, i, "header %s: value %q has a control character or is not UTF-8", name, value)
		}
		lower := strings.ToLower(name)
		if other, dup := seen[lower]; dup {
			return "", invalid(ErrInvalidHeader, i, "header names %q and %q differ only in case", other, name)
		}
		seen[lower] = name
	}
	b, err := json.Marshal(m.Headers)
	if err != nil { // cannot happen for valid UTF-8 strings
		return "", invalid(ErrInvalidHeader, i, "encode: %v", err)
	}
	return string(b), nil
}

// hasControl reports ASCII control characters (NUL, CR, LF, DEL ...), with
// horizontal tab allowed when allowTab is set.
func hasControl(s string, allowTab bool) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < 0x20 && !(allowTab && c == '\t')) || c == 0x7f {
			return true
		}
	}
	return false
}

// isToken reports whether s is an RFC 9110 token, the syntax of header names.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}
