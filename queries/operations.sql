-- Read-only queries for operators: the gauges (package monitor), the
-- reaper's status page and the admin command (cmd/atomicphase), plus the
-- admin command's one write to idempotency_keys (FailKeyByOperator). Every
-- read goes through a partial index holding only the rows it reports
-- (pending or dead messages, running or failed keys), so its cost grows
-- with what an operator has to look at, not with the tables. The plans are
-- asserted in monitor/plan_test.go.

-- name: Snapshot :one
-- The figures of the gauges and the status page, in one statement:
--   pending messages and the oldest one's age: outbox_messages_pending_idx;
--   dead letters: an index-only count of outbox_messages_dead_idx;
--   running and stalled keys, the oldest stalled one's age:
--     idempotency_keys_running_created_at_idx (stalled: running, lease free
--     or expired, last run longer ago than stalled_after, as the Resumer
--     judges it);
--   failed keys: an index-only count of idempotency_keys_failed_idx.
-- Ages are by the database clock.
WITH pending AS (
    SELECT count(*) AS n, min(created_at) AS oldest
    FROM outbox_messages
    WHERE published_at IS NULL AND dead_at IS NULL
), running AS (
    SELECT count(*) AS n,
           count(*) FILTER (WHERE last_run_at <= now() - make_interval(secs => @stalled_after_seconds::float8)
                              AND (lease_token IS NULL OR leased_until <= now())) AS stalled,
           min(created_at) FILTER (WHERE last_run_at <= now() - make_interval(secs => @stalled_after_seconds::float8)
                                     AND (lease_token IS NULL OR leased_until <= now())) AS oldest_stalled
    FROM idempotency_keys
    WHERE status = 'running'
)
SELECT now()::timestamptz AS read_at,
       pending.n::bigint AS outbox_pending,
       coalesce(extract(epoch FROM now() - pending.oldest), 0)::float8 AS oldest_pending_age_seconds,
       (SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL)::bigint AS outbox_dead,
       running.n::bigint AS keys_running,
       running.stalled::bigint AS keys_stalled,
       coalesce(extract(epoch FROM now() - running.oldest_stalled), 0)::float8 AS oldest_stalled_age_seconds,
       (SELECT count(*) FROM idempotency_keys WHERE status = 'failed')::bigint AS keys_failed
FROM pending, running;

-- name: RecentFailedKeys :many
-- The most recently failed keys, newest first, through
-- idempotency_keys_failed_idx read backwards.
SELECT id, scope, key, workflow, recovery_point, attempts,
       coalesce(failure_reason, '')::text AS failure_reason,
       created_at, finished_at,
       coalesce(extract(epoch FROM now() - finished_at), 0)::float8 AS failed_seconds_ago
FROM idempotency_keys
WHERE status = 'failed'
ORDER BY finished_at DESC, id DESC
LIMIT @max_rows::integer;

-- name: RecentDeadLetters :many
-- The most recently dead-lettered messages, newest first, of one topic or
-- of all (topic ''), through outbox_messages_dead_idx read backwards.
SELECT id, message_id, topic, coalesce(ordering_key, '')::text AS ordering_key, attempts,
       coalesce(last_error, '')::text AS last_error, created_at, dead_at,
       coalesce(extract(epoch FROM now() - dead_at), 0)::float8 AS dead_seconds_ago
FROM outbox_messages
WHERE dead_at IS NOT NULL
  AND (@topic::text = '' OR topic = @topic::text)
ORDER BY dead_at DESC, id DESC
LIMIT @max_rows::integer;

-- name: CountDeadLetters :one
-- How many messages are dead-lettered, of one topic or of all (topic '').
SELECT count(*)::bigint AS dead
FROM outbox_messages
WHERE dead_at IS NOT NULL
  AND (@topic::text = '' OR topic = @topic::text);

-- name: TopicBacklog :many
-- Pending and dead-lettered messages per topic, with the oldest pending
-- message's age, through the two partial indexes.
SELECT t.topic,
       sum(t.pending)::bigint AS pending,
       sum(t.dead)::bigint AS dead,
       coalesce(extract(epoch FROM now() - min(t.oldest)), 0)::float8 AS oldest_pending_age_seconds
