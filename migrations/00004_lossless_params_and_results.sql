-- +goose Up
-- Params and phase results are stored as the exact bytes the library
-- produced, so that every resume sees them byte for byte. jsonb cannot do
-- that: it reorders object keys, rewrites number literals (1E+2 becomes 100),
-- and cannot hold \u0000 or numbers outside PostgreSQL's numeric range, which
-- a payment provider's answer (a phase result) may well contain.
--
--   request_params_raw: the canonical JSON of the request's params (object
--     keys sorted, insignificant whitespace removed, number literals as the
--     client wrote them). The library only accepts params jsonb can hold, so
--     convert_from(request_params_raw, 'UTF8')::jsonb always works.
--   phase_results_raw: one JSON object, phase name -> the result exactly as
--     encoding/json produced it. It is valid JSON (convert_from(...,
--     'UTF8')::json works) but not always valid jsonb.
--
-- Rows written before this migration keep their jsonb columns and the
-- library reads them as before; new rows leave request_params NULL and
-- phase_results '{}'. Nullable columns without a default are added without
-- rewriting the table, and dropping NOT NULL only changes the catalog, so
-- this migration is instant on a large table.
ALTER TABLE idempotency_keys
    ADD COLUMN request_params_raw bytea,
    ADD COLUMN phase_results_raw bytea,
    ALTER COLUMN request_params DROP NOT NULL,
    ALTER COLUMN request_params DROP DEFAULT;

-- +goose Down
-- Going back moves the raw values into the jsonb columns where jsonb can hold
-- them; what it cannot hold (\u0000, numbers outside numeric's range) and the
-- exact bytes of every raw value are lost. So this refuses to run while the
-- raw columns hold data, unless the operator opts in for the session, e.g.
--   PGOPTIONS='-c atomicphase.allow_data_loss=on' goose ... down
-- +goose StatementBegin
DO $$
DECLARE
    r record;
BEGIN
    IF EXISTS (SELECT 1 FROM idempotency_keys
               WHERE request_params_raw IS NOT NULL OR phase_results_raw IS NOT NULL) THEN
        IF coalesce(current_setting('atomicphase.allow_data_loss', true), '') <> 'on' THEN
            RAISE EXCEPTION 'migration 00004 down would lose the exact request params and phase results of stored idempotency keys; set atomicphase.allow_data_loss to on for the session to accept that';
        END IF;
        -- Opted in: keep what jsonb can hold.
        UPDATE idempotency_keys
        SET request_params = convert_from(request_params_raw, 'UTF8')::jsonb
        WHERE request_params_raw IS NOT NULL;
        FOR r IN SELECT id, phase_results_raw FROM idempotency_keys WHERE phase_results_raw IS NOT NULL LOOP
            BEGIN
                UPDATE idempotency_keys
                SET phase_results = phase_results || convert_from(r.phase_results_raw, 'UTF8')::jsonb
                WHERE id = r.id;
            EXCEPTION WHEN data_exception THEN
                RAISE WARNING 'idempotency key %: phase results jsonb cannot hold are dropped', r.id;
            END;
        END LOOP;
    END IF;
END
$$;
-- +goose StatementEnd
UPDATE idempotency_keys SET request_params = 'null' WHERE request_params IS NULL;
ALTER TABLE idempotency_keys
    ALTER COLUMN request_params SET DEFAULT 'null',
    ALTER COLUMN request_params SET NOT NULL,
    DROP COLUMN phase_results_raw,
    DROP COLUMN request_params_raw;
