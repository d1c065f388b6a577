// Package outbox stages messages inside database transactions and relays
// them to a broker after commit: the transactional outbox.
//
// [Enqueue] writes messages in the caller's transaction (an atomic phase of
// the txn package, or any pgx.Tx), so a message exists if and only if the
// transaction commits. A [Relay] claims committed messages in batches with
// FOR UPDATE SKIP LOCKED, hands them to a [Publisher], and marks them
// published, or schedules a retry with exponential backoff, or dead-letters
// them after Config.MaxAttempts. Several relays can serve one table at once.
//
// # Delivery
//
// The relay delivers at least once: a message is marked published in the
// same transaction that claimed it, after the publisher acknowledged it, so
// a crash or lost connection between the two publishes it again. Every
// publish of a message carries the same id ([Envelope].ID). The NATS
// JetStream publisher (package natspub) sets it as Nats-Msg-Id, so JetStream
// drops republishes within the stream's duplicate window and stores each
// message exactly once; the webhook publisher (package webhook) sends it as
// Idempotency-Key. Consumers that need
// exactly-once processing beyond that deduplicate on the id.
//
// # Ordering
//
// Messages with the same Message.OrderingKey are published in the order
// their transactions committed (Enqueue makes id order equal commit order
// within a key; see its documentation), one after another: a key's message
// is published only once its predecessor was acknowledged. A message that
// fails holds back its key's later messages while it is retried; when it is
// dead-lettered, the key is released and its later messages go on. This
// trades strict sequence for progress: a key is never blocked forever by one
// poisoned message, and the dead one stays in the table, with last_error, for
// inspection and replay. Messages without an ordering key are not held back
// by anything and may be published in any order.
//
// # Waking the relay
//
// Enqueue sends one notification per transaction on [NotifyChannel]; a
// started relay LISTENs on a dedicated connection and relays at once.
// Polling every Config.PollInterval is the fallback, and the only mode with
// Config.DisableNotify, for connections that cannot LISTEN (a
// transaction-pooling PgBouncer).
package outbox
