package outbox

import (
	"encoding/json"
	"errors"
	"net/http"
	"testing"
	"unicode/utf8"
)

// FuzzValidate: any message either is rejected with ErrInvalidMessage, or
// its headers encode to a JSON object that round-trips and that net/http
// would accept as header fields, and its topic is non-empty UTF-8 text.
func FuzzValidate(f *testing.F) {
	f.Add("orders.created", "order:1", []byte(`{}`), "Content-Type", "application/json")
	f.Add("", "", []byte(nil), "", "")
	f.Add("t", "k", []byte("x"), "Bad Name", "v")
	f.Add("t", "k", []byte("x"), "X-Ok", "line\r\nbreak")
	f.Add("t\x00", "k\x00", []byte("x"), "X", "\x7f")
	f.Fuzz(func(t *testing.T, topic, orderingKey string, payload []byte, name, value string) {
		m := Message{Topic: topic, OrderingKey: orderingKey, Payload: payload}
		if name != "" || value != "" {
			m.Headers = map[string]string{name: value}
		}
		enc, err := validate(0, &m)
		if err != nil {
			if !errors.Is(err, ErrInvalidMessage) {
				t.Fatalf("error does not match ErrInvalidMessage: %v", err)
			}
			return
		}
		if topic == "" || !utf8.ValidString(topic) {
			t.Fatalf("accepted topic %q", topic)
		}
		var back map[string]string
		if err := json.Unmarshal([]byte(enc), &back); err != nil {
			t.Fatalf("headers %q do not decode: %v", enc, err)
		}
		for k, v := range back {
			if m.Headers[k] != v {
				t.Fatalf("header %q changed: %q -> %q", k, m.Headers[k], v)
			}
			h := http.Header{}
			h.Set(k, v)
			if h.Get(k) != v {
				t.Fatalf("header %q: %q is not a valid header field", k, v)
			}
		}
	})
}
