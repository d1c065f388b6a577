-- name: FailStalledKeys :many
-- Fails up to batch_size stalled keys that meet a failure rule, in one
-- statement: each row is locked (SKIP LOCKED, so concurrent resumers split
-- the work), and the UPDATE is fenced again on status and lease, so a key
-- that a live attempt holds is never failed. The response is terminal and
-- replayed to every later retry of the key. Times are the database clock's.
-- Rules apply in this order everywhere: unknown_workflow, max_attempts, max_age.
WITH candidates AS MATERIALIZED (
    SELECT id,
           CASE
               WHEN workflow <> ALL (@registered::text[])
                    AND created_at <= now() - make_interval(secs => @unknown_workflow_delay_seconds::float8)
                   THEN 'unknown_workflow'
               WHEN attempts >= @max_attempts::integer
                   THEN 'max_attempts'
               ELSE 'max_age'
           END::text AS reason
    FROM idempotency_keys
    WHERE status = 'running'
      AND last_run_at <= now() - make_interval(secs => @resume_delay_seconds::float8)
      AND (lease_token IS NULL OR leased_until <= now())
      AND ((workflow <> ALL (@registered::text[])
            AND created_at <= now() - make_interval(secs => @unknown_workflow_delay_seconds::float8))
           OR attempts >= @max_attempts::integer
           OR created_at <= now() - make_interval(secs => @max_age_seconds::float8))
    ORDER BY created_at
    LIMIT @batch_size::integer
    FOR UPDATE SKIP LOCKED
)
UPDATE idempotency_keys AS k
SET status = 'failed',
    failure_reason = c.reason,
    response_status = @response_status::integer,
    response_headers = sqlc.arg(response_headers)::text::jsonb,
    response_body = CASE c.reason
                        WHEN 'unknown_workflow' THEN @unknown_workflow_body::bytea
                        WHEN 'max_attempts' THEN @max_attempts_body::bytea
                        ELSE @max_age_body::bytea
                    END,
    finished_at = now(),
    lease_token = NULL,
    leased_until = NULL
FROM candidates AS c
WHERE k.id = c.id
  AND k.status = 'running'
  AND (k.lease_token IS NULL OR k.leased_until <= now())
RETURNING k.id, k.scope, k.key, k.workflow, k.recovery_point, k.attempts, c.reason;

-- name: ClaimStalledKeys :many
-- Claims up to batch_size stalled keys that a registered workflow can resume
-- and no failure rule applies to. The claim only moves last_run_at to now(),
-- which hides the keys from other resumers for one resume delay; it takes no
-- lease, so a client retry can still take a key over, and the resume itself
-- takes the lease atomically (the claim spreads work, the lease excludes).
WITH candidates AS MATERIALIZED (
    SELECT id
    FROM idempotency_keys
    WHERE status = 'running'
      AND last_run_at <= now() - make_interval(secs => @resume_delay_seconds::float8)
      AND (lease_token IS NULL OR leased_until <= now())
      AND workflow = ANY (@registered::text[])
      AND workflow <> ''
      AND attempts < @max_attempts::integer
      AND created_at > now() - make_interval(secs => @max_age_seconds::float8)
    ORDER BY created_at
    LIMIT @batch_size::integer
    FOR UPDATE SKIP LOCKED
)
UPDATE idempotency_keys AS k
SET last_run_at = now()
FROM candidates AS c
WHERE k.id = c.id
  AND k.status = 'running'
  AND (k.lease_token IS NULL OR k.leased_until <= now())
RETURNING k.id, k.scope, k.key, k.workflow;

