package txn

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/atomicphase/atomicphase/internal/pgbatch"
)

// lazyTx is a transaction whose BEGIN, and the statement that must open it
// (the key's insert), wait for the first statement user code runs, and go
// to the server with it in one round trip. A single-phase Run whose
// function makes one statement then costs what the hand-written keyed
// transaction does: BEGIN with the key insert and the statement, then the
// response with COMMIT.
//
// The opening statement must fail, not match nothing, when the transaction
// must not go on: the error aborts the transaction, so the server skips the
// user's statement instead of running it, or waiting, for nothing. Its error
// is sticky: every later statement, and start, return it.
//
// Exec, Query and QueryRow travel with BEGIN; every other method (and Exec
// without arguments, which pgx sends over the simple protocol, where
// several statements may share one string, or any statement with a pgx
// option such as QueryExecMode) first starts the transaction on its own.
//
// A user's statement travels only when ride is set, as statementsRide
// decides from the connection's exec mode, or in the cache_statement mode
// once the Run prepared it on the connection (prep; see firststmt.go).
type lazyTx struct {
	conn *pgx.Conn
	ctx  context.Context // for Conn and LargeObjects, which take none
	opts pgx.TxOptions
	lead opener
	ride bool // a user's statement may travel after lead
	prep bool // a user's first statement is prepared by the Run (see firststmt.go)
	// first is the text the user's first statement ran by, when it was
	// prepared by a Run (see firststmt.go)
	first string
	again bool   // preparing the first statement failed: run again (errRunAgain)
	tx    pgx.Tx // set once BEGIN went out
	err   error  // why the transaction cannot be used
	ended bool   // the library ended the transaction (end)
	mode  pgx.QueryExecMode
}

// statementsRide reports whether, in mode, a user's statement can travel
// in the batch after the opening statement, be skipped by the server when
// that statement fails, and mean what it means on a plain pgx.Tx. Only in
// the exec mode:
//   - In the modes that prepare or describe a statement pgx has not cached
//     (cache_statement, pgx's default, cache_describe and describe_exec),
//     pgx sends that in a round trip of its own before the batch: before
//     BEGIN and the key's insert. Preparing takes the statement's table
//     locks, so a twin would wait behind its holder's LOCK TABLE instead of
//     losing the key at once (rule 4).
//   - In the simple protocol, pgx joins a batch into one string: a statement
//     run by a prepared statement's name, a multi-statement string's command
//     tag and a comment-only query would differ from a plain pgx.Tx, and a
//     syntax error in the user's SQL would fail BEGIN and hide a lost key.
//
// In those modes the transaction starts on its own first, one round trip
// more; except, in cache_statement, for a first statement a Run prepared
// on the connection before (see firststmt.go), which pgx does not prepare
// again.
//
// Without an opening statement (a workflow phase on a stored key, whose
// lease is already held) nothing is to be taken before the user's
// statement, so preparing it ahead of BEGIN is harmless: it travels in
// every mode but the simple protocol.
func statementsRide(mode pgx.QueryExecMode, lead opener) bool {
	if lead.queue == nil {
		return mode != pgx.QueryExecModeSimpleProtocol
	}
	return mode == pgx.QueryExecModeExec
}

// opener is the statement that opens a lazyTx: queue adds it to the batch
// after BEGIN, read reads its result from the batch's results. The zero
// opener opens with BEGIN alone.
type opener struct {
	queue func(b *pgx.Batch)
	read  func(br pgx.BatchResults) error
}

// newLazyTx returns the transaction on conn that lead opens; mode is
// conn's default exec mode.
func newLazyTx(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions, lead opener, mode pgx.QueryExecMode) *lazyTx {
	return &lazyTx{
		conn: conn, ctx: ctx, opts: opts, lead: lead, mode: mode,
		ride: statementsRide(mode, lead),
		prep: lead.queue != nil && mode == pgx.QueryExecModeCacheStatement,
	}
}

