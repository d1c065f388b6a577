package outbox

import (
	"context"
	"fmt"
	"sync"
)

// Publisher delivers messages to a broker or a receiver.
//
// The relay calls Publish with messages of which no two share an ordering
// key, so a Publisher may deliver them concurrently and in any order; the
// relay itself publishes a key's next message only after the previous one
// was acknowledged.
//
// Publish reports each message's outcome with res.Set(i, err), for msgs[i],
// as soon as it is known, from any goroutine: nil when the broker or
// receiver acknowledged the message, an error otherwise. Each message keeps
// its own outcome: an acknowledged message is marked published whatever
// happens to the others of the call.
//
// An error that matches ErrPermanent (see [Permanent]) dead-letters the
// message at once; any other error schedules a retry with backoff, after at
// least the delay an error made with [RetryAfter] asks for.
//
// ctx ends at the batch's publish deadline (three quarters of
// Config.PublishTimeout after the claim), and Publish must return by then:
// the claim transaction stays open while it runs. Outcomes set after the
// relay stopped waiting are ignored, and a message without an outcome then
// counts as a failed attempt. Report [ErrNotSent] for a message you did not
// send because ctx ended or the relay is stopping: it is left as it was,
// without counting an attempt. Report every message you did send, even when
// it failed because ctx ended.
//
// When the relay stops (Stop, or the context of Start or RunOnce ends),
// res.Stopping() is closed but ctx is not cancelled: send no further
// message, and let those in flight run to their acknowledgement, which is
// still recorded, so that a graceful stop publishes nothing twice.
//
// Delivery is at least once: a message can be published again after a crash
// or a lost acknowledgement, always with the same Envelope.ID, which
// receivers use to deduplicate.
//
// A Publisher may also implement [Checker] and [Preparer], to check the
// relay's settings against its own. A Publisher that wraps another should
// forward those too.
type Publisher interface {
	Publish(ctx context.Context, msgs []Envelope, res *Results)
}

// Results receives the outcomes of the messages of one Publish call. The
// relay owns it: it reads the outcomes when Publish returns, or shortly
// after the publish deadline if Publish has not returned by then, and
// ignores what is set afterwards. Its methods are safe for concurrent use.
type Results struct {
	mu       sync.Mutex
	errs     []error
	reported []bool
	sealed   bool
	stopping <-chan struct{}
}

// NewResults returns Results for n messages, for calling a Publisher outside
// a relay: in tests, or in a Publisher that wraps another. Its Stopping
// channel never closes.
func NewResults(n int) *Results {
	return newResults(n, nil)
}

func newResults(n int, stopping <-chan struct{}) *Results {
	return &Results{errs: make([]error, n), reported: make([]bool, n), stopping: stopping}
}

// Set records the outcome of message i of the call: nil when it was
// acknowledged, otherwise why it was not. Only the first outcome of a
// message counts, and an index out of range is ignored.
func (r *Results) Set(i int, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.sealed || i < 0 || i >= len(r.errs) || r.reported[i] {
		return
	}
	r.errs[i], r.reported[i] = err, true
}

// Reported reports whether message i has an outcome.
func (r *Results) Reported(i int) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return i >= 0 && i < len(r.errs) && r.reported[i]
}

// Err returns the outcome of message i: nil when it was acknowledged or has
// no outcome yet (see Reported).
func (r *Results) Err(i int) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if i < 0 || i >= len(r.errs) {
		return nil
	}
	return r.errs[i]
}

// Stopping returns a channel that is closed when the relay starts to stop:
// send no further message of this call.
func (r *Results) Stopping() <-chan struct{} { return r.stopping }

// seal ends reporting and returns the outcomes; later Sets are ignored.
func (r *Results) seal() (errs []error, reported []bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sealed = true
	return r.errs, r.reported
}

// PublisherFunc adapts a function that publishes one message to the
// Publisher interface, for in-process delivery and tests. Publish calls it
// for each message in turn and reports each result as it returns. It calls
// it for no further message once ctx is done or the relay is stopping, and
// reports those as ErrNotSent. A call still running when ctx ends fails its
// message with ctx's error and is left to finish on its own, so that a
// function that ignores ctx costs no other message an attempt. A panic in
// the function is its message's failure.
type PublisherFunc func(ctx context.Context, msg Envelope) error

// Publish implements Publisher.
func (f PublisherFunc) Publish(ctx context.Context, msgs []Envelope, res *Results) {
	for i := range msgs {
		if halted(ctx, res) {
			res.Set(i, ErrNotSent)
			continue
		}
		done := make(chan error, 1)
		go func() { done <- f.call(ctx, msgs[i]) }()
		select {
		case err := <-done:
			res.Set(i, err)
		case <-ctx.Done():
			res.Set(i, fmt.Errorf("outbox: publish: %w", ctx.Err()))
		}
	}
}

func (f PublisherFunc) call(ctx context.Context, msg Envelope) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("outbox: publisher panicked: %v", p)
		}
	}()
	return f(ctx, msg)
}

// halted reports whether a Publisher should send no further message of a
// call: ctx is done (the publish deadline passed) or the relay is stopping.
func halted(ctx context.Context, res *Results) bool {
	if ctx.Err() != nil {
		return true
	}
	select {
	case <-res.Stopping():
		return true
	default:
		return false
	}
}