-- name: CountStalledKeys :one
-- What a recovery round would do now: keys it would fail (by rule), resume,
-- or leave waiting (unregistered workflows younger than the delay).
WITH stalled AS (
    SELECT (workflow <> ALL (@registered::text[])) AS unregistered,
           (workflow <> ALL (@registered::text[])
            AND created_at <= now() - make_interval(secs => @unknown_workflow_delay_seconds::float8)) AS unknown_due,
           attempts >= @max_attempts::integer AS attempts_due,
           created_at <= now() - make_interval(secs => @max_age_seconds::float8) AS age_due
    FROM idempotency_keys
    WHERE status = 'running'
      AND last_run_at <= now() - make_interval(secs => @resume_delay_seconds::float8)
      AND (lease_token IS NULL OR leased_until <= now())
)
SELECT count(*) FILTER (WHERE unknown_due)::bigint AS unknown_workflow,
       count(*) FILTER (WHERE NOT unknown_due AND attempts_due)::bigint AS max_attempts,
       count(*) FILTER (WHERE NOT unknown_due AND NOT attempts_due AND age_due)::bigint AS max_age,
       count(*) FILTER (WHERE NOT unregistered AND NOT attempts_due AND NOT age_due)::bigint AS resumable,
       count(*) FILTER (WHERE unregistered AND NOT unknown_due AND NOT attempts_due AND NOT age_due)::bigint AS waiting
FROM stalled;

-- name: TryLockCleanup :one
-- Takes, without waiting, the transaction-scoped advisory lock that lets one
-- cleaner at a time delete from this installation's tables. It ends with the
-- batch's transaction, so no lock outlives it on a pooled server connection.
-- The lock is named after the idempotency_keys table's oid, so installations
-- in other schemas of the same database do not exclude each other.
SELECT pg_try_advisory_xact_lock(@lock_class::integer,
    ('idempotency_keys'::regclass::oid::bigint - 2147483648)::integer)::boolean AS locked;