// startAndPrepare starts the transaction, then prepares the user's first
// statement sql in it (see firststmt.go), and returns the text to run it by.
func (l *lazyTx) startAndPrepare(ctx context.Context, sql string) (string, error) {
	if err := l.start(ctx); err != nil {
		return "", err
	}
	return l.prepareFirst(ctx, sql)
}

// start sends BEGIN and the opening statement unless that happened already,
// and returns the opening statement's error, if any.
func (l *lazyTx) start(ctx context.Context) error {
	if l.tx != nil || l.err != nil {
		return l.err
	}
	_, err := l.send(ctx, nil, nil)
	return err
}

// send sends BEGIN, the opening statement and, if sql is not nil, the
// user's statement, in one round trip. With a user's statement it returns
// the batch positioned at that statement's result; the caller reads it and
// closes the batch.
func (l *lazyTx) send(ctx context.Context, sql *string, args []any) (pgx.BatchResults, error) {
	tx, br, err := pgbatch.Begin(ctx, l.conn, l.opts, func(b *pgx.Batch) error {
		if l.lead.queue != nil {
			l.lead.queue(b)
		}
		if sql != nil {
			b.Queue(*sql, args...)
		}
		return nil
	})
	if err != nil {
		if sql != nil && nothingSent(ctx, l.conn, err) {
			return nil, err // the user's statement's own error, as on any pgx.Tx; the next one starts afresh
		}
		l.err = fmt.Errorf("begin: %w", err)
		return nil, l.err
	}
	l.tx = tx
	if l.lead.read != nil {
		if err := l.lead.read(br); err != nil {
			_ = br.Close()
			l.err = err
			return nil, err
		}
	}
	if sql == nil {
		if err := br.Close(); err != nil {
			l.err = fmt.Errorf("begin: %w", err)
			return nil, l.err
		}
		return nil, nil
	}
	return br, nil
}

// nothingSent reports whether the batch that failed with err never reached
// the server: pgx refused to encode a statement's arguments, and the
// connection is open and its context not done. Then no transaction began,
// and the user's statement's error is its own: a pgx.Tx stays usable after
// such an error. In the exec mode pgx encodes the whole batch before it
// writes any of it. In the modes that prepare (a phase on a stored key
// travels with BEGIN in those too) pgx encodes after queueing BEGIN and
// closes the connection on such an error, so the transaction ends with it.
func nothingSent(ctx context.Context, conn *pgx.Conn, err error) bool {
	var pgErr *pgconn.PgError
	return !errors.As(err, &pgErr) && ctx.Err() == nil && !conn.IsClosed() && !conn.PgConn().IsBusy() &&
		conn.PgConn().TxStatus() == 'I'
}

// route is how a user's statement reaches the server.
type route int

const (
	routeAlone   route = iota // after the transaction started on its own, as on any pgx.Tx
	routeTravel               // in the batch with BEGIN
	routePrepare              // after the transaction started on its own, prepared by the Run first (see firststmt.go)
)

// travels reports how a statement with these arguments goes out: in the
// batch with BEGIN when it can and means there what it means on its own.
// It returns the statement as the batch (or prepareFirst) must take it:
// rewritten by its pgx.QueryRewriter (such as pgx.NamedArgs), which a
// batch would otherwise apply after the decision, and in the
// cache_statement mode by the text it was prepared under. Like pgx, it
// reads options from the front of args, in any order.
func (l *lazyTx) travels(ctx context.Context, sql string, args []any, exec bool) (string, []any, route) {
	if l.tx != nil || l.err != nil || !l.ride && !l.prep {
		return sql, args, routeAlone
	}
	var rewriter pgx.QueryRewriter
	n := 0
options:
	for ; n < len(args); n++ {
		switch a := args[n].(type) {
		case pgx.QueryExecMode, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
			return sql, args, routeAlone // options a batch does not take
		case pgx.QueryRewriter:
			rewriter = a // the last one counts, as in pgx
		default:
			break options
		}
	}
	if rewriter != nil {
		rsql, rargs, err := rewriter.RewriteQuery(ctx, l.conn, sql, args[n:])
		if err != nil || (len(rargs) > 0 && isOption(rargs[0])) {
			return sql, args, routeAlone // pgx reports the error; or a batch would read an option pgx does not
		}
		sql, args = rsql, rargs
	}
	if sql == "" || exec && len(args) == 0 {
		return sql, args, routeAlone // pgx runs it over the simple protocol: several statements may share the string
	}
	if l.ride {
		return sql, args, routeTravel
	}
	fs := firstStatementsOf(l.conn)
	if text, ok := fs.travelling(l.conn, sql, args); ok {
		l.first = text
		return text, args, routeTravel
	}
	if fs.preparable(sql) {
		return sql, args, routePrepare
	}
	return sql, args, routeAlone
}

