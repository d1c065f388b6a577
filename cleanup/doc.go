// Package cleanup deletes idempotency keys past their expiry, and outbox
// messages and inbox rows past their retention.
//
// # Expiry policy
//
// An idempotency key expires a fixed time (the TTL) after it reached its
// terminal response: by default 24 hours, configurable from 24 hours to 7
// days. Until then every retry with the key gets the stored response; after
// it, the key may be deleted, and a request that reuses its value starts a
// new operation. Keys still running are never deleted, whatever their age;
// the recovery package resumes or fails them. The window is measured from
// finished_at, by the database clock.
//
// Outbox messages are deleted once they were published or dead-lettered
// longer ago than their retention (default 7 days). Pending messages are
// never deleted.
//
// Inbox rows (package inbox: the messages a consumer handled, and its dead
// letters) are deleted once past their keep_until, which each consumer
// stamps from its own inbox.Config.Retention when it writes the row; the
// inbox's adapters check at start that this outlasts the broker's
// redelivery horizon, so the cleaner needs no setting of its own for them.
//
// # Batches and concurrency
//
// A [Cleaner] deletes in batches of [Config.BatchSize] rows, one short
// transaction per batch, oldest first, looping until a batch comes back
// short. Within a round each batch of keys, and of tombstones, starts where
// the previous one stopped, so a large backlog costs the same per batch at
// its end as at its start; keys and tombstones are deleted without first
// locking them (nothing else locks a terminal key or a tombstone), and one
// that another session holds locked is waited for rather than skipped. A stopped round leaves every batch either committed or rolled back.
// Only one cleaner deletes at a time: each batch's transaction first takes a
// transaction-scoped advisory lock (named after this installation's
// idempotency_keys table, so installations in other schemas do not exclude
// each other), and a round that finds it held stops, logs a warning and
// reports [Report.Skipped]: another cleaner is deleting. The lock ends with
// its transaction, so the cleaner keeps no session state and works through a
// transaction-pooling PgBouncer.
package cleanup
