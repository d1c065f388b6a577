package outbox

import "context"

// Publisher delivers messages to a broker or a receiver.
//
// The relay calls Publish with messages of which no two share an ordering
// key, so a Publisher may deliver them concurrently and in any order; the
// relay itself publishes a key's next message only after the previous one
// succeeded. Publish returns one result per message, in the order of msgs:
// nil when the message was delivered (the broker acknowledged it), an error
// otherwise. A nil slice means every message was delivered; a slice of any
// other length than len(msgs) fails them all.
//
// An error that matches ErrPermanent (see [Permanent]) dead-letters the
// message at once; any other error schedules a retry with backoff. Publish
// must return when ctx is done: the relay's transaction stays open while it
// runs, and the relay stops waiting for it at ctx's deadline.
//
// Delivery is at least once: a message can be published again after a crash
// or a lost acknowledgement, always with the same Envelope.ID, which
// receivers use to deduplicate.
type Publisher interface {
	Publish(ctx context.Context, msgs []Envelope) []error
}

// PublisherFunc adapts a function that publishes one message to the
// Publisher interface, for in-process delivery and tests. Publish calls it
// for each message in turn, and stops calling it once ctx is done.
type PublisherFunc func(ctx context.Context, msg Envelope) error

// Publish implements Publisher.
func (f PublisherFunc) Publish(ctx context.Context, msgs []Envelope) []error {
	errs := make([]error, len(msgs))
	for i := range msgs {
		if err := ctx.Err(); err != nil {
			errs[i] = err
			continue
		}
		errs[i] = f(ctx, msgs[i])
	}
	return errs
}
