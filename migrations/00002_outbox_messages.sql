-- +goose Up
-- Messages staged inside a phase's transaction: a row exists if and only if
-- the phase committed. The relay publishes them after commit.
CREATE TABLE outbox_messages (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The operation that wrote the message. A plain reference rather than a
    -- foreign key: a foreign-key check reads idempotency_keys' primary-key
    -- index inside every SERIALIZABLE phase that stages a message, and those
    -- reads make unrelated operations conflict. The cleaner sets it to NULL
    -- when it deletes the key, as ON DELETE SET NULL would.
    idempotency_key_id bigint,
    topic              text        NOT NULL,
    ordering_key       text,
    payload            bytea       NOT NULL,
    headers            jsonb       NOT NULL DEFAULT '{}',
    created_at         timestamptz NOT NULL DEFAULT now(),
    available_at       timestamptz NOT NULL DEFAULT now(),
    attempts           integer     NOT NULL DEFAULT 0,
    last_error         text,
    published_at       timestamptz,
    dead_at            timestamptz,

    CONSTRAINT outbox_messages_topic_not_empty CHECK (topic <> ''),
    CONSTRAINT outbox_messages_ordering_key_not_empty CHECK (ordering_key IS NULL OR ordering_key <> ''),
    CONSTRAINT outbox_messages_headers_object CHECK (jsonb_typeof(headers) = 'object'),
    CONSTRAINT outbox_messages_published_or_dead CHECK (published_at IS NULL OR dead_at IS NULL)
);

-- Serves "next publishable messages": only pending rows are in it.
CREATE INDEX outbox_messages_pending_idx
    ON outbox_messages (available_at, id)
    WHERE published_at IS NULL AND dead_at IS NULL;

-- Serves holding back an ordering key behind its earlier pending messages.
CREATE INDEX outbox_messages_pending_ordering_key_idx
    ON outbox_messages (ordering_key, id)
    WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL;

-- Serves retention deletion of relayed and dead-lettered rows.
CREATE INDEX outbox_messages_done_at_idx
    ON outbox_messages ((coalesce(published_at, dead_at)))
    WHERE published_at IS NOT NULL OR dead_at IS NOT NULL;

-- Serves unlinking messages when cleanup deletes their keys.
CREATE INDEX outbox_messages_idempotency_key_id_idx
    ON outbox_messages (idempotency_key_id)
    WHERE idempotency_key_id IS NOT NULL;

-- +goose Down
DROP TABLE outbox_messages;
