// Package pgbatch lets generated queries (internal/db) travel in a pgx.Batch,
// so that one of them can go to the server in the same round trip as BEGIN or
// COMMIT.
package pgbatch

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Queue is a db.DBTX that queues every statement in B instead of running
// it: db.New(pgbatch.Queue{B: b}).SomeQuery(ctx, ...) appends the query to b
// and returns zero results. Read the real results from the BatchResults of b.
type Queue struct{ B *pgx.Batch }

// Exec queues sql.
func (q Queue) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	q.B.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

// Query queues sql; the error says the rows are not there yet.
func (q Queue) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	q.B.Queue(sql, args...)
	return nil, errors.New("a queued query has no rows yet")
}

// QueryRow queues sql; scanning its row does nothing.
func (q Queue) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	q.B.Queue(sql, args...)
	return queuedRow{}
}

type queuedRow struct{}

func (queuedRow) Scan(...any) error { return nil }

// Results is a db.DBTX that reads the next result of a sent batch instead of
// running a statement: db.New(pgbatch.Results{BR: br}).SomeQuery(ctx, ...)
// scans the result of the SomeQuery that Queue queued at the same position.
// The query's arguments are ignored.
type Results struct{ BR pgx.BatchResults }

// Exec reads the next result as a command tag.
func (r Results) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return r.BR.Exec()
}

// Query reads the next result as rows.
func (r Results) Query(context.Context, string, ...any) (pgx.Rows, error) { return r.BR.Query() }

// QueryRow reads the next result as one row.
func (r Results) QueryRow(context.Context, string, ...any) pgx.Row { return r.BR.QueryRow() }

// Row is a db.DBTX whose QueryRow returns R, a row read some other way:
// db.New(pgbatch.Row{R: r}).SomeQuery(ctx, ...) scans r as SomeQuery's
// result. Only queries that return one row can use it.
type Row struct{ R pgx.Row }

// Exec is not supported.
func (Row) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, errors.New("pgbatch.Row holds one row, not a command")
}

// Query is not supported.
func (Row) Query(context.Context, string, ...any) (pgx.Rows, error) {
	return nil, errors.New("pgbatch.Row holds one row, not rows")
}

// QueryRow returns R.
func (r Row) QueryRow(context.Context, string, ...any) pgx.Row { return r.R }

// Begin starts a transaction on conn with the statements queue adds to the
// batch, all in one round trip. It returns the open transaction and the
// batch's results, positioned at the first queued statement's: the caller
// reads them, closes br and then uses tx, or rolls tx back (a no-op if the
// batch already ended the transaction). An error means BEGIN failed and
// there is no transaction.
func Begin(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions, queue func(b *pgx.Batch) error) (pgx.Tx, pgx.BatchResults, error) {
	b := &pgx.Batch{}
	b.BeginTx(opts)
	if err := queue(b); err != nil {
		return nil, nil, err
	}
	br := conn.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return nil, nil, err
	}
	return br.Tx(), br, nil
}
