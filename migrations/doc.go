// Package migrations holds atomicphase's schema as goose SQL migrations.
//
// The files are the schema's single source: sqlc reads them to generate the
// query code, tests apply them to every test schema, and deploys apply them
// with the goose CLI or with [Up]. They record their version in their own
// table, [TableName], so they never clash with the host application's goose
// migrations in the same database.
package migrations
