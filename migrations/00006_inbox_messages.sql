-- +goose Up
-- The consumer side of exactly-once delivery: one row per message a consumer
-- handled, written in the same SERIALIZABLE transaction as the handler's
-- writes, so a redelivered message finds its row and is acknowledged without
-- running the handler again. Several consumers share the table: the key is
-- (consumer, message_id).
--
-- A row is kept until keep_until, set from the consumer's retention when it
-- is written; the cleaner deletes it after that. The retention must outlast
-- every redelivery the broker may still make (the adapters check it when
-- they start): a message redelivered after its row was deleted would be
-- handled again.
--
-- A dead letter is a row with dead_at set: a message the consumer gave up on
-- (the broker's last delivery failed), kept with its error, topic, payload
-- and headers for inspection. Its handler's writes never committed. A
-- redelivery of it is acknowledged without running the handler; delete the
-- row to let a redelivered message be handled again.
CREATE TABLE inbox_messages (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    keep_until  timestamptz NOT NULL,
    dead_at     timestamptz,
    deliveries  integer,
    last_error  text,
    topic       text,
    payload     bytea,
    headers     jsonb,

    CONSTRAINT inbox_messages_pkey PRIMARY KEY (consumer, message_id),
    -- 1..255 bytes of printable ASCII (0x20-0x7E), the rule inbox enforces
    -- before any SQL. The length is checked apart: a bounded repetition
    -- such as [ -~]{1,255} builds a regex automaton that costs more CPU per
    -- insert than the rest of the row.
    CONSTRAINT inbox_messages_consumer_format CHECK (octet_length(consumer) BETWEEN 1 AND 255 AND consumer ~ '^[ -~]+$'),
    CONSTRAINT inbox_messages_message_id_format CHECK (octet_length(message_id) BETWEEN 1 AND 255 AND message_id ~ '^[ -~]+$'),
    CONSTRAINT inbox_messages_keep_until_after_recorded CHECK (keep_until >= recorded_at),
    -- A dead letter says why it died; a handled message carries nothing else.
    CONSTRAINT inbox_messages_dead_letter_has_error CHECK (
        (dead_at IS NULL AND last_error IS NULL AND deliveries IS NULL
            AND topic IS NULL AND payload IS NULL AND headers IS NULL)
        OR (dead_at IS NOT NULL AND last_error IS NOT NULL)
    ),
    CONSTRAINT inbox_messages_headers_object CHECK (headers IS NULL OR jsonb_typeof(headers) = 'object')
);

-- Serves retention deletion (cleanup), oldest first.
CREATE INDEX inbox_messages_keep_until_idx ON inbox_messages (keep_until);

-- +goose Down
SELECT atomicphase_refuse_data_loss('00006', 'inbox_messages');
DROP TABLE inbox_messages;
