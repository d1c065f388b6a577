package natspub

import (
	"errors"

	"github.com/atomicphase/atomicphase/outbox"
)

var (
	// ErrInvalidConfig: New was given an unusable configuration. Errors that
	// match it also match outbox.ErrInvalidConfig.
	ErrInvalidConfig error = &sentinel{"natspub: invalid configuration", outbox.ErrInvalidConfig}

	// ErrDuplicateWindow: a stream's duplicate window (Duplicates) is shorter
	// than the relay's RepublishInterval, so a republish could be stored as
	// a second message. PrepareRelay refuses to run with it.
	ErrDuplicateWindow = errors.New("natspub: stream's duplicate window is too short for the relay")
)

// sentinel is an error of this package that also matches a more general one
// of the outbox package.
type sentinel struct {
	msg    string
	parent error
}

func (e *sentinel) Error() string { return e.msg }
func (e *sentinel) Unwrap() error { return e.parent }