// isOption reports whether a statement's argument is one of pgx's options.
func isOption(a any) bool {
	switch a.(type) {
	case pgx.QueryExecMode, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID, pgx.QueryRewriter:
		return true
	}
	return false
}

func (l *lazyTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	bsql, bargs, how := l.travels(ctx, sql, args, true)
	switch how {
	case routeAlone:
		if err := l.start(ctx); err != nil {
			return pgconn.CommandTag{}, err
		}
		return l.tx.Exec(ctx, sql, args...)
	case routePrepare:
		text, err := l.startAndPrepare(ctx, bsql)
		if err != nil {
			return pgconn.CommandTag{}, err
		}
		return l.tx.Exec(ctx, text, bargs...)
	}
	br, err := l.send(ctx, &bsql, bargs)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag, err
}

func (l *lazyTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	bsql, bargs, how := l.travels(ctx, sql, args, false)
	switch how {
	case routeAlone:
		if err := l.start(ctx); err != nil {
			return failedRows{err: err}, err
		}
		return l.tx.Query(ctx, sql, args...)
	case routePrepare:
		text, err := l.startAndPrepare(ctx, bsql)
		if err != nil {
			return failedRows{err: err}, err
		}
		return l.tx.Query(ctx, text, bargs...)
	}
	br, err := l.send(ctx, &bsql, bargs)
	if err != nil {
		return failedRows{err: err}, err
	}
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		return rows, err
	}
	return &batchRows{Rows: rows, br: br}, nil
}

func (l *lazyTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	bsql, bargs, how := l.travels(ctx, sql, args, false)
	switch how {
	case routeAlone:
		if err := l.start(ctx); err != nil {
			return failedRow{err: err}
		}
		return l.tx.QueryRow(ctx, sql, args...)
	case routePrepare:
		text, err := l.startAndPrepare(ctx, bsql)
		if err != nil {
			return failedRow{err: err}
		}
		return l.tx.QueryRow(ctx, text, bargs...)
	}
	br, err := l.send(ctx, &bsql, bargs)
	if err != nil {
		return failedRow{err: err}
	}
	return batchRow{row: br.QueryRow(), br: br}
}

func (l *lazyTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := l.start(ctx); err != nil {
		return nil, err
	}
	return l.tx.Begin(ctx)
}

func (l *lazyTx) Commit(ctx context.Context) error {
	if err := l.start(ctx); err != nil {
		return err
	}
	return l.tx.Commit(ctx)
}

// Rollback rolls back a transaction that began, and sends nothing for one
// that never did; either way the transaction is over (lazyTx.end): a tx a
// function kept does not begin another on a connection back in the pool.
// A first statement the Run prepared is not sent with BEGIN again on this
// connection when the transaction failed after it ran.
func (l *lazyTx) Rollback(ctx context.Context) error {
	if l.ended {
		return nil
	}
	defer l.end()
	if l.tx == nil {
		return nil
	}
	l.beforeRollback()
	return l.tx.Rollback(ctx)
}

