-- name: RecordInboxMessage :execrows
-- Records that consumer handles message_id, in the handler's transaction,
-- before the handler runs: 1 row when the message is new, 0 when a row
-- already exists (handled, or dead-lettered, by a committed transaction).
-- A concurrent transaction recording the same message makes this statement
-- wait for it: when it commits, SERIALIZABLE reports a serialization failure
-- (its row is not in this transaction's snapshot), and the retry sees the
-- row; when it rolls back, this one goes on. ON CONFLICT's check reads the
-- index with a dirty snapshot and takes no predicate lock, so transactions
-- recording different messages do not conflict through shared index pages.
INSERT INTO inbox_messages (consumer, message_id, recorded_at, keep_until)
VALUES (@consumer, @message_id, now(), now() + make_interval(secs => @retention_seconds::float8))
ON CONFLICT (consumer, message_id) DO NOTHING;

-- name: DeadLetterInboxMessage :execrows
-- Records a message the consumer gave up on, with its error and content, in
-- a transaction of its own: 1 row when recorded, 0 when the message already
-- has a row (handled or dead-lettered meanwhile), which is left unchanged.
INSERT INTO inbox_messages (
    consumer, message_id, recorded_at, keep_until, dead_at, deliveries, last_error, topic, payload, headers
)
VALUES (
    @consumer, @message_id, now(), now() + make_interval(secs => @retention_seconds::float8), now(),
    sqlc.narg(deliveries)::integer, @last_error::text, sqlc.narg(topic)::text, sqlc.narg(payload)::bytea,
    sqlc.narg(headers)::text::jsonb
)
ON CONFLICT (consumer, message_id) DO NOTHING;

-- name: DeleteExpiredInboxMessages :execrows
-- Deletes up to batch_size inbox rows past their keep_until, oldest first,
-- in one statement (cleanup).
WITH batch AS MATERIALIZED (
    SELECT consumer, message_id
    FROM inbox_messages
    WHERE keep_until <= now()
    ORDER BY keep_until
    LIMIT @batch_size::integer
    FOR UPDATE SKIP LOCKED
)
DELETE FROM inbox_messages AS m
USING batch AS b
WHERE m.consumer = b.consumer AND m.message_id = b.message_id;

-- name: CountExpiredInboxMessages :one
-- How many inbox rows a cleanup round would delete now.
SELECT count(*)::bigint AS expired FROM inbox_messages WHERE keep_until <= now();
