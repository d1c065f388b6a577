package telemetry

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"

	"go.opentelemetry.io/otel/attribute"
)

// defaultScopeKey is the HMAC key used when none is configured. It is
// public: it only keeps a raw principal out of traces.
var defaultScopeKey = []byte("atomicphase/scope-hash/v1")

// ScopeHasher turns a scope (the caller's principal) into the value of
// the atomicphase.scope.hash span attribute: HMAC-SHA256 of the scope
// under a key, truncated to 128 bits, in hex. The zero value uses the
// default key.
type ScopeHasher struct {
	key []byte
}

// NewScopeHasher returns a hasher keyed with key (copied); an empty key
// means the default, public one. Services whose traces should correlate
// by scope use the same key.
func NewScopeHasher(key []byte) ScopeHasher {
	if len(key) == 0 {
		return ScopeHasher{}
	}
	return ScopeHasher{key: append([]byte(nil), key...)}
}

// Hash returns scope's hash, 32 hex digits.
func (h ScopeHasher) Hash(scope string) string {
	key := h.key
	if len(key) == 0 {
		key = defaultScopeKey
	}
	m := hmac.New(sha256.New, key)
	m.Write([]byte(scope))
	var sum [sha256.Size]byte
	return hex.EncodeToString(m.Sum(sum[:0])[:16])
}

// Attribute returns the atomicphase.scope.hash attribute for scope.
func (h ScopeHasher) Attribute(scope string) attribute.KeyValue {
	return attribute.String(AttrScopeHash, h.Hash(scope))
}
