package webhook

import (
	"errors"

	"github.com/atomicphase/atomicphase/outbox"
)

var (
	// ErrInvalidConfig: New was given an unusable configuration. Errors that
	// match it also match outbox.ErrInvalidConfig.
	ErrInvalidConfig error = &sentinel{"webhook: invalid configuration", outbox.ErrInvalidConfig}

	// ErrInvalidSignature: Verify found no valid signature on a call, or its
	// timestamp is too far from the receiver's clock.
	ErrInvalidSignature = errors.New("webhook: invalid signature")
)

// sentinel is an error of this package that also matches a more general one
// of the outbox package.
type sentinel struct {
	msg    string
	parent error
}

func (e *sentinel) Error() string { return e.msg }
func (e *sentinel) Unwrap() error { return e.parent }
