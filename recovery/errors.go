package recovery

import "errors"

// Sentinel errors, matched with errors.Is.
var (
	// ErrInvalidConfig: New was given a nil pool or registry, or a Config
	// value outside its documented range.
	ErrInvalidConfig = errors.New("recovery: invalid config")

	// ErrAlreadyStarted: Start was called on a Resumer that is running.
	ErrAlreadyStarted = errors.New("recovery: already started")
)
