-- name: LookupKey :one
-- The request path's read: everything needed to replay or reject the call.
-- lease_live is judged by the database clock. Always one row: for a missing
-- key, id is NULL and new_id is the id the key will be inserted with
-- (InsertFinishedKey takes it back), so that a run knows its key's
-- id before the insert, which comes after the function; with reject_expired, expired tells whether the key was cleaned
-- up, so that such a retry runs nothing. (The insert checks again, for a
-- key cleaned up between the two.) The tombstone probe is the body of
-- atomicphase_key_tombstoned (00009) written out: PostgreSQL does not
-- inline a SQL function whose body holds a subquery, and calling it cost
-- 0.15 ms of this statement's 0.17 at c=8 (pg_stat_statements), against
-- a few microseconds for the same probe planned with the statement.
SELECT k.id, k.fingerprint, k.workflow, k.recovery_point, k.status,
       coalesce(k.lease_token IS NOT NULL AND k.leased_until > now(), false)::boolean AS lease_live,
       coalesce(greatest(extract(epoch FROM k.leased_until - now()), 0), 0)::float8 AS lease_remaining_seconds,
       k.attempts, k.response_status, k.response_headers, k.response_body,
       CASE WHEN k.id IS NULL THEN nextval('idempotency_keys_id_seq') ELSE 0 END::bigint AS new_id,
       CASE WHEN k.id IS NULL AND @reject_expired::boolean
            THEN EXISTS (SELECT FROM idempotency_key_tombstones t
                         WHERE t.scope = @scope AND t.key_hash = sha256(convert_to(@key::text, 'UTF8'))
                           AND t.expires_at > now())
            ELSE false END::boolean AS expired
FROM (SELECT 1) AS one
LEFT JOIN idempotency_keys k ON k.scope = @scope AND k.key = @key;

-- name: LookupWorkflowKey :one
-- LookupKey for RunWorkflow: always one row. For a missing key, id is NULL,
-- and new_id and seed are the id and the foreign-key seed the key will be
-- inserted with (InsertKey takes them back), so that the attempt knows its
-- key's id and can derive foreign keys before the insert, which waits for
-- the workflow's first commit, and there for its first statement. The seed is the
-- body of atomicphase_foreign_key_seed (00010) written out, planned with
-- the statement (see LookupKey). With reject_expired, expired tells, as in
-- LookupKey, that the key was cleaned up, so that such a retry runs
-- nothing (its first phase would otherwise run up to its first statement,
-- which carries the insert that refuses the key).
SELECT k.id, k.fingerprint, k.workflow, k.recovery_point, k.status,
       coalesce(k.lease_token IS NOT NULL AND k.leased_until > now(), false)::boolean AS lease_live,
       coalesce(greatest(extract(epoch FROM k.leased_until - now()), 0), 0)::float8 AS lease_remaining_seconds,
       k.attempts, k.response_status, k.response_headers, k.response_body,
       CASE WHEN k.id IS NULL
            THEN coalesce((SELECT (extract(epoch FROM t.finished_at) * 1000000)::bigint
                           FROM idempotency_key_tombstones t
                           WHERE t.scope = @scope AND t.key_hash = sha256(convert_to(@key::text, 'UTF8'))), 0)
            ELSE 0 END::bigint AS seed,
       CASE WHEN k.id IS NULL THEN nextval('idempotency_keys_id_seq') ELSE 0 END::bigint AS new_id,
       CASE WHEN k.id IS NULL AND @reject_expired::boolean
            THEN EXISTS (SELECT FROM idempotency_key_tombstones t
                         WHERE t.scope = @scope AND t.key_hash = sha256(convert_to(@key::text, 'UTF8'))
                           AND t.expires_at > now())
            ELSE false END::boolean AS expired
FROM (SELECT 1) AS one
LEFT JOIN idempotency_keys k ON k.scope = @scope AND k.key = @key;

-- name: LookupKeyForResume :one
-- Like LookupKey, with the stored request, for resuming without the client:
-- the params' exact bytes, or for a row written before they were kept, the
-- jsonb column's text.
SELECT id, fingerprint, request_method, request_path,
       coalesce(request_params_raw, convert_to(CAST(request_params AS text), 'UTF8')) AS request_params,
       workflow, recovery_point, status,
       (lease_token IS NOT NULL AND leased_until > now())::boolean AS lease_live,
       coalesce(greatest(extract(epoch FROM leased_until - now()), 0), 0)::float8 AS lease_remaining_seconds,
       attempts, response_status, response_headers, response_body
