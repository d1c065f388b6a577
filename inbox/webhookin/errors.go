package webhookin

import "github.com/atomicphase/atomicphase/inbox"

// ErrInvalidConfig: New was given an unusable configuration. Errors that
// match it also match inbox.ErrInvalidConfig.
var ErrInvalidConfig error = &sentinel{"invalid config", inbox.ErrInvalidConfig}

// sentinel is an error of this package that also matches a more general one
// of the inbox package.
type sentinel struct {
	msg    string
	parent error
}

func (e *sentinel) Error() string { return e.msg }
func (e *sentinel) Unwrap() error { return e.parent }
