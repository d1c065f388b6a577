-- name: EnqueueMessages :exec
-- Stages messages in the caller's transaction, in one statement:
--   1. locks: a transaction-scoped advisory lock on every distinct ordering
--      key, taken in lock-id order so that two transactions locking
--      overlapping keys cannot deadlock each other;
--   2. inserted: the rows, in argument order, with ids drawn only after every
--      lock is held (the locks CTE gates the insert's only input row source),
--      so within an ordering key id order equals commit order;
--   3. idle: a shared, transaction-scoped try-lock on the relays' idle lock
--      (see LockRelayIdle). It fails only while a relay holds the lock (it is
--      idle and listening) or waits for it (it is about to be);
--   4. a notification for the relays only then; PostgreSQL folds identical
--      notifications of one transaction into one, delivered at commit.
--      NOTIFY takes a database-wide lock at commit that serialises every
--      notifying transaction, so producers skip it while no relay waits.
--      A producer that skipped it holds the shared lock until it ends, so a
--      relay announcing itself idle waits for that commit and then finds the
--      rows in the batch it runs next.
-- The notification payload is the schema the rows went to, so a relay serving
-- another schema of the same database ignores it.
WITH locks AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(s.lock_id)
    FROM (
        SELECT DISTINCT hashtextextended(k, 7105431) AS lock_id
        FROM unnest(@ordering_keys::text[]) AS u(k)
        WHERE k <> ''
        ORDER BY 1
    ) AS s
),
inserted AS (
    INSERT INTO outbox_messages (
        idempotency_key_id, topic, ordering_key, payload, headers, created_at, available_at
    )
    SELECT sqlc.narg(idempotency_key_id)::bigint, m.topic, nullif(m.ordering_key, ''),
           m.payload, m.headers::jsonb, now(), now() + m.delay_us * interval '1 microsecond'
    FROM (
        -- Set-returning functions in one select list advance in lockstep.
        SELECT unnest(@topics::text[]) AS topic,
               unnest(@ordering_keys::text[]) AS ordering_key,
               unnest(@payloads::bytea[]) AS payload,
               unnest(@headers::text[]) AS headers,
               unnest(@delays_us::bigint[]) AS delay_us,
               generate_subscripts(@topics::text[], 1) AS ord
    ) AS m
    WHERE (SELECT count(*) FROM locks) >= 0
    ORDER BY m.ord
    RETURNING id
),
idle AS MATERIALIZED (
    SELECT NOT pg_try_advisory_xact_lock_shared(@idle_lock_class::integer,
        ('outbox_messages'::regclass::oid::bigint - 2147483648)::integer) AS relay_idle
)
SELECT (SELECT count(*) FROM inserted) AS inserted,
       (SELECT count(*) FROM (
           SELECT pg_notify(@channel::text, coalesce(current_schema(), '')) FROM idle WHERE relay_idle
       ) AS n) AS notified;

-- name: ClaimMessages :many
-- Claims the next publishable messages and locks them until the caller's
-- transaction ends.
--
-- A head is a due, pending message with no earlier pending message of its
-- ordering key (unordered messages are all heads). Heads are taken oldest due
-- first, skipping those another relay has locked; a locked message is still
-- pending, so its key's later messages are not heads either, and a key is
-- never relayed by two relays at once.
--
-- When there are fewer heads than the batch holds, the rest is filled with
-- the claimed keys' following messages in id order, each key's run ending
-- before its first message that is not yet due. Only the holder of a key's
-- head can take its followers, so they are never locked by anyone else.
WITH heads AS MATERIALIZED (
    SELECT h.id, h.ordering_key
    FROM outbox_messages h
    WHERE h.published_at IS NULL AND h.dead_at IS NULL
      AND h.available_at <= now()
      AND (h.ordering_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM outbox_messages e
            WHERE e.ordering_key = h.ordering_key AND e.id < h.id
              AND e.published_at IS NULL AND e.dead_at IS NULL))
    ORDER BY h.available_at, h.id
    LIMIT sqlc.arg(batch_size)::integer
    FOR UPDATE SKIP LOCKED
),
followers AS (
    SELECT f.id
    FROM heads
    CROSS JOIN LATERAL (
        SELECT r.id, bool_and(r.due) OVER (ORDER BY r.id) AS run_due
        FROM (
            SELECT x.id, x.available_at <= now() AS due
            FROM outbox_messages x
            WHERE x.ordering_key = heads.ordering_key AND x.id > heads.id
              AND x.published_at IS NULL AND x.dead_at IS NULL
            ORDER BY x.id
            LIMIT greatest(sqlc.arg(batch_size)::integer - (SELECT count(*) FROM heads), 0)
        ) AS r
    ) AS f
    WHERE heads.ordering_key IS NOT NULL AND f.run_due
)
SELECT m.id, m.message_id, m.topic, m.ordering_key, m.payload, m.headers, m.attempts, m.created_at
FROM outbox_messages m
WHERE m.id = ANY(ARRAY(SELECT heads.id FROM heads UNION ALL SELECT followers.id FROM followers))
  AND m.published_at IS NULL AND m.dead_at IS NULL
