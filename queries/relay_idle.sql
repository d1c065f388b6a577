-- The relays' idle lock: the one session-scoped state the library keeps
-- besides the relay's LISTEN, and like it only on a relay's own connections
-- with notifications on (outbox.Config.DisableNotify false), never behind a
-- transaction-pooling PgBouncer. EnqueueMessages probes it shared.

-- name: LockRelayIdle :exec
-- Takes, on a relay's own connection, the session-scoped advisory lock that
-- announces a relay idle and listening: while it is held or awaited, every
-- EnqueueMessages notifies. Taking it waits for the producers that skipped
-- their notification (they hold the lock shared until they end), so a batch
-- run after it returns sees their rows. The wait is bounded by the session's
-- lock_timeout. The lock is named after the outbox_messages table's oid, so
-- installations in other schemas of one database do not share it.
SELECT pg_advisory_lock(@idle_lock_class::integer,
    ('outbox_messages'::regclass::oid::bigint - 2147483648)::integer);

-- name: UnlockRelayIdle :exec
-- Releases the lock LockRelayIdle took: the relay is busy again.
SELECT pg_advisory_unlock(@idle_lock_class::integer,
    ('outbox_messages'::regclass::oid::bigint - 2147483648)::integer);

-- name: RelayIdleHeldElsewhere :one
-- Reports whether another session holds the idle lock (another relay is idle
-- and listening, so producers notify), as opposed to producers holding it
-- shared.
SELECT EXISTS (
    SELECT FROM pg_catalog.pg_locks
    WHERE locktype = 'advisory' AND granted AND mode = 'ExclusiveLock'
      AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
      AND classid = (@idle_lock_class::integer)::oid
      AND objid = (('outbox_messages'::regclass::oid::bigint - 2147483648)::integer)::oid
      AND objsubid = 2 AND pid <> pg_backend_pid()
) AS held;
