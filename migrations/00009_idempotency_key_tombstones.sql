-- +goose Up
-- When the cleaner deletes an expired key it leaves a tombstone in the same
-- statement, so that a client retrying the key after that is not taken for
-- a new operation (a second charge): the runner answers ErrKeyExpired, or
-- runs it anew under txn.ExpiredKeyPolicy NewOperation. A tombstone is
-- compact: the scope, a SHA-256 of the key (keys are up to 255 bytes), the
-- request's fingerprint, when the key finished, its response status, and
-- when the tombstone itself expires (the cleaner deletes it then).
CREATE TABLE idempotency_key_tombstones (
    scope           text        NOT NULL,
    key_hash        bytea       NOT NULL CHECK (octet_length(key_hash) = 32),
    fingerprint     bytea       NOT NULL,
    finished_at     timestamptz NOT NULL,
    response_status integer,
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (scope, key_hash)
);

-- Serves the cleaner's deletion of expired tombstones, oldest first.
CREATE INDEX idempotency_key_tombstones_expires_idx
    ON idempotency_key_tombstones (expires_at);

-- +goose StatementBegin
-- True when (scope, key) has a live tombstone: the one definition of the
-- lookup, a primary-key probe.
CREATE FUNCTION atomicphase_key_tombstoned(p_scope text, p_key text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT FROM idempotency_key_tombstones
                   WHERE scope = p_scope AND key_hash = sha256(convert_to(p_key, 'UTF8')) AND expires_at > now())
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Called by the runner's key insert (txn.ExpiredKeyReject): raises SQLSTATE
-- AP002 when (scope, key) has a live tombstone, so the insert, and with it
-- the request, fails before anything runs, in the same round trip.
CREATE FUNCTION atomicphase_refuse_tombstoned(p_scope text, p_key text) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF atomicphase_key_tombstoned(p_scope, p_key) THEN
        RAISE EXCEPTION 'atomicphase: idempotency key expired: it was used for an operation that finished and was cleaned up'
            USING ERRCODE = 'AP002';
    END IF;
    RETURN true;
END
$$;
-- +goose StatementEnd

-- +goose Down
SELECT atomicphase_refuse_data_loss('00009', 'idempotency_key_tombstones');
DROP FUNCTION atomicphase_refuse_tombstoned(text, text);
DROP FUNCTION atomicphase_key_tombstoned(text, text);
DROP TABLE idempotency_key_tombstones;
