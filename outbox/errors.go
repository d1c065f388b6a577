package outbox

import (
	"errors"
	"fmt"
	"time"

	"github.com/atomicphase/atomicphase/internal/service"
)

// Sentinel errors, matched with errors.Is. Errors returned by this package
// wrap them as "outbox: <what>: <detail>".
var (
	// ErrInvalidMessage: Enqueue was given a message it cannot store (see the
	// more specific sentinels below, which errors returned for them also
	// match). Nothing was written.
	ErrInvalidMessage = errors.New("outbox: invalid message")

	// ErrInvalidTopic: a message's topic is empty, longer than
	// MaxTopicBytes, not valid UTF-8, or contains a control character.
	// Nothing was written.
	ErrInvalidTopic = errors.New("outbox: invalid topic")

	// ErrPayloadTooLarge: a message's payload exceeds MaxPayloadBytes.
	// Nothing was written.
	ErrPayloadTooLarge = errors.New("outbox: payload too large")

	// ErrInvalidHeader: a header name is empty or not an HTTP token, or a
	// value is not valid UTF-8 or contains a control character other than
	// horizontal tab (CR, LF and NUL included). Nothing was written.
	ErrInvalidHeader = errors.New("outbox: invalid header")

	// ErrInvalidConfig: New or a publisher constructor was given an unusable
	// configuration.
	ErrInvalidConfig = errors.New("outbox: invalid configuration")

	// ErrAlreadyStarted: Start was called on a relay that is running. It is
	// the same error as cleanup.ErrAlreadyStarted and
	// recovery.ErrAlreadyStarted.
	ErrAlreadyStarted = service.ErrAlreadyStarted

	// ErrNotSent is the outcome a Publisher reports for a message it did not
	// send because the publish deadline passed or the relay is stopping. The
	// relay leaves such a message as it was, without counting an attempt;
	// reported at any other time, it counts as a failed attempt.
	ErrNotSent = errors.New("outbox: message not sent")

	// ErrPermanent marks a publish failure that retrying cannot fix (the
	// receiver rejected the message). The relay dead-letters such a message
	// at once instead of retrying it. Wrap an error with [Permanent].
	ErrPermanent = errors.New("outbox: permanent publish failure")

	// ErrUnavailable marks a publish failure of the destination as a whole,
	// not of the message: the broker or receiver could not be reached, or
	// said it is unavailable. The relay retries such a message with its
	// usual backoff but counts no attempt, so an outage of any length
	// dead-letters nothing (watch Stats.OldestPendingAge instead). Wrap an
	// error with [Unavailable].
	ErrUnavailable = errors.New("outbox: destination unavailable")

	// ErrInvalidRedrive: Redrive was given no pool, or a selection that
	// names nothing or mixes All with ids. Nothing changed.
	ErrInvalidRedrive = errors.New("outbox: invalid redrive selection")

	// ErrNotDeadLettered: Redrive was given an id that is not a dead letter
	// (pending, published, deleted, or unknown). Nothing changed.
	ErrNotDeadLettered = errors.New("outbox: not dead-lettered")
)

// Permanent wraps err so that errors.Is(result, ErrPermanent) holds, telling
// the relay to dead-letter the message instead of retrying it. errors.Is and
// errors.As still see err. Permanent(nil) returns nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string   { return "permanent: " + e.err.Error() }
func (e *permanentError) Unwrap() []error { return []error{ErrPermanent, e.err} }

// Unavailable wraps err so that errors.Is(result, ErrUnavailable) holds,
// telling the relay that the destination, not the message, failed: it
// retries without counting an attempt. Use it only for failures that say
// nothing about the message (a closed connection, a refused dial, an HTTP
// 502 or 503), or a message the destination always refuses that way is
// retried for ever. errors.Is and errors.As still see err (a RetryAfter
// inside is honoured). Unavailable(nil) returns nil.
func Unavailable(err error) error {
	if err == nil {
		return nil
	}
	return &unavailableError{err: err}
}

type unavailableError struct{ err error }

func (e *unavailableError) Error() string   { return e.err.Error() }
func (e *unavailableError) Unwrap() []error { return []error{ErrUnavailable, e.err} }

// RetryAfter wraps err with the least delay before the message is tried
// again, as a receiver asks with an HTTP Retry-After header. The relay waits
// the longer of d and its own backoff, capped at Config.RetryMaxDelay.
// errors.Is and errors.As still see err. RetryAfter(nil, d) returns nil.
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &retryAfterError{err: err, delay: max(d, 0)}
}

type retryAfterError struct {
	err   error
	delay time.Duration
}

func (e *retryAfterError) Error() string { return e.err.Error() }
func (e *retryAfterError) Unwrap() error { return e.err }

// retryDelay returns the delay err asks for with RetryAfter, if any.
func retryDelay(err error) (time.Duration, bool) {
	var ra *retryAfterError
	if errors.As(err, &ra) {
		return ra.delay, true
	}
	return 0, false
}

// validationError reports a message Enqueue refused. It matches both its
// specific sentinel and ErrInvalidMessage.
type validationError struct {
	specific error
	index    int
	detail   string
}

func (e *validationError) Error() string {
	return fmt.Sprintf("%v: message %d: %s", e.specific, e.index, e.detail)
}

func (e *validationError) Unwrap() []error {
	if e.specific == ErrInvalidMessage {
		return []error{ErrInvalidMessage}
	}
	return []error{e.specific, ErrInvalidMessage}
}

func invalid(specific error, index int, format string, args ...any) error {
	return &validationError{specific: specific, index: index, detail: fmt.Sprintf(format, args...)}
}