// beforeRollback marks a first statement the Run prepared as not to be
// sent with BEGIN again on this connection when the transaction failed
// after it ran.
func (l *lazyTx) beforeRollback() {
	if l.first != "" && l.err == nil && l.conn.PgConn().TxStatus() == 'E' {
		l.forgetFirst()
	}
}

// end records that the library ended the transaction: the COMMIT of
// commitWith or the ROLLBACK of rollbackAndQuery (batches pgx's tx does not
// see), or Rollback. From then on the transaction refuses every statement
// (pgx.ErrTxClosed), as a pgx.Tx does once it is committed or rolled back,
// so that a function that kept it cannot run a statement on its own,
// outside any transaction, on a connection back in the pool; and Rollback
// sends nothing.
func (l *lazyTx) end() {
	l.ended = true
	if l.err == nil {
		l.err = pgx.ErrTxClosed
	}
}

// rollbackAndQuery rolls the transaction back and runs the one-row query
// that queue adds to a batch after the ROLLBACK, in one round trip on the
// transaction's connection, handing its row to scan: a read of what the
// run left behind (KeyOutcome), which on another connection would cost a
// round trip more. ok is false when nothing was sent (no transaction
// began, or the connection is closed); then, or on an error, Rollback
// still ends the transaction. The query must not need the transaction: it
// runs on its own, after it.
//
// In an aborted transaction (a statement of the function's failed) the
// server parses nothing but ROLLBACK, and pgx's cache_statement,
// cache_describe and describe_exec modes prepare or describe a statement
// they have not cached in a round trip ahead of the batch, inside the
// transaction. There the batch goes out as unnamed statements, as the exec
// mode sends it; everywhere else as pgx sends a batch in the connection's
// mode (the query prepared once per connection, in the modes that cache).
func (l *lazyTx) rollbackAndQuery(ctx context.Context, queue func(b *pgx.Batch), scan func(row pgx.Row) error) (ok bool, err error) {
	if l.tx == nil || l.ended || l.conn.IsClosed() {
		return false, nil
	}
	l.beforeRollback()
	b := &pgx.Batch{}
	b.Queue("rollback")
	queue(b)
	switch l.mode {
	case pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec:
		if l.conn.PgConn().TxStatus() == 'E' {
			return l.rollbackAndQueryUnnamed(ctx, b, scan)
		}
	}
	br := l.conn.SendBatch(ctx, b)
	if _, err = br.Exec(); err == nil {
		l.end()
		err = scan(br.QueryRow())
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err == nil, err
}

// rollbackAndQueryUnnamed sends b's two statements as unnamed ones, so that
// nothing is parsed before the ROLLBACK has run.
func (l *lazyTx) rollbackAndQueryUnnamed(ctx context.Context, b *pgx.Batch, scan func(row pgx.Row) error) (bool, error) {
	pb := &pgconn.Batch{}
	for _, q := range b.QueuedQueries {
		var eqb pgx.ExtendedQueryBuilder
		if err := eqb.Build(l.conn.TypeMap(), nil, q.Arguments); err != nil {
			return false, err
		}
		pb.ExecParams(q.SQL, eqb.ParamValues, nil, eqb.ParamFormats, nil) // nil: text results
	}
	results, err := l.conn.PgConn().ExecBatch(ctx, pb).ReadAll()
	if len(results) > 0 && results[0].Err == nil {
		l.end()
	}
	switch {
	case err != nil:
		return false, err
	case len(results) != 2:
		return false, fmt.Errorf("rollback and query: %d results", len(results))
	case len(results[1].Rows) != 1:
		return false, fmt.Errorf("rollback and query: %w (%d rows)", pgx.ErrNoRows, len(results[1].Rows))
	}
	if err := scan(resultRow{m: l.conn.TypeMap(), res: results[1]}); err != nil {
		return false, err
	}
	return true, nil
}

// resultRow is the one row of a pgconn.Result, scanned as pgx scans.
type resultRow struct {
	m   *pgtype.Map
	res *pgconn.Result
}

func (r resultRow) Scan(dest ...any) error {
	fields, values := r.res.FieldDescriptions, r.res.Rows[0]
	if len(dest) != len(fields) {
		return fmt.Errorf("scan: %d columns, %d destinations", len(fields), len(dest))
	}
	for i, f := range fields {
		if err := r.m.Scan(f.DataTypeOID, f.Format, values[i], dest[i]); err != nil {
			return fmt.Errorf("scan column %q: %w", f.Name, err)
		}
	}
	return nil
}

func (l *lazyTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if err := l.start(ctx); err != nil {
		return 0, err
	}
	return l.tx.CopyFrom(ctx, table, columns, src)
}

func (l *lazyTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := l.start(ctx); err != nil {
		return failedBatch{err: err}
	}
	return l.tx.SendBatch(ctx, b)
}

func (l *lazyTx) LargeObjects() pgx.LargeObjects {
	l.startOrClose()
	if l.tx == nil {
		return pgx.LargeObjects{}
	}
	return l.tx.LargeObjects()
}

func (l *lazyTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := l.start(ctx); err != nil {
		return nil, err
	}
	return l.tx.Prepare(ctx, name, sql)
}

// Conn starts the transaction, so that statements run on the connection
// directly run inside it, as they do on any pgx.Tx's connection.
func (l *lazyTx) Conn() *pgx.Conn {
	l.startOrClose()
	return l.conn
}

// startOrClose starts the transaction for a caller that takes the
// connection itself. If no transaction could begin (BEGIN never went out,
// for example because the context was done), the connection is closed: a
// statement run on it would otherwise commit on its own, without the key.
// The start's error stays for the transaction's end to report, and the
// pool discards the closed connection.
func (l *lazyTx) startOrClose() {
	if err := l.start(l.ctx); err != nil && l.tx == nil {
		_ = l.conn.Close(context.WithoutCancel(l.ctx))
	}
}

// batchRows are the rows of a statement sent with BEGIN; closing them
// closes the batch, whose error they then report.
type batchRows struct {
	pgx.Rows
	br     pgx.BatchResults
	closed bool
	err    error
}

func (r *batchRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.closeBatch()
	return false
}

func (r *batchRows) Close() {
	r.Rows.Close()
	r.closeBatch()
}

func (r *batchRows) closeBatch() {
	if r.closed {
		return
	}
	r.closed = true
	r.err = r.br.Close()
}

func (r *batchRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.err
}

// batchRow is the row of a statement sent with BEGIN; scanning it closes
// the batch.
type batchRow struct {
	row pgx.Row
	br  pgx.BatchResults
}

func (r batchRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	if cerr := r.br.Close(); err == nil {
		err = cerr
	}
	return err
}

// failedRows, failedRow and failedBatch report that the transaction could
// not start, as pgx reports any failed statement: through a usable value.
type failedRows struct{ err error }

func (failedRows) Close()                                       {}
func (r failedRows) Err() error                                 { return r.err }
func (failedRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (failedRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (failedRows) Next() bool                                   { return false }
func (r failedRows) Scan(...any) error                          { return r.err }
func (r failedRows) Values() ([]any, error)                     { return nil, r.err }
func (failedRows) RawValues() [][]byte                          { return nil }
func (failedRows) Conn() *pgx.Conn                              { return nil }
func (failedRows) TypeMap() *pgtype.Map                         { return nil } // pgx's own error rows may too

type failedRow struct{ err error }

func (r failedRow) Scan(...any) error { return r.err }

type failedBatch struct{ err error }

func (b failedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b failedBatch) Query() (pgx.Rows, error)         { return failedRows(b), b.err }
func (b failedBatch) QueryRow() pgx.Row                { return failedRow(b) }
func (b failedBatch) Close() error                     { return b.err }
func (failedBatch) Tx() pgx.Tx                         { return nil } // it began none
