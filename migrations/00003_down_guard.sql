-- +goose Up
-- Rolling back must never delete stored responses or unsent messages by
-- accident: a client retrying after its key was lost would run the payment
-- again. goose rolls back newest first, so this migration's Down runs before
-- the DROP TABLE of 00002 and 00001, and it refuses while either table holds
-- a row, unless the operator opts in for the session or transaction:
--
--   PGOPTIONS='-c atomicphase.allow_data_loss=on' goose ... down
--   migrations.DownTo(ctx, pool, version, migrations.AllowDataLoss())
--
-- Later migrations whose Down would delete data call
-- atomicphase_refuse_data_loss first.

-- +goose StatementBegin
-- True when the operator opted in to losing data in this session or
-- transaction (atomicphase.allow_data_loss = on).
CREATE FUNCTION atomicphase_data_loss_allowed() RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce(lower(current_setting('atomicphase.allow_data_loss', true)), '') IN ('on', 'true', 'yes', '1')
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Raises SQLSTATE AP001 when any of tables holds a row and the operator did
-- not opt in. migration names the step being rolled back, for the message.
CREATE FUNCTION atomicphase_refuse_data_loss(migration text, VARIADIC tables regclass[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t regclass;
    has_rows boolean;
BEGIN
    IF atomicphase_data_loss_allowed() THEN
        RETURN;
    END IF;
    FOREACH t IN ARRAY tables LOOP
        EXECUTE format('SELECT EXISTS (SELECT FROM %s)', t) INTO has_rows;
        IF has_rows THEN
            RAISE EXCEPTION 'atomicphase: rolling back migration % would delete the rows of %; to roll back anyway, set atomicphase.allow_data_loss = on (PGOPTIONS=''-c atomicphase.allow_data_loss=on'' for the goose CLI, migrations.AllowDataLoss() for migrations.DownTo)', migration, t
                USING ERRCODE = 'AP001',
                      DETAIL = format('%s holds rows: stored responses and unsent messages that client retries and the relay depend on.', t);
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose Down
SELECT atomicphase_refuse_data_loss('00003 (and then 00002 and 00001, which drop the tables)', 'idempotency_keys', 'outbox_messages');
DROP FUNCTION atomicphase_refuse_data_loss(text, regclass[]);
DROP FUNCTION atomicphase_data_loss_allowed();
