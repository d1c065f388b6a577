package cleanup

import "errors"

// Sentinel errors, matched with errors.Is.
var (
	// ErrInvalidConfig: New was given a nil pool, or a Config value outside
	// its documented range (such as a TTL outside 24 hours to 7 days).
	ErrInvalidConfig = errors.New("cleanup: invalid config")

	// ErrAlreadyStarted: Start was called on a Cleaner that is running.
	ErrAlreadyStarted = errors.New("cleanup: already started")
)