FROM (
    SELECT topic, count(*) AS pending, 0::bigint AS dead, min(created_at) AS oldest
    FROM outbox_messages
    WHERE published_at IS NULL AND dead_at IS NULL
    GROUP BY topic
    UNION ALL
    SELECT topic, 0::bigint, count(*), NULL::timestamptz
    FROM outbox_messages
    WHERE dead_at IS NOT NULL
    GROUP BY topic
) AS t
GROUP BY t.topic
ORDER BY t.topic;

-- name: ListStalledKeys :many
-- Stalled keys, oldest first: running, with a free or expired lease, and
-- last run longer ago than stalled_after (the Resumer's rule), through
-- idempotency_keys_running_created_at_idx.
SELECT id, scope, key, workflow, recovery_point, attempts, created_at, last_run_at,
       extract(epoch FROM now() - created_at)::float8 AS age_seconds,
       extract(epoch FROM now() - last_run_at)::float8 AS idle_seconds
FROM idempotency_keys
WHERE status = 'running'
  AND last_run_at <= now() - make_interval(secs => @stalled_after_seconds::float8)
  AND (lease_token IS NULL OR leased_until <= now())
ORDER BY created_at, id
LIMIT @max_rows::integer;

-- name: KeyDetail :one
-- Everything stored for one key, for the admin command's timeline. The
-- params are their exact stored bytes (or, for a row written before those
-- were kept, the jsonb column's text); the phase results are the
-- phase_results_raw object, members in commit order, and for older rows
-- the phase_results jsonb. Lease and ages are judged by the database clock.
SELECT id, scope, key, fingerprint, request_method, request_path,
       coalesce(request_params_raw, convert_to(coalesce(CAST(request_params AS text), 'null'), 'UTF8'))::bytea AS request_params,
       workflow, recovery_point, status, phase_results, phase_results_raw,
       lease_token, leased_until,
       (lease_token IS NOT NULL AND leased_until > now())::boolean AS lease_live,
       coalesce(extract(epoch FROM leased_until - now()), 0)::float8 AS lease_remaining_seconds,
       attempts, created_at, last_run_at, finished_at,
       response_status, response_headers, response_body, failure_reason,
       now()::timestamptz AS read_at
FROM idempotency_keys
WHERE scope = @scope AND key = @key;

-- name: KeyMessages :many
-- The outbox messages a key's phases staged, in commit order, through
-- outbox_messages_idempotency_key_id_idx.
SELECT id, message_id, topic, attempts, coalesce(last_error, '')::text AS last_error,
       created_at, published_at, dead_at
FROM outbox_messages
WHERE idempotency_key_id = @idempotency_key_id
ORDER BY id
LIMIT @max_rows::integer;

-- name: FailKeyByOperator :one
-- Fails a running key on an operator's order, as the Resumer fails one: a
-- stored terminal response that every later retry replays, and the reason.
-- Fenced like the Resumer's UPDATE: a key that a live attempt holds (lease
-- not expired) or that is already terminal is not touched, and no row comes
-- back. An attempt whose lease had expired and that is still at work finds
-- the lease gone at its next commit and commits nothing (fencing).
UPDATE idempotency_keys
SET status = 'failed',
    failure_reason = @failure_reason::text,
    response_status = @response_status::integer,
    response_headers = sqlc.arg(response_headers)::text::jsonb,
    response_body = @response_body::bytea,
    finished_at = now(),
    lease_token = NULL,
    leased_until = NULL
WHERE scope = @scope AND key = @key
  AND status = 'running'
  AND (lease_token IS NULL OR leased_until <= now())
RETURNING id, finished_at;

-- name: DatabaseIdentity :one
-- Which database and schema a status page or a command is looking at.
SELECT current_database()::text AS database, coalesce(current_schema(), '')::text AS schema,
       now()::timestamptz AS now;
