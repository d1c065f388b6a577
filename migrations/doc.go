// Package migrations holds atomicphase's schema as goose SQL migrations.
//
// The files are the schema's single source: sqlc reads them to generate the
// query code, tests apply them to every test schema, and deploys apply them
// with the goose CLI or with [Up]. They record their version in their own
// table, [TableName], so they never clash with the host application's goose
// migrations in the same database.
//
// [Up] and [DownTo] run every step of a call in one transaction, sending
// each file's Up or Down section as one query, so a file must not need to
// run outside a transaction (-- +goose NO TRANSACTION is refused); keep
// -- +goose StatementBegin and StatementEnd around $$ bodies for the goose
// CLI. An applied file is never edited: changes come as new files. A Down
// that would delete data calls atomicphase_refuse_data_loss (migration
// 00003) first, so it refuses unless the operator opted in
// (atomicphase.allow_data_loss = on, or [AllowDataLoss]). The opt-in value
// that every guarded Down accepts is on: 00004, written before the guard,
// checks for exactly that.
//
// Versions are numbered 1, 2, 3, ... without gaps, except version 7, which
// is missing for good: 00008 shipped first, and a 00007 added now would be
// older than a version databases have already applied, which goose refuses
// (it needs -allow-missing) and so does [Up]. A new migration takes the
// next number after the newest file; a test fails on any other gap and on
// a version used twice.
package migrations
