-- +goose Up
-- Every outbox message gets a globally unique id, a UUIDv7, beside its row
-- id. The row id is unique only in its table and starts over when the table
-- is recreated, restored from an old backup or rebuilt on a replica that
-- lagged behind: used as a broker's deduplication key, it made two
-- installations drop each other's messages, and made a broker drop a
-- genuinely new message as a duplicate of an old one with the same number.
-- The relay sends message_id as Nats-Msg-Id and as the webhook's
-- Idempotency-Key and webhook-id.
--
-- Fail fast rather than queue behind a long transaction: while ALTER TABLE
-- waits for its lock, every enqueue waits behind it. A deploy retries.
SET LOCAL lock_timeout = '5s';

-- +goose StatementBegin
-- A UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, then 74 random bits,
-- so ids sort by time. PostgreSQL 18 has uuidv7(); this supports 13 and
-- later. It overlays the time on a random (version 4) UUID and turns the
-- version bits from 0100 into 0111.
CREATE FUNCTION atomicphase_uuidv7(at timestamptz DEFAULT clock_timestamp())
RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(floor(extract(epoch FROM at) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;
-- +goose StatementEnd

-- Adding a nullable column without a default changes only the catalog: no
-- table rewrite, and the lock is held for an instant. The default is set in
-- a second statement so that it applies to new rows only (a volatile
-- default given with ADD COLUMN would rewrite the table).
ALTER TABLE outbox_messages ADD COLUMN message_id uuid;
ALTER TABLE outbox_messages ALTER COLUMN message_id SET DEFAULT atomicphase_uuidv7();

-- Rows that can still be published (pending, or dead-lettered and so open to
-- a redrive) get their id now, dated by when they were staged. Published
-- rows are never sent again and keep NULL until retention deletes them,
-- which keeps this migration short on a big table.
UPDATE outbox_messages
SET message_id = atomicphase_uuidv7(created_at)
WHERE message_id IS NULL AND published_at IS NULL;

-- Every row that can be published has an id. NOT VALID: the rows written
-- before are checked by the UPDATE above, not by a scan under this lock.
ALTER TABLE outbox_messages ADD CONSTRAINT outbox_messages_message_id_set
    CHECK (message_id IS NOT NULL OR published_at IS NOT NULL) NOT VALID;

-- +goose Down
-- Dropping the ids loses them: a message published before the rollback
-- would get a new id after migrating up again, and a broker or receiver
-- would take a republish of it for a new message. Refuse, with SQLSTATE
-- AP001 like the other guarded down migrations, unless the table is empty
-- or the session opted in to data loss:
--   PGOPTIONS='-c atomicphase.allow_data_loss=on' goose ... down
-- +goose StatementBegin
DO $$
BEGIN
    IF coalesce(lower(current_setting('atomicphase.allow_data_loss', true)), '') NOT IN ('on', 'true', 'yes', '1')
       AND EXISTS (SELECT FROM outbox_messages) THEN
        RAISE EXCEPTION 'atomicphase: rolling back migration 00005 would drop the ids of the outbox messages; to roll back anyway, set atomicphase.allow_data_loss = on'
            USING ERRCODE = 'AP001';
    END IF;
END
$$;
-- +goose StatementEnd
ALTER TABLE outbox_messages DROP CONSTRAINT outbox_messages_message_id_set;
ALTER TABLE outbox_messages DROP COLUMN message_id;
DROP FUNCTION atomicphase_uuidv7(timestamptz);
