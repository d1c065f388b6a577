package monitor

import "errors"

// Sentinel errors, matched with errors.Is. Their text carries no package
// prefix: the functions that return them add "monitor: op:" once.
var (
	// ErrInvalidConfig: a nil pool, or a Config value outside its
	// documented range.
	ErrInvalidConfig = errors.New("invalid config")
)
