-- +goose Up
-- One row per operation, keyed by (scope, key). All timestamps are written
-- from the database clock by the queries; the defaults are a backstop only.
CREATE TABLE idempotency_keys (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope            text        NOT NULL DEFAULT '',
    key              text        NOT NULL,
    fingerprint      bytea       NOT NULL,
    request_method   text        NOT NULL,
    request_path     text        NOT NULL,
    request_params   jsonb       NOT NULL DEFAULT 'null',
    workflow         text        NOT NULL DEFAULT '',
    recovery_point   text        NOT NULL DEFAULT 'started',
    phase_results    jsonb       NOT NULL DEFAULT '{}',
    status           text        NOT NULL DEFAULT 'running',
    lease_token      uuid,
    leased_until     timestamptz,
    attempts         integer     NOT NULL DEFAULT 1,
    created_at       timestamptz NOT NULL DEFAULT now(),
    last_run_at      timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    response_status  integer,
    response_headers jsonb,
    response_body    bytea,
    failure_reason   text,

    CONSTRAINT idempotency_keys_scope_key_uniq UNIQUE (scope, key),
    -- 1..255 bytes of printable ASCII (0x20-0x7E), the same rule txn enforces.
    CONSTRAINT idempotency_keys_key_format CHECK (key ~ '^[ -~]{1,255}$'),
    CONSTRAINT idempotency_keys_scope_length CHECK (octet_length(scope) <= 255),
    CONSTRAINT idempotency_keys_fingerprint_sha256 CHECK (octet_length(fingerprint) = 32),
    CONSTRAINT idempotency_keys_status_valid CHECK (status IN ('running', 'finished', 'failed')),
    CONSTRAINT idempotency_keys_attempts_positive CHECK (attempts >= 0),
    -- A terminal key has a response and a finish time; a running one has neither.
    CONSTRAINT idempotency_keys_terminal_has_response CHECK (
        (status = 'running' AND finished_at IS NULL AND response_status IS NULL)
        OR (status <> 'running' AND finished_at IS NOT NULL AND response_status BETWEEN 100 AND 599)
    ),
    -- A lease is a token and an expiry together, or neither.
    CONSTRAINT idempotency_keys_lease_pair CHECK ((lease_token IS NULL) = (leased_until IS NULL)),
    CONSTRAINT idempotency_keys_failed_has_reason CHECK (status <> 'failed' OR failure_reason IS NOT NULL)
) WITH (fillfactor = 90);

-- Serves TTL deletion of terminal keys (cleanup).
CREATE INDEX idempotency_keys_terminal_finished_at_idx
    ON idempotency_keys (finished_at)
    WHERE status <> 'running';

-- Serves the recovery scan for stalled keys; small because only running keys are in it.
CREATE INDEX idempotency_keys_running_last_run_at_idx
    ON idempotency_keys (last_run_at)
    WHERE status = 'running';

-- +goose Down
DROP TABLE idempotency_keys;
