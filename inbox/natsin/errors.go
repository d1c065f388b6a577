package natsin

import (
	"errors"

	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/internal/service"
)

var (
	// ErrInvalidConfig: New was given an unusable configuration. Errors
	// that match it also match inbox.ErrInvalidConfig.
	ErrInvalidConfig error = &sentinel{"invalid config", inbox.ErrInvalidConfig}

	// ErrConsumerSettings: the JetStream consumer cannot be consumed
	// exactly once: it is not a pull consumer, or it does not take
	// explicit acknowledgements. Start and RunOnce refuse it.
	ErrConsumerSettings = errors.New("JetStream consumer settings unusable")

	// ErrAlreadyStarted: Start was called on a Consumer that is running. It
	// is the same error as outbox.ErrAlreadyStarted and the other
	// background services'.
	ErrAlreadyStarted = service.ErrAlreadyStarted
)

// sentinel is an error of this package that also matches a more general one
// of the inbox package.
type sentinel struct {
	msg    string
	parent error
}

func (e *sentinel) Error() string { return e.msg }
func (e *sentinel) Unwrap() error { return e.parent }
