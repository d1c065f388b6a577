package cleanup

import (
	"errors"

	"github.com/atomicphase/atomicphase/internal/service"
)

// Sentinel errors, matched with errors.Is. The package returns them wrapped
// with its name and the operation ("cleanup: new: invalid config: ..."),
// so their own text carries neither.
var (
	// ErrInvalidConfig: New was given a nil pool, or a Config value outside
	// its documented range (such as a TTL outside 24 hours to 7 days).
	ErrInvalidConfig = errors.New("invalid config")

	// ErrAlreadyStarted: Start was called on a Cleaner that is running. It
	// is the same error as outbox.ErrAlreadyStarted and the other
	// background services'.
	ErrAlreadyStarted = service.ErrAlreadyStarted
)
