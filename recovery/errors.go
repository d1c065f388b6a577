package recovery

import (
	"errors"

	"github.com/atomicphase/atomicphase/internal/service"
)

// Sentinel errors, matched with errors.Is. Their text carries no package
// prefix: the functions that return them add "recovery: op:" once.
var (
	// ErrInvalidConfig: New was given a nil runner, or a Config value
	// outside its documented range.
	ErrInvalidConfig = errors.New("invalid config")

	// ErrAlreadyStarted: Start was called on a Resumer that is running. It
	// is the same error as outbox.ErrAlreadyStarted and the other
	// background services'.
	ErrAlreadyStarted = service.ErrAlreadyStarted
)
