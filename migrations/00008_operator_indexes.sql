-- +goose Up
-- Two small partial indexes for operators. The dead-letter gauge, the
-- reaper's status page and the admin command read dead-lettered messages
-- and failed keys through them instead of scanning the tables, which hold
-- every published message of the retention period and every finished key
-- of the TTL. Each holds only the rows an operator has to look at, usually
-- few; a write touches one only when it dead-letters a message or fails a
-- key (publishing a message or finishing a key adds no entry, a partial
-- index skips rows outside its predicate), and the columns they read were
-- already in other indexes' predicates, so no update that was HOT stops
-- being HOT.
--
-- These migrations run in a transaction, so the indexes are built with a
-- plain CREATE INDEX, which blocks writes to the table while it reads it:
-- a moment on a small table, seconds on one of tens of millions of rows.
-- On a large installation build them first without blocking writes, under
-- the same names, and this migration then finds them and does nothing:
--
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_messages_dead_idx
--       ON outbox_messages (dead_at, id) WHERE dead_at IS NOT NULL;
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_keys_failed_idx
--       ON idempotency_keys (finished_at, id) WHERE status = 'failed';
--
-- (A CONCURRENTLY build that fails leaves an INVALID index behind: drop it
-- and build it again before migrating.)
SET LOCAL lock_timeout = '5s';

-- Serves counting and listing dead letters (newest first) and redriving them.
CREATE INDEX IF NOT EXISTS outbox_messages_dead_idx
    ON outbox_messages (dead_at, id)
    WHERE dead_at IS NOT NULL;

-- Serves counting and listing failed keys (newest first).
CREATE INDEX IF NOT EXISTS idempotency_keys_failed_idx
    ON idempotency_keys (finished_at, id)
    WHERE status = 'failed';

-- +goose Down
-- Dropping an index loses no data.
DROP INDEX IF EXISTS idempotency_keys_failed_idx;
DROP INDEX IF EXISTS outbox_messages_dead_idx;