FROM idempotency_keys
WHERE scope = @scope AND key = @key;

-- name: InsertKey :one
-- Creates a running workflow key holding a lease, on its own (before a
-- Foreign phase that comes first) or first thing in a phase's transaction
-- (an attempt that lost the key before, or a terminal response stored
-- without Finish): a workflow's first Atomic phase or Finish inserts its
-- key with its commit instead (InsertKeyAtPhase, InsertFinishedKey). It
-- takes the transaction-scoped advisory lock on (scope, key) first,
-- without waiting, so that a concurrent attempt whose insert is
-- uncommitted makes this return no row at once instead of waiting on the
-- unique index. The lock's hash is seeded with the table's oid, so
-- installations in other schemas of the same database never share a lock.
-- ON CONFLICT's check reads the unique index with a dirty snapshot, which
-- takes no SERIALIZABLE predicate lock; a conflicting row committed after
-- the transaction's snapshot raises a serialization failure (retried: the
-- retry's snapshot has it, and returns no row). Params are stored as their
-- canonical bytes (request_params_raw), not as jsonb. A key with a live
-- tombstone (deleted after its TTL) raises AP002 when reject_expired is
-- set (atomicphase_refuse_tombstoned, called only when the probe written
-- out here, planned with the statement, found one); otherwise
-- reused_expired says it was one. The foreign-key seed is stored with the
-- row (migration 00010): the one LookupWorkflowKey read, or if NULL,
-- computed here; so is the id it allotted.
WITH ins AS (
    INSERT INTO idempotency_keys (
        id, scope, key, fingerprint, request_method, request_path, request_params_raw,
        workflow, recovery_point, phase_results, status, lease_token, leased_until,
        attempts, created_at, last_run_at, foreign_key_seed
    )
    SELECT @id, @scope, @key, @fingerprint, @request_method, @request_path, @request_params::bytea,
           @workflow, 'started', '{}'::jsonb, 'running', @lease_token::uuid,
           clock_timestamp() + make_interval(secs => @lease_seconds::float8),
           1, now(), now(), coalesce(sqlc.narg(seed)::bigint, atomicphase_foreign_key_seed(@scope, @key))
    WHERE pg_try_advisory_xact_lock(
        hashtextextended(length(@scope::text)::text || ':' || @scope::text || @key::text,
                        'idempotency_keys'::regclass::oid::bigint))
      AND (NOT @reject_expired::boolean
           OR NOT EXISTS (SELECT FROM idempotency_key_tombstones t
                         WHERE t.scope = @scope AND t.key_hash = sha256(convert_to(@key::text, 'UTF8'))
                           AND t.expires_at > now())
           OR atomicphase_refuse_tombstoned(@scope, @key))
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING id, ctid, foreign_key_seed,
        (NOT @reject_expired::boolean
         AND EXISTS (SELECT FROM idempotency_key_tombstones t
                     WHERE t.scope = @scope AND t.key_hash = sha256(convert_to(@key::text, 'UTF8'))
                       AND t.expires_at > now()))::boolean AS reused_expired
)
SELECT ins.id::bigint AS id, ins.ctid, ins.foreign_key_seed, coalesce(ins.reused_expired, false)::boolean AS reused_expired
FROM (SELECT 1) AS one
JOIN ins ON true;

