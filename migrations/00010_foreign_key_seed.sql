-- +goose Up
-- Foreign keys (txn.Attempt.ForeignKey) were derived from the key row's id.
-- An id comes from a sequence, and a sequence is not a stable name for an
-- operation: after a failover to an asynchronous standby, a key row that was
-- committed (and whose foreign call was made) can be lost, and the client's
-- retry inserts the key again under another id, so the provider would get a
-- second call under a different key: a second charge.
--
-- A row with foreign_key_seed set derives its foreign keys from the seed,
-- scope, key, workflow and phase, which a retry reproduces. The seed tells a
-- new operation under a key value used before from the old one: 0 for a
-- key's first use; for a key reused after cleanup, its tombstone's
-- finished_at in microseconds. Rows without a seed (written before this
-- migration or by an older binary during a rolling deploy) keep deriving
-- from their id, so an operation in flight keeps its keys.
ALTER TABLE idempotency_keys ADD COLUMN foreign_key_seed bigint;

-- +goose StatementBegin
-- The seed for a new operation under (scope, key): the one definition, a
-- primary-key probe of the tombstones.
CREATE FUNCTION atomicphase_foreign_key_seed(p_scope text, p_key text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT (extract(epoch FROM finished_at) * 1000000)::bigint
                     FROM idempotency_key_tombstones
                     WHERE scope = p_scope AND key_hash = sha256(convert_to(p_key, 'UTF8'))), 0)
$$;
-- +goose StatementEnd

-- +goose Down
-- Without the seed, a running key would derive its foreign keys from its id
-- and call a provider again under a different key. Refuse while one runs,
-- with SQLSTATE AP001 like the other guarded down migrations, unless the
-- session opted in to data loss:
--   PGOPTIONS='-c atomicphase.allow_data_loss=on' goose ... down
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT atomicphase_data_loss_allowed()
       AND EXISTS (SELECT FROM idempotency_keys WHERE status = 'running' AND foreign_key_seed IS NOT NULL) THEN
        RAISE EXCEPTION 'atomicphase: rolling back migration 00010 would change the foreign keys of running operations; finish them first, or set atomicphase.allow_data_loss = on'
            USING ERRCODE = 'AP001';
    END IF;
END
$$;
-- +goose StatementEnd
DROP FUNCTION atomicphase_foreign_key_seed(text, text);
ALTER TABLE idempotency_keys DROP COLUMN foreign_key_seed;
