package natspub

import "github.com/atomicphase/atomicphase/outbox"

// ErrInvalidConfig: New was given an unusable configuration. Errors that
// match it also match outbox.ErrInvalidConfig.
var ErrInvalidConfig error = &sentinel{"natspub: invalid configuration", outbox.ErrInvalidConfig}

// sentinel is an error of this package that also matches a more general one
// of the outbox package.
type sentinel struct {
	msg    string
	parent error
}

func (e *sentinel) Error() string { return e.msg }
func (e *sentinel) Unwrap() error { return e.parent }
