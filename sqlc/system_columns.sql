-- Read by sqlc only, never applied to a database: declares the PostgreSQL
-- system column ctid, which sqlc's catalog lacks, so that queries can address
-- a row by its tuple id (see the fenced updates in queries/idempotency_keys.sql
-- and the deletes in queries/maintenance.sql).
ALTER TABLE idempotency_keys ADD COLUMN ctid tid;
ALTER TABLE idempotency_key_tombstones ADD COLUMN ctid tid;
