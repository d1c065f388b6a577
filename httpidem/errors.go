package httpidem

import "errors"

// Sentinel errors, matched with errors.Is.
var (
	// ErrNoScope is returned by New when Config.Scope is nil.
	ErrNoScope = errors.New("httpidem: Config.Scope is required")
	// ErrInvalidHeader reports an Idempotency-Key header that is neither an
	// sf-string nor a bare token, or whose key is not valid.
	ErrInvalidHeader = errors.New("httpidem: invalid Idempotency-Key header")
)