-- name: InsertKeyAtPhase :one
-- Inserts a workflow's key with its first phase's commit, in the
-- transaction that took the key's lock (TakeKeyLock) and holds the
-- phase's writes: running, leased, at the phase's recovery point with its
-- result (member, as CommitPhase's), so that the row is written once where
-- an insert followed by an update of it would write it twice. The id and
-- seed are the ones LookupWorkflowKey allotted. It goes out in one round
-- trip with COMMIT, so it fails rather than insert nothing: a key committed
-- since the lookup (the lock was free by then) raises a unique violation,
-- or a serialization failure when the row is not in the transaction's
-- snapshot, and a key whose tombstone appeared since raises AP002; the
-- error aborts the transaction and makes the pipelined COMMIT a no-op. The
-- lease counts from clock_timestamp(), the time of this statement.
-- reused_expired tells that the key reuses an expired one.
INSERT INTO idempotency_keys (
    id, scope, key, fingerprint, request_method, request_path, request_params_raw,
    workflow, recovery_point, phase_results, phase_results_raw, status, lease_token, leased_until,
    attempts, created_at, last_run_at, foreign_key_seed
)
SELECT @id, @scope, @key, @fingerprint, @request_method, @request_path, @request_params::bytea,
       @workflow, @phase::text, '{}'::jsonb, '{'::bytea || @member::bytea || '}'::bytea, 'running', @lease_token::uuid,
       clock_timestamp() + make_interval(secs => @lease_seconds::float8),
       1, now(), now(), coalesce(sqlc.narg(seed)::bigint, atomicphase_foreign_key_seed(@scope, @key))
WHERE NOT @reject_expired::boolean
   OR NOT EXISTS (SELECT FROM idempotency_key_tombstones t
                  WHERE t.scope = @scope AND t.key_hash = sha256(convert_to(@key::text, 'UTF8'))
                    AND t.expires_at > now())
   OR atomicphase_refuse_tombstoned(@scope, @key)
RETURNING id, ctid,
    (NOT @reject_expired::boolean
     AND EXISTS (SELECT FROM idempotency_key_tombstones t
                 WHERE t.scope = @scope AND t.key_hash = sha256(convert_to(@key::text, 'UTF8'))
                   AND t.expires_at > now()))::boolean AS reused_expired;

-- name: TakeKeyLock :one
-- Takes the key of a single-phase run, or of a workflow's first Atomic
-- phase or Finish, for its transaction: the transaction-scoped advisory
-- lock on (scope, key) that every insert of the key takes (see InsertKey),
-- so that a concurrent attempt gets ErrKeyInUse at once. Nothing is
-- written: the row is inserted once, with the commit (InsertFinishedKey,
-- InsertKeyAtPhase), where an insert followed by an update of its row
-- would write it twice. When it goes out in one round trip with BEGIN and
-- the function's first statement (must_take), it fails
-- (1/0 raises division_by_zero) when the key is held: the error aborts the
-- transaction before the function's statement runs, which could otherwise
-- wait on the rows of the attempt that holds the key. Sent on its own (a
-- run that lost the key before tries again), it returns false instead,
-- which leaves no error in the server's log. The lock is volatile, so no
-- plan folds the division ahead of it. xid is the transaction's id (the run
-- writes its key row, so it would be given one anyway): KeyOutcome asks,
-- after a run that did not end as the library ended it, whether it
-- committed. server_started tells the server's lifetime: after a restart or
-- a failover the same xid may name another transaction.
SELECT CASE WHEN @must_take::boolean
            THEN 1 / pg_try_advisory_xact_lock(
                     hashtextextended(length(@scope::text)::text || ':' || @scope::text || @key::text,
                                      'idempotency_keys'::regclass::oid::bigint))::integer = 1
            ELSE pg_try_advisory_xact_lock(
                     hashtextextended(length(@scope::text)::text || ':' || @scope::text || @key::text,
                                      'idempotency_keys'::regclass::oid::bigint))
       END::boolean AS taken,
       pg_current_xact_id()::text::bigint AS xid,
       pg_postmaster_start_time()::timestamptz AS server_started;

