package txn

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/atomicphase/atomicphase/internal/pgerr"
)

// Sentinel errors returned by the Runner, matched with errors.Is. Their text
// carries no package prefix: the functions that return them add "txn: op:"
// once.
var (
	// ErrInvalidKey: the idempotency key or scope is malformed (empty, longer
	// than 255 bytes, or not printable ASCII). Nothing was written. HTTP 400.
	// A *RequestError tells which.
	ErrInvalidKey = errors.New("invalid idempotency key")

	// ErrInvalidRequest: the request's method, path or params are malformed
	// (params not valid JSON, duplicate object keys, invalid UTF-8, or what
	// PostgreSQL's jsonb cannot hold: a \u0000, a number outside numeric's
	// range). Nothing was written. HTTP 400. A *RequestError tells which.
	ErrInvalidRequest = errors.New("invalid request")

	// ErrRequestTooLarge: the params exceed Config.MaxParamsBytes. Nothing was
	// written. HTTP 413.
	ErrRequestTooLarge = errors.New("request params too large")

	// ErrKeyInUse: another attempt holds the key's live lease. Nothing ran.
	// HTTP 409, with Retry-After from KeyStateError.RetryAfter.
	ErrKeyInUse = errors.New("idempotency key is in use by another attempt")

	// ErrKeyReused: the key exists for a different request (fingerprint) or a
	// different workflow. Nothing ran; the stored row is unchanged. HTTP 422.
	ErrKeyReused = errors.New("idempotency key reused for a different request")

	// ErrLeaseLost: this attempt's lease expired and another attempt took the
	// key over; the phase in progress committed nothing. HTTP 409.
	ErrLeaseLost = errors.New("lease lost to another attempt")

	// ErrConflict: a phase kept failing with serialization failures or
	// deadlocks after Config.MaxRetries retries. The key stays at its last
	// recovery point and a later retry resumes it. HTTP 409.
	ErrConflict = errors.New("transaction conflict persisted after retries")

	// ErrUnknownWorkflow: the workflow is not in the Runner's registry. HTTP 500.
	ErrUnknownWorkflow = errors.New("workflow not registered")

	// ErrKeyNotFound: Resume found no key with that scope and value. HTTP 404.
	ErrKeyNotFound = errors.New("idempotency key not found")

	// ErrKeyExpired: the key was used for an operation that finished and
	// was deleted after its TTL; the cleaner left a tombstone, and
	// Config.ExpiredKeyPolicy is ExpiredKeyReject (the default). Nothing ran
	// and nothing was written: a client must use a new key for a new
	// operation. HTTPStatus answers 422.
	ErrKeyExpired = errors.New("idempotency key expired")

	// ErrInvalidUse: the library was called wrongly (nil function, empty or
	// repeated phase name, a response whose status is not 100-599, a phase
	// after Finish, an unmarshalable phase result, a function that committed
	// or rolled back the transaction it was given). HTTP 500.
	ErrInvalidUse = errors.New("invalid use")

	// ErrInvalidConfig: New was given a nil pool or a Config value outside
	// its documented range.
	ErrInvalidConfig = errors.New("invalid config")

	// ErrPanicked: user code panicked. The phase rolled back and the key was
	// released, as for any transient error; the *PanicError carries the value.
	// HTTP 500.
	ErrPanicked = errors.New("operation panicked")

	// ErrUnavailable: the database could not be reached, refused the
	// connection, is shutting down or starting, or takes no writes (a
	// standby, or a demoted primary during a failover). Nothing the
	// operation did is lost: a phase that did not commit is retried from its
	// recovery point by a retry with the same key or by the Resumer, and a
	// commit cut off in flight is replayed, not re-executed. HTTPStatus
	// answers 503 (httpidem adds Retry-After).
	ErrUnavailable = errors.New("database unavailable")
)

// KeyStateError is returned for ErrKeyInUse and ErrKeyReused and tells the
// caller what state the existing key is in. It unwraps to the sentinel.
type KeyStateError struct {
	// Err is ErrKeyInUse or ErrKeyReused.
	Err error
	// Status is the existing key's status: KeyRunning, KeyFinished or
	// KeyFailed.
	Status KeyStatus
	// RecoveryPoint is the existing key's last committed phase, or
	// RecoveryPointStarted before any.
	RecoveryPoint string
	// RetryAfter suggests when to try again (ErrKeyInUse): the time left on
	// the holder's lease by the database clock, at least one second.
	RetryAfter time.Duration
}