ORDER BY m.id
LIMIT sqlc.arg(batch_size)::integer
FOR UPDATE OF m;

-- name: MarkPublished :exec
-- Records successful publishes, in the claiming transaction, at the time of
-- this statement (after the publisher's acknowledgement), by the database
-- clock.
UPDATE outbox_messages
SET published_at = statement_timestamp(), attempts = attempts + 1
WHERE id = ANY(@ids::bigint[]) AND published_at IS NULL AND dead_at IS NULL;

-- name: RecordFailures :exec
-- Records failed publishes, in the claiming transaction: each row either
-- waits delay_us from this statement (after the failure) before its next
-- attempt, or is dead-lettered now, by the database clock. A failure that
-- was the destination's (counted false: an outage) counts no attempt.
UPDATE outbox_messages AS m
SET attempts = m.attempts + CASE WHEN f.counted THEN 1 ELSE 0 END,
    last_error = f.last_error,
    available_at = CASE WHEN f.dead THEN m.available_at
                        ELSE statement_timestamp() + f.delay_us * interval '1 microsecond' END,
    dead_at = CASE WHEN f.dead THEN statement_timestamp() END
FROM (
    SELECT unnest(@ids::bigint[]) AS id,
           unnest(@errors::text[]) AS last_error,
           unnest(@delays_us::bigint[]) AS delay_us,
           unnest(@dead::boolean[]) AS dead,
           unnest(@counted::boolean[]) AS counted
) AS f
WHERE m.id = f.id AND m.published_at IS NULL AND m.dead_at IS NULL;

-- name: OldestPendingAge :one
-- Seconds since the oldest unpublished, live message was staged, by the
-- database clock; 0 when there is none.
SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS age_seconds
FROM outbox_messages
WHERE published_at IS NULL AND dead_at IS NULL;

-- name: NextDueIn :one
-- Seconds from now() until the earliest message not due at now() falls due,
-- or -1 when there is none. Run in the transaction of a claim that found
-- nothing, so now() is the claim's time; lets an idle relay wake for retries
-- and delayed messages sooner than its poll interval.
SELECT coalesce(extract(epoch FROM min(available_at) - now()), -1)::float8 AS due_in_seconds
FROM outbox_messages
WHERE published_at IS NULL AND dead_at IS NULL AND available_at > now();

-- name: RedriveMessages :many
-- Returns the given dead-lettered messages, by row id or message id, to
-- pending: dead_at cleared, attempts reset to 0, due now (by the database
-- clock). last_error is kept until the next attempt overwrites it. Returns
-- each message redriven with what it was before. Rows that are not dead
-- letters (pending, published, deleted, unknown) are left alone and not
-- returned. Dead rows are found through outbox_messages_dead_idx.
WITH picked AS MATERIALIZED (
    SELECT id, attempts, dead_at, last_error
    FROM outbox_messages
    WHERE dead_at IS NOT NULL
      AND (id = ANY(@row_ids::bigint[]) OR message_id = ANY((@message_ids::text[])::uuid[]))
    ORDER BY id
    FOR UPDATE
)
UPDATE outbox_messages AS m
SET dead_at = NULL, attempts = 0, available_at = now()
FROM picked AS p
WHERE m.id = p.id
RETURNING m.id, m.message_id, m.topic, coalesce(m.ordering_key, '')::text AS ordering_key,
          p.attempts AS previous_attempts, p.dead_at::timestamptz AS dead_at,
          coalesce(p.last_error, '')::text AS last_error;

-- name: RedriveDeadBatch :many
-- Like RedriveMessages, for up to batch_size of the messages of one topic
-- (or of every topic, topic '') dead-lettered at or before dead_before,
-- oldest first. The bound keeps a message that dies again meanwhile from
-- being redriven twice by one call.
WITH picked AS MATERIALIZED (
    SELECT id, attempts, dead_at, last_error
    FROM outbox_messages
    WHERE dead_at IS NOT NULL
      AND dead_at <= @dead_before::timestamptz
      AND (@topic::text = '' OR topic = @topic::text)
    ORDER BY dead_at, id
    LIMIT @batch_size::integer
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_messages AS m
SET dead_at = NULL, attempts = 0, available_at = now()
FROM picked AS p
WHERE m.id = p.id
RETURNING m.id, m.message_id, m.topic, coalesce(m.ordering_key, '')::text AS ordering_key,
          p.attempts AS previous_attempts, p.dead_at::timestamptz AS dead_at,
          coalesce(p.last_error, '')::text AS last_error;

-- name: DatabaseNow :one
-- The database clock.
SELECT now()::timestamptz AS now;

-- name: NotifyRelays :exec
-- Wakes the relays listening for this schema's messages, at commit, whether
-- or not one is idle (EnqueueMessages notifies only while one is): a redrive
-- is rare, and a busy relay ignores the wake-up until its next batch.
SELECT pg_notify(@channel::text, coalesce(current_schema(), ''));