-- name: KeyOutcome :one
-- What a single-phase run (or a workflow's first phase, which inserts its
-- key with its commit) that did not end as the library ends it left
-- behind, read on its own once its connection is back: whether (scope,
-- key) has a committed row, and the status of the run's transaction (tx_id and
-- server_started from TakeKeyLock): 'committed', 'aborted', 'in progress'
-- (it still holds the key's lock: LockKey waits for it), or 'unknown' when it
-- cannot be told (no transaction began, or the server is not the one that
-- ran it: restarted, or another after a failover). A run whose function
-- failed or answered with a response that is not stored may have taken the
-- key's lock just after a twin committed, unseen by its snapshot: the
-- twin's commit was visible before its lock was free, so stored tells. A
-- transaction that committed without the library was committed by the
-- function itself (COMMIT sent as SQL, seen or not): its key must be failed.
SELECT EXISTS (SELECT FROM idempotency_keys WHERE scope = @scope AND key = @key)::boolean AS stored,
       coalesce(CASE WHEN pg_postmaster_start_time() = @server_started::timestamptz
                     THEN pg_xact_status(nullif(@tx_id::bigint, 0)::text::xid8)
                END, 'unknown')::text AS status;

-- name: InsertFinishedKey :one
-- Ends a single-phase run, or a workflow whose first commit is its Finish
-- (workflow is empty for a run): inserts its key, finished, with the
-- response, in the transaction that took it (TakeKeyLock) and holds the
-- function's writes. The id is the one the lookup allotted. It goes out in
-- one round trip with COMMIT, so it fails rather than insert nothing: a key
-- committed since the lookup (the lock was free by then) raises a unique
-- violation, or a serialization failure when the row is not in the
-- transaction's snapshot, and a key whose tombstone appeared since raises
-- AP002; the error aborts the transaction and makes the pipelined COMMIT a
-- no-op. reused_expired tells that the key reuses an expired one
-- (ExpiredKeyAllow).
INSERT INTO idempotency_keys (
    id, scope, key, fingerprint, request_method, request_path, request_params_raw,
    workflow, recovery_point, phase_results, status, attempts, created_at,
    last_run_at, finished_at, response_status, response_headers, response_body
)
SELECT @id, @scope, @key, @fingerprint, @request_method, @request_path, @request_params::bytea,
       @workflow, 'finished', '{}'::jsonb, 'finished', 1, now(), now(), now(),
       @response_status::integer, sqlc.arg(response_headers)::text::jsonb, @response_body::bytea
WHERE NOT @reject_expired::boolean
   OR NOT EXISTS (SELECT FROM idempotency_key_tombstones t
                  WHERE t.scope = @scope AND t.key_hash = sha256(convert_to(@key::text, 'UTF8'))
                    AND t.expires_at > now())
   OR atomicphase_refuse_tombstoned(@scope, @key)
RETURNING (NOT @reject_expired::boolean
           AND EXISTS (SELECT FROM idempotency_key_tombstones t
                       WHERE t.scope = @scope AND t.key_hash = sha256(convert_to(@key::text, 'UTF8'))
                         AND t.expires_at > now()))::boolean AS reused_expired;

-- name: InsertFailedKey :execrows
-- Stores, failed, the key of a single-phase run, or of a workflow's first
-- phase, whose function ended its transaction through SQL
-- (failure.ReasonEndedByFunction): the key row was to be inserted with the
-- transaction's commit, and what the function wrote before may have
-- committed without it, so the operation must not run again. workflow is
-- empty for a single-phase run. No row when a twin stored the key first.
INSERT INTO idempotency_keys (
    id, scope, key, fingerprint, request_method, request_path, request_params_raw,
    workflow, recovery_point, phase_results, status, attempts, created_at,
    last_run_at, finished_at, response_status, response_headers, response_body, failure_reason
)
VALUES (@id, @scope, @key, @fingerprint, @request_method, @request_path, @request_params::bytea,
        @workflow, 'finished', '{}'::jsonb, 'failed', 1, now(), now(), now(),
        @response_status::integer, sqlc.arg(response_headers)::text::jsonb, @response_body::bytea, @failure_reason)
ON CONFLICT DO NOTHING;

-- name: TakeOverKey :one
-- Takes the lease of a running key whose lease is free or expired, with a new
-- token, unless the key was created more than max_age ago: then, in the same
-- statement, it fails the key instead (status failed, reason max_age, the
-- given terminal response), so that no attempt ever resumes an operation
-- past the age its foreign calls may be repeated at. failed tells which it
-- did. Returns no row if another attempt holds a live lease or the key is
-- terminal. The lease counts from clock_timestamp(), not from the start of
-- the statement's transaction.
UPDATE idempotency_keys
SET lease_token      = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN @lease_token::uuid END,
    leased_until     = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN clock_timestamp() + make_interval(secs => @lease_seconds::float8) END,
    attempts         = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN attempts + 1 ELSE attempts END,
    status           = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN 'running' ELSE 'failed' END,
    failure_reason   = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN NULL ELSE 'max_age' END,
    response_status  = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN NULL ELSE @failure_status::integer END,
    response_headers = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN NULL ELSE sqlc.arg(failure_headers)::text::jsonb END,
    response_body    = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN NULL ELSE @failure_body::bytea END,
    finished_at      = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN NULL ELSE now() END,
    last_run_at = now()
WHERE id = @id
  AND status = 'running'
  AND (lease_token IS NULL OR leased_until <= now())
RETURNING ctid, recovery_point, phase_results, phase_results_raw, attempts, foreign_key_seed,
          (status = 'failed')::boolean AS failed, response_status, response_headers, response_body;

-- Fenced updates. The lease holder addresses its row by ctid (a TID scan
-- locks only the tuple, where an index scan would take a predicate lock on
-- a whole btree page shared with unrelated keys), by id and lease token, and
-- by point, the recovery point of its last commit: no row means the row
-- moved (see LocateHeldKey), the lease was lost, or the key is not at the
-- attempt's last commit. The last is a failover that lost that commit,
-- whose key may be back in the same slot with the same token (a version
-- from before the commit, rewritten there): without the point, a later
-- phase would commit over the missing one.

-- name: CommitPhase :one
-- Records a committed phase in the phase's own transaction: member is
-- `"name":result`, the JSON-encoded name and the result's exact bytes
-- (preceded by the members of foreign calls made since the last commit,
-- comma-separated), appended to the phase_results_raw object (kept as
-- bytes: jsonb cannot hold every result a foreign call returns). The lease is extended from
-- clock_timestamp(), the time of this statement, so a phase that ran longer
-- than the lease still commits a live one. It is sent in one round trip
-- with COMMIT, so it fails (division_by_zero), not matches nothing, when
-- the row is not where the attempt left it: the COMMIT then does nothing.
WITH updated AS (
UPDATE idempotency_keys
SET recovery_point = @phase::text,
    phase_results_raw = CASE WHEN phase_results_raw IS NULL OR length(phase_results_raw) <= 2
                             THEN '{'::bytea || @member::bytea || '}'::bytea
                             ELSE overlay(phase_results_raw PLACING ','::bytea || @member::bytea || '}'::bytea
                                          FROM length(phase_results_raw) FOR 1) END,
    leased_until = clock_timestamp() + make_interval(secs => @lease_seconds::float8),
    last_run_at = now()
WHERE ctid = @tid AND id = @id AND lease_token = @lease_token AND status = 'running'
  AND recovery_point = @point::text
RETURNING ctid
)
SELECT (SELECT ctid FROM updated)::tid AS ctid, (1 / (SELECT count(*) FROM updated))::integer AS found;

-- name: ExtendLease :one
-- Extends a held lease before a foreign call, from clock_timestamp(); or, if
-- the key was created more than max_age ago, fails it instead, as
-- TakeOverKey does, so that the call is not made. failed tells which. It
-- also records the results of foreign calls made since the last commit
-- (member, as CommitPhase's; empty for none), phase the last of them.
UPDATE idempotency_keys
SET recovery_point = CASE WHEN coalesce(length(@member::bytea), 0) = 0 THEN recovery_point ELSE @phase::text END,
    phase_results_raw = CASE WHEN coalesce(length(@member::bytea), 0) = 0 THEN phase_results_raw
                             WHEN phase_results_raw IS NULL OR length(phase_results_raw) <= 2
                             THEN '{'::bytea || @member::bytea || '}'::bytea
                             ELSE overlay(phase_results_raw PLACING ','::bytea || @member::bytea || '}'::bytea
                                          FROM length(phase_results_raw) FOR 1) END,
    lease_token      = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN lease_token END,
    leased_until     = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN clock_timestamp() + make_interval(secs => @lease_seconds::float8) END,
    status           = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN 'running' ELSE 'failed' END,
    failure_reason   = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN NULL ELSE 'max_age' END,
    response_status  = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN NULL ELSE @failure_status::integer END,
    response_headers = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN NULL ELSE sqlc.arg(failure_headers)::text::jsonb END,
    response_body    = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN NULL ELSE @failure_body::bytea END,
    finished_at      = CASE WHEN created_at > now() - make_interval(secs => @max_age_seconds::float8)
                            THEN NULL ELSE now() END,
    last_run_at = now()
WHERE ctid = @tid AND id = @id AND lease_token = @lease_token AND status = 'running'
  AND recovery_point = @point::text
RETURNING ctid, (status = 'failed')::boolean AS failed, response_status, response_headers, response_body;

-- name: LocateHeldKey :one
-- Finds the current ctid of a key whose lease this attempt still holds, and
-- its recovery point, which the attempt compares with the last phase it
-- committed; no row means the lease was lost.
SELECT ctid, recovery_point FROM idempotency_keys
WHERE id = @id AND lease_token = @lease_token AND status = 'running';

-- name: FinishKey :one
-- Stores the terminal response and releases the lease, with the results of
-- foreign calls made since the last commit (member, as CommitPhase's; empty
-- for none). Like CommitPhase, it fails (division_by_zero) when the row is
-- not where the attempt left it, so it can go out with COMMIT.
WITH updated AS (
UPDATE idempotency_keys
SET status = 'finished',
    phase_results_raw = CASE WHEN coalesce(length(@member::bytea), 0) = 0 THEN phase_results_raw
                             WHEN phase_results_raw IS NULL OR length(phase_results_raw) <= 2
                             THEN '{'::bytea || @member::bytea || '}'::bytea
                             ELSE overlay(phase_results_raw PLACING ','::bytea || @member::bytea || '}'::bytea
                                          FROM length(phase_results_raw) FOR 1) END,
    recovery_point = @recovery_point,
    response_status = @response_status,
    response_headers = sqlc.arg(response_headers)::text::jsonb,
    response_body = @response_body,
    finished_at = now(),
    last_run_at = now(),
    lease_token = NULL,
    leased_until = NULL
WHERE ctid = @tid AND id = @id AND lease_token IS NOT DISTINCT FROM sqlc.narg(lease_token)::uuid
  AND status = 'running' AND recovery_point = @point::text
RETURNING ctid
)
SELECT (SELECT ctid FROM updated)::tid AS ctid, (1 / (SELECT count(*) FROM updated))::integer AS found;

-- name: DeleteUnstartedKey :execrows
-- Removes a key that the attempt holding its lease inserted and ran nothing
-- under (no phase committed, no foreign call): after a response that is not
-- stored (a rejection the client may correct), or after an insert whose
-- outcome the caller could not see (its COMMIT may have succeeded). The key
-- is then as if never used, so the client's retry runs. Runs in its own
-- transaction.
DELETE FROM idempotency_keys
WHERE scope = @scope AND key = @key AND lease_token = @lease_token::uuid
  AND status = 'running' AND recovery_point = 'started' AND attempts = 1;

-- name: LockKey :exec
-- Waits for the transaction-scoped advisory lock InsertKey takes on (scope,
-- key), that is, for an insert still in flight to commit or abort, and holds
-- it until the caller's transaction ends.
SELECT pg_advisory_xact_lock(
    hashtextextended(length(@scope::text)::text || ':' || @scope::text || @key::text,
                     'idempotency_keys'::regclass::oid::bigint));

-- name: ReleaseKey :execrows
-- Frees the lease after a transient error; the recovery point stays, so a
-- retry or the resumer continues from it, after the results of foreign calls
-- made since the last commit (member, as CommitPhase's; empty for none),
-- phase the last of them. They are recorded only if the key is still at
-- point, the attempt's last commit: a later commit whose answer was lost
-- recorded them already. Runs in its own transaction.
UPDATE idempotency_keys
SET recovery_point = CASE WHEN coalesce(length(@member::bytea), 0) = 0 OR recovery_point <> @point::text
                          THEN recovery_point ELSE @phase::text END,
    phase_results_raw = CASE WHEN coalesce(length(@member::bytea), 0) = 0 OR recovery_point <> @point::text
                             THEN phase_results_raw
                             WHEN phase_results_raw IS NULL OR length(phase_results_raw) <= 2
                             THEN '{'::bytea || @member::bytea || '}'::bytea
                             ELSE overlay(phase_results_raw PLACING ','::bytea || @member::bytea || '}'::bytea
                                          FROM length(phase_results_raw) FOR 1) END,
    lease_token = NULL, leased_until = NULL, last_run_at = now()
WHERE id = @id AND lease_token = @lease_token AND status = 'running';

-- name: FailKeyEndedByFunction :execrows
-- Fails the key of an attempt whose function ended its transaction through
-- SQL (failure.ReasonEndedByFunction): what the function wrote before may
-- have committed without the phase's outcome, so the operation must not
-- run again. The key is fenced by the attempt's lease (its insert may have
-- committed with the function's COMMIT). A single-phase run's key is not
-- there to fail: see InsertFailedKey.
UPDATE idempotency_keys
SET status = 'failed',
    failure_reason = @failure_reason,
    response_status = @response_status::integer,
    response_headers = sqlc.arg(response_headers)::text::jsonb,
    response_body = @response_body::bytea,
    finished_at = now(),
    lease_token = NULL,
    leased_until = NULL
WHERE id = @id AND status = 'running' AND lease_token = @lease_token;