-- name: DeleteExpiredKeys :one
-- Deletes up to batch_size terminal keys finished more than ttl ago, oldest
-- first, in one statement (one short transaction), and unlinks the outbox
-- messages they wrote (the column is a plain reference, not a foreign key,
-- so that phases take no foreign-key locks). A running key is never
-- deleted, whatever its age. Unless tombstone_seconds is 0, each deleted
-- key leaves a tombstone kept tombstone_seconds, in the same statement: no
-- key is ever deleted without one.
--
-- The batch is read without row locks and deleted by ctid (a TID scan, one
-- heap visit per row, where joining on id probed the primary key for each
-- and FOR UPDATE wrote a lock record per row before the delete's own).
-- That is safe because nothing else locks or updates a terminal key: the
-- runner and the resumer change only running keys, and only one cleaner
-- deletes at a time (the cleanup lock). A row some other session does lock
-- (an operator's SELECT ... FOR UPDATE) is waited for, not skipped; a row
-- changed meanwhile is deleted only if its new version still qualifies (the
-- conditions are repeated in the DELETE), or left to the next round.
--
-- after is where the previous batch of the round stopped (the latest
-- finished_at it deleted; the zero time for a round's first batch): the scan
-- starts there instead of walking again over the index entries of every key
-- deleted earlier in the round, which stay in the index until vacuum.
-- Nothing eligible is left behind below it: finished_at is written once,
-- when a key finishes, a TTL (at least a day) before it is eligible. The
-- statement returns where the next batch starts: this batch's latest
-- finished_at, or after when it deleted nothing.
WITH batch AS MATERIALIZED (
    SELECT ctid
    FROM idempotency_keys
    WHERE status <> 'running'
      AND finished_at <= now() - make_interval(secs => @ttl_seconds::float8)
      AND finished_at >= @after::timestamptz
    ORDER BY finished_at
    LIMIT @batch_size::integer
), deleted AS (
    DELETE FROM idempotency_keys AS k
    WHERE k.ctid = ANY (ARRAY(SELECT b.ctid FROM batch AS b))
      AND k.status <> 'running'
      AND k.finished_at <= now() - make_interval(secs => @ttl_seconds::float8)
    RETURNING k.id, k.scope, k.key, k.fingerprint, k.finished_at, k.response_status
), unlinked AS (
    UPDATE outbox_messages AS m
    SET idempotency_key_id = NULL
    FROM deleted AS d
    WHERE m.idempotency_key_id = d.id
    RETURNING m.id
), buried AS (
    INSERT INTO idempotency_key_tombstones AS t
        (scope, key_hash, fingerprint, finished_at, response_status, expires_at)
    SELECT d.scope, sha256(convert_to(d.key, 'UTF8')), d.fingerprint, d.finished_at, d.response_status,
           now() + make_interval(secs => @tombstone_seconds::float8)
    FROM deleted AS d
    WHERE @tombstone_seconds::float8 > 0
    ON CONFLICT (scope, key_hash) DO UPDATE
    SET fingerprint = excluded.fingerprint, finished_at = excluded.finished_at,
        response_status = excluded.response_status, expires_at = excluded.expires_at
    RETURNING 1
)
SELECT count(*)::bigint AS deleted, coalesce(max(finished_at), @after::timestamptz)::timestamptz AS next_after FROM deleted;

-- name: DeleteExpiredTombstones :one
-- Deletes up to batch_size tombstones past their expiry, oldest first: the
-- keys they stood for are free again.
--
-- As in DeleteExpiredKeys, the batch is read without row locks and deleted
-- by ctid (a TID scan, where joining on the primary key probed it for each
-- row, at random places since it is keyed by a hash, and FOR UPDATE wrote a
-- lock record per row before the delete's own). Only the cleaner writes
-- tombstones, under the cleanup lock. A tombstone some other session does
-- lock is waited for, not skipped; one changed meanwhile is deleted only if
-- its new version is still expired (a newer deletion of its key renews it),
-- or left to the next round.
--
-- after is where the previous batch of the round stopped (the latest
-- expires_at it deleted; the zero time for a round's first batch): the scan
-- starts there instead of walking again over the index entries of every
-- tombstone deleted earlier in the round. Nothing expired is left behind
-- below it: a tombstone's expires_at is set when it is written or renewed,
-- to a time after now(). The statement returns where the next batch starts:
-- this batch's latest expires_at, or after when it deleted nothing.
WITH batch AS MATERIALIZED (
    SELECT ctid
    FROM idempotency_key_tombstones
    WHERE expires_at <= now()
      AND expires_at >= @after::timestamptz
    ORDER BY expires_at
    LIMIT @batch_size::integer
), deleted AS (
    DELETE FROM idempotency_key_tombstones AS t
    WHERE t.ctid = ANY (ARRAY(SELECT b.ctid FROM batch AS b))
      AND t.expires_at <= now()
    RETURNING t.expires_at
)
SELECT count(*)::bigint AS deleted, coalesce(max(expires_at), @after::timestamptz)::timestamptz AS next_after FROM deleted;

-- name: DeleteExpiredOutboxMessages :execrows
-- Deletes up to batch_size outbox rows published or dead-lettered more than
-- retention ago, oldest first, in one statement. Pending rows are never
-- deleted.
WITH batch AS MATERIALIZED (
    SELECT id
    FROM outbox_messages
    WHERE (published_at IS NOT NULL OR dead_at IS NOT NULL)
      AND coalesce(published_at, dead_at) <= now() - make_interval(secs => @retention_seconds::float8)
    ORDER BY coalesce(published_at, dead_at)
    LIMIT @batch_size::integer
    FOR UPDATE SKIP LOCKED
)
DELETE FROM outbox_messages AS m
USING batch AS b
WHERE m.id = b.id;

-- name: CountExpired :one
-- What a cleanup round would delete now.
SELECT (SELECT count(*)
        FROM idempotency_keys
        WHERE status <> 'running'
          AND finished_at <= now() - make_interval(secs => @ttl_seconds::float8))::bigint AS keys,
       (SELECT count(*)
        FROM outbox_messages
        WHERE (published_at IS NOT NULL OR dead_at IS NOT NULL)
          AND coalesce(published_at, dead_at) <= now() - make_interval(secs => @retention_seconds::float8))::bigint AS outbox_messages;
