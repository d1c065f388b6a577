package inbox

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"
)

// MaxMessageIDBytes is the longest message id, and the longest consumer
// name, the inbox accepts. Outbox message ids (UUIDs) take 36 bytes.
const MaxMessageIDBytes = 255

// ValidateMessageID checks a message id before anything is sent to the
// database: 1 to MaxMessageIDBytes bytes of printable ASCII (0x20-0x7E).
// The error wraps ErrInvalidMessageID and says what is wrong.
func ValidateMessageID(id string) error {
	if reason := checkText(id); reason != "" {
		return fmt.Errorf("%w: %s", ErrInvalidMessageID, reason)
	}
	return nil
}

// checkText returns why s is not 1 to MaxMessageIDBytes bytes of printable
// ASCII, or "" when it is.
func checkText(s string) string {
	switch {
	case s == "":
		return "empty"
	case len(s) > MaxMessageIDBytes:
		return fmt.Sprintf("%d bytes, more than %d", len(s), MaxMessageIDBytes)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e {
			return fmt.Sprintf("byte %d is %#02x, not printable ASCII", i, c)
		}
	}
	return ""
}

// Message is a message the consumer gives up on, as DeadLetter records it.
type Message struct {
	// ID is the message's id, as Handle was given it. Required.
	ID string
	// Topic is where the message came from: a NATS subject, a webhook's
	// topic. Optional.
	Topic string
	// Payload is the message body, kept as is. Optional.
	Payload []byte
	// Headers are the message's headers. Optional.
	Headers map[string][]string
	// Deliveries counts the deliveries made before giving up; 0 when
	// unknown.
	Deliveries int
}

// maxErrorBytes bounds the error text a dead letter keeps.
const maxErrorBytes = 8 << 10

// storableText makes s fit a PostgreSQL text column: valid UTF-8, no NUL
// (which text cannot hold), at most limit bytes (0: no limit).
func storableText(s string, limit int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "\uFFFD")
	if limit > 0 && len(s) > limit {
		cut := limit
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut]
	}
	return s
}

// headersJSON encodes headers as a JSON object of string arrays that jsonb
// can hold (no \u0000), or "" for none.
func headersJSON(h map[string][]string) (string, error) {
	if len(h) == 0 {
		return "", nil
	}
	clean := make(map[string][]string, len(h))
	for k, vs := range h {
		out := make([]string, len(vs))
		for i, v := range vs {
			out[i] = storableText(v, 0)
		}
		clean[storableText(k, 0)] = out
	}
	b, err := json.Marshal(clean)
	if err != nil {
		return "", err
	}
	return string(b), nil
}
