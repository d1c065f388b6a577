package httpidem

import "errors"

// Sentinel errors, matched with errors.Is. Their text carries no package
// prefix: the functions that return them add "httpidem: op:" once.
var (
	// ErrInvalidConfig: New was given a nil runner, no Scope, or a value
	// outside its documented range.
	ErrInvalidConfig = errors.New("invalid config")
	// ErrNoScope: Config.Scope is nil. New's error wraps it and
	// ErrInvalidConfig.
	ErrNoScope = errors.New("Config.Scope is required")
	// ErrInvalidHeader reports an Idempotency-Key header that is neither an
	// sf-string nor a bare token, or whose key is not valid.
	ErrInvalidHeader = errors.New("invalid Idempotency-Key header")
)
