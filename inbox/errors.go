package inbox

import (
	"errors"
	"fmt"
)

// Sentinel errors, matched with errors.Is. Their text carries no package
// prefix: the functions that return them add "inbox: <op>:" once.
var (
	// ErrInvalidConfig: New was given a nil pool or a Config value outside
	// its documented range.
	ErrInvalidConfig = errors.New("invalid config")

	// ErrInvalidMessageID: a message id is empty, longer than
	// MaxMessageIDBytes, or not printable ASCII. It is refused before any
	// SQL; nothing was written and the handler did not run.
	ErrInvalidMessageID = errors.New("invalid message id")

	// ErrInvalidUse: the package was called wrongly (a nil handler), or the
	// handler committed or rolled back the transaction it was given, or
	// ended it with SQL.
	ErrInvalidUse = errors.New("invalid use")

	// ErrConflict: the handler's transaction kept failing with serialization
	// failures or deadlocks after Config.MaxRetries retries. Nothing was
	// written; the message is left to be delivered again.
	ErrConflict = errors.New("transaction conflict persisted after retries")

	// ErrUnavailable: the database could not be reached, refused the
	// connection, is shutting down or starting, or accepts only reads (a
	// failover in progress). The handler's writes did not commit, or, if the
	// connection failed during COMMIT, may have: either way the message is
	// left to be delivered again, and a redelivery after a commit that did
	// take effect is acknowledged as a Duplicate. It is not the handler's
	// failure, so adapters do not count it towards giving up on the message
	// (see natsin and webhookin).
	ErrUnavailable = errors.New("database unavailable")

	// ErrPanicked: the handler panicked. Its transaction rolled back, as
	// for any handler error; the *PanicError carries the value.
	ErrPanicked = errors.New("handler panicked")

	// ErrRetentionTooShort: the broker or sender may deliver a message again
	// later than Config.Retention after it was handled, when its row may be
	// gone and the handler would run a second time. The adapters refuse to
	// run with such settings.
	ErrRetentionTooShort = errors.New("retention is shorter than the redelivery horizon")
)

// PanicError carries a panic recovered from a handler. It unwraps to
// ErrPanicked.
type PanicError struct {
	// Value is what was passed to panic.
	Value any
	// Stack is the panicking goroutine's stack.
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("handler panicked: %v", e.Value) }

func (e *PanicError) Unwrap() error { return ErrPanicked }
