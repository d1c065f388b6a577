-- name: LookupKey :one
-- The request path's read: everything needed to replay, reject or resume,
-- except the stored params (the caller has its own). lease_live is judged by
-- the database clock.
SELECT id, fingerprint, workflow, recovery_point, phase_results, status,
       (lease_token IS NOT NULL AND leased_until > now())::boolean AS lease_live,
       coalesce(greatest(extract(epoch FROM leased_until - now()), 0), 0)::float8 AS lease_remaining_seconds,
       attempts, response_status, response_headers, response_body
FROM idempotency_keys
WHERE scope = @scope AND key = @key;

-- name: LookupKeyForResume :one
-- Like LookupKey, with the stored request, for resuming without the client.
SELECT id, fingerprint, request_method, request_path, request_params, workflow,
       recovery_point, phase_results, status,
       (lease_token IS NOT NULL AND leased_until > now())::boolean AS lease_live,
       coalesce(greatest(extract(epoch FROM leased_until - now()), 0), 0)::float8 AS lease_remaining_seconds,
       attempts, response_status, response_headers, response_body
FROM idempotency_keys
WHERE scope = @scope AND key = @key;

-- name: InsertKey :one
-- Creates a running key, taking a transaction-scoped advisory lock on
-- (scope, key) first, without waiting, so that a concurrent attempt whose
-- insert is uncommitted makes this return no row at once instead of waiting
-- on the unique index. The lock's hash is seeded with the table's oid, so
-- installations in other schemas of the same database never share a lock.
-- ON CONFLICT's check reads the unique index with a dirty snapshot, which
-- takes no SERIALIZABLE predicate lock; in a SERIALIZABLE single-phase run,
-- a conflicting row committed after the transaction's snapshot raises a
-- serialization failure, so the run is retried (and replays) before its
-- function ever runs. A workflow key holds a lease from the start; a
-- single-phase key (NULL token) is invisible to others until it commits,
-- finished.
INSERT INTO idempotency_keys (
    scope, key, fingerprint, request_method, request_path, request_params,
    workflow, recovery_point, phase_results, status, lease_token, leased_until,
    attempts, created_at, last_run_at
)
SELECT @scope, @key, @fingerprint, @request_method, @request_path, @request_params,
       @workflow, 'started', '{}'::jsonb, 'running', sqlc.narg(lease_token)::uuid,
       CASE WHEN sqlc.narg(lease_token)::uuid IS NOT NULL
            THEN now() + make_interval(secs => @lease_seconds::float8) END,
       1, now(), now()
WHERE pg_try_advisory_xact_lock(
    hashtextextended(length(@scope::text)::text || ':' || @scope::text || @key::text,
                    'idempotency_keys'::regclass::oid::bigint))
ON CONFLICT (scope, key) DO NOTHING
RETURNING id, ctid;

-- name: InsertSingleKey :one
-- Starts a single-phase run: like InsertKey (same lock, same ON CONFLICT
-- check before the function runs), but the row is inserted already terminal
-- with a provisional 500, since nobody can see it before it commits with its
-- real response. FinishSingleKey then changes only unindexed columns, a HOT
-- update, instead of rewriting the row and its index entries.
INSERT INTO idempotency_keys (
    scope, key, fingerprint, request_method, request_path, request_params,
    workflow, recovery_point, phase_results, status, attempts, created_at,
    last_run_at, finished_at, response_status
)
SELECT @scope, @key, @fingerprint, @request_method, @request_path, @request_params,
       '', 'finished', '{}'::jsonb, 'finished', 1, now(), now(), now(), 500
WHERE pg_try_advisory_xact_lock(
    hashtextextended(length(@scope::text)::text || ':' || @scope::text || @key::text,
                    'idempotency_keys'::regclass::oid::bigint))
ON CONFLICT (scope, key) DO NOTHING
RETURNING id, ctid;

-- name: TakeOverKey :one
-- Takes the lease of a running key whose lease is free or expired, with a new
-- token. Returns no row if another attempt holds a live lease or the key is
-- terminal.
UPDATE idempotency_keys
SET lease_token = @lease_token,
    leased_until = now() + make_interval(secs => @lease_seconds::float8),
    attempts = attempts + 1,
    last_run_at = now()
WHERE id = @id
  AND status = 'running'
  AND (lease_token IS NULL OR leased_until <= now())
RETURNING ctid, recovery_point, phase_results, attempts;

-- Fenced updates. The lease holder addresses its row by ctid (a TID scan
-- locks only the tuple, where an index scan would take a predicate lock on
-- a whole btree page shared with unrelated keys) and by id and lease token:
-- no row means the row moved (see LocateHeldKey) or the lease was lost.

-- name: CommitPhase :one
-- Records a committed phase in the phase's own transaction.
UPDATE idempotency_keys
SET recovery_point = @phase::text,
    phase_results = phase_results || jsonb_build_object(@phase::text, @result::jsonb),
    leased_until = now() + make_interval(secs => @lease_seconds::float8),
    last_run_at = now()
WHERE ctid = @tid AND id = @id AND lease_token = @lease_token AND status = 'running'
RETURNING ctid;

-- name: ExtendLease :one
-- Extends a held lease (before a foreign call).
UPDATE idempotency_keys
SET leased_until = now() + make_interval(secs => @lease_seconds::float8),
    last_run_at = now()
WHERE ctid = @tid AND id = @id AND lease_token = @lease_token AND status = 'running'
RETURNING ctid;

-- name: LocateHeldKey :one
-- Finds the current ctid of a key whose lease this attempt still holds;
-- no row means the lease was lost.
SELECT ctid FROM idempotency_keys
WHERE id = @id AND lease_token = @lease_token AND status = 'running';

-- name: FinishKey :one
-- Stores the terminal response and releases the lease (a single-phase run
-- has no lease: its token is NULL).
UPDATE idempotency_keys
SET status = 'finished',
    recovery_point = @recovery_point,
    response_status = @response_status,
    response_headers = @response_headers,
    response_body = @response_body,
    finished_at = now(),
    last_run_at = now(),
    lease_token = NULL,
    leased_until = NULL
WHERE ctid = @tid AND id = @id AND lease_token IS NOT DISTINCT FROM sqlc.narg(lease_token)::uuid
  AND status = 'running'
RETURNING ctid;

-- name: ReleaseKey :execrows
-- Frees the lease after a transient error; the recovery point stays, so a
-- retry or the resumer continues from it. Runs in its own transaction.
UPDATE idempotency_keys
SET lease_token = NULL, leased_until = NULL, last_run_at = now()
WHERE id = @id AND lease_token = @lease_token AND status = 'running';

-- name: FinishSingleKey :exec
-- Ends a single-phase run: stores the response in the row InsertSingleKey
-- inserted (unindexed columns only: a HOT update). It is sent in one round
-- trip with COMMIT, so it must fail, not match nothing, if the row is not
-- where the run left it: 1/count(*) raises division_by_zero on zero rows,
-- which aborts the transaction and makes the pipelined COMMIT a no-op.
WITH stored AS (
    UPDATE idempotency_keys
    SET response_status = @response_status,
        response_headers = @response_headers,
        response_body = @response_body
    WHERE ctid = @tid AND id = @id AND lease_token IS NULL AND status = 'finished'
    RETURNING 1
)
SELECT 1 / count(*)::integer FROM stored;