func (e *KeyStateError) Error() string {
	return fmt.Sprintf("%v (existing key is %s at %q)", e.Err, e.Status, e.RecoveryPoint)
}

func (e *KeyStateError) Unwrap() error { return e.Err }

// RequestError reports a Key that cannot be run, before any SQL: which part
// of it is wrong and why, in words a client can act on. It unwraps to
// ErrInvalidKey, ErrInvalidRequest or ErrRequestTooLarge.
type RequestError struct {
	// Err is ErrInvalidKey, ErrInvalidRequest or ErrRequestTooLarge.
	Err error
	// Field is the part of the Key at fault: "key", "scope", "method",
	// "path" or "params".
	Field string
	// Reason says what is wrong with it, e.g. `duplicate object key "id"`.
	Reason string
}

func (e *RequestError) Error() string { return fmt.Sprintf("%v: %s: %s", e.Err, e.Field, e.Reason) }

func (e *RequestError) Unwrap() error { return e.Err }

// PanicError carries a panic recovered from user code. It unwraps to ErrPanicked.
type PanicError struct {
	// Value is what was passed to panic.
	Value any
	// Stack is the panicking goroutine's stack.
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("operation panicked: %v", e.Value) }

func (e *PanicError) Unwrap() error { return ErrPanicked }

// HTTPStatus maps an error returned by the Runner to the HTTP status an API
// should answer with; errors it does not know map to 500.
func HTTPStatus(err error) int {
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, ErrInvalidKey), errors.Is(err, ErrInvalidRequest):
		return http.StatusBadRequest
	case errors.Is(err, ErrRequestTooLarge):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, ErrKeyInUse), errors.Is(err, ErrLeaseLost), errors.Is(err, ErrConflict):
		return http.StatusConflict
	case errors.Is(err, ErrKeyReused), errors.Is(err, ErrKeyExpired):
		return http.StatusUnprocessableEntity
	case errors.Is(err, ErrKeyNotFound):
		return http.StatusNotFound
	case errors.Is(err, ErrUnavailable):
		return http.StatusServiceUnavailable
	default:
		return http.StatusInternalServerError
	}
}

// markUnavailable makes err match ErrUnavailable when the database could not
// serve the operation (see pgerr.IsUnavailable), keeping its text; not when
// the caller's ctx ended, which is why the operation stopped.
func markUnavailable(ctx context.Context, err error) error {
	if err == nil || ctx.Err() != nil || errors.Is(err, ErrUnavailable) || !pgerr.IsUnavailable(err) {
		return err
	}
	return &unavailableError{err: err}
}

type unavailableError struct{ err error }

func (e *unavailableError) Error() string   { return e.err.Error() }
func (e *unavailableError) Unwrap() []error { return []error{ErrUnavailable, e.err} }

// cleanupFailed keeps the text of a failed cleanup (a release, the removal
// of an unseen insert) that is joined to the error which caused it, but not
// its chain: the cleanup ran on a context of its own, bounded by
// ReleaseTimeout, and its context.DeadlineExceeded must not make the caller
// take the operation's error for its own context ending, nor hide that the
// database was unavailable.
func cleanupFailed(err error) error {
	if err == nil {
		return nil
	}
	return errors.New(err.Error())
}

// errLostCommit: the key still holds this attempt's lease, but its recovery
// point is behind the last phase the attempt committed, so that commit is
// gone: a failover to an asynchronous standby that had not received it (the
// key's row and lease, committed earlier, had reached it). The attempt stops
// rather than commit later phases and a response over the hole, and gives
// the lease back; a retry resumes from the key's recovery point. It matches
// ErrLeaseLost (409): the client retries.
var errLostCommit = fmt.Errorf("%w: a phase this attempt committed is not on the server (a failover to a standby that had not received it); a retry resumes from the key's recovery point", ErrLeaseLost)
