// Package inbox is the consumer side of exactly-once delivery: it makes a
// message that a broker or a webhook sender delivers more than once take
// effect once in the service that consumes it.
//
// The outbox gets each message to the broker at least once, deduplicated by
// its id within the broker's window. The consumer still sees redeliveries: a
// JetStream redelivery after an acknowledgement was lost, a webhook retried
// after a timeout, a replay from the stream. [Inbox.Handle] records
// (consumer, message id) in the inbox_messages table in the same
// SERIALIZABLE transaction as the handler's writes, before the handler runs.
// A redelivered message finds its row and is acknowledged without running
// the handler; a handler that fails rolls back its row with its writes, so
// the message is handled when it comes again. Acknowledge a message only
// after Handle returned nil: a crash between the commit and the
// acknowledgement is then just one more redelivery.
//
// The adapters do that for you: package natsin consumes a NATS JetStream
// pull consumer, acknowledging each message after its commit, and package
// webhookin is an http.Handler that verifies Standard Webhooks signatures
// and answers 2xx only after the commit.
//
// # Message ids
//
// A message id is 1 to [MaxMessageIDBytes] bytes of printable ASCII, checked
// before any SQL. The outbox's ids (a UUIDv7 per message, sent as
// Nats-Msg-Id and as webhook-id) are the intended ones; a sender's own ids
// (Stripe's evt_..., Standard Webhooks' msg_...) work as well. Each consumer
// has its own namespace ([Config].Consumer), so several consumers, and
// consumers of several senders, share one table.
//
// # Retention
//
// A row is kept for [Config].Retention after its message was handled; the
// cleanup package's Cleaner deletes it afterwards. A message delivered again
// after that would be handled again, so Retention must be longer than the
// longest time after which the broker or the sender may still deliver a
// message again: the adapters compute that horizon from the broker's
// settings (or take it from their configuration) and refuse to start when
// Retention does not cover it ([ErrRetentionTooShort]).
//
// # Dead letters
//
// When the broker's last delivery of a message fails, an adapter records it
// with [Inbox.DeadLetter]: a row with dead_at, the error, the topic, the
// payload and the headers, for inspection. A redelivery of a dead-lettered
// message is acknowledged without running the handler; delete its row to
// have it handled again.
package inbox
