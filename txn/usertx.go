package txn

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/atomicphase/atomicphase/internal/pgerr"
)

// userTx is the transaction handed to user code: a single-phase function,
// an Atomic phase and Finish (and so a handler wrapped by httpidem). The
// library ends that transaction, so Commit and Rollback return an error
// wrapping ErrInvalidUse (savepoints from Begin may be ended as usual).
//
// It also records the statement errors user code may swallow, through
// every way of running a statement (Exec, Query and its rows, QueryRow,
// SendBatch and its results, CopyFrom, Prepare): the first serialization
// failure or deadlock, after which the phase is retried whatever the
// function returned, so that such a failure never becomes a stored
// response; and the first statement error of any kind, which is reported
// instead of the "current transaction is aborted" error that storing the
// response then meets.
//
// And it watches, after each statement, that user code did not end the
// transaction through SQL (COMMIT, ROLLBACK or PREPARE TRANSACTION sent as
// a statement): the connection is then closed at once, so that no later
// statement of the function runs on its own (autocommit), and the phase
// fails with errEndedBySQL.
type userTx struct {
	pgx.Tx
	rec  *stmtErrors
	root *lazyTx // the library's transaction; nil on a savepoint's userTx
}

func newUserTx(tx *lazyTx) *userTx { return &userTx{Tx: tx, rec: &stmtErrors{}, root: tx} }

// stmtErrors holds the errors the server returned for user code's statements.
type stmtErrors struct {
	mu        sync.Mutex
	first     error // the first statement the server refused
	retryable error // the first serialization failure or deadlock
	ended     bool  // a statement ended the transaction (see userTx.watch)
	// batches are the batches user code sent and has not closed: settle
	// reads what they left unread (closeBatches).
	batches []*userBatch
}

// errEndedBySQL: user code ended the library's transaction through SQL.
// What it wrote before may have committed without the phase's outcome; the
// attempt fails the key (see Runner.failEndedKey).
var errEndedBySQL = fmt.Errorf("%w: the function ended the transaction itself (COMMIT or ROLLBACK sent as SQL)", ErrInvalidUse)

// watch runs after each of user code's statements: if the statement ended
// the transaction, the connection is closed before anything else can run
// on it. The transaction is over when the connection is outside one, or
// when the statement's command tag says it committed (COMMIT AND CHAIN,
// after which the connection is in a new transaction; tag is empty where
// pgx gives none).
//
// Once the library ended the transaction (lazyTx.end), the connection is
// no longer the transaction's: it may be back in the pool, another call's.
// A statement on a kept tx is then refused (pgx.ErrTxClosed), and nothing
// is closed.
func (t *userTx) watch(tag pgconn.CommandTag) {
	if t.root != nil && t.root.ended {
		return
	}
	pc := t.pgConn()
	if pc == nil || pc.IsClosed() || pc.IsBusy() || pc.TxStatus() != 'I' && !committed(tag) {
		return
	}
	t.rec.mu.Lock()
	t.rec.ended = true
	t.rec.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	_ = pc.Close(ctx)
}

// committed reports whether a statement's command tag is that of one that
// ends the transaction it runs in while leaving the connection in one:
// COMMIT or END with AND CHAIN, PREPARE TRANSACTION, and BEGIN or START
// TRANSACTION (the last statement of "COMMIT; BEGIN" sent as one string;
// inside a transaction it changes nothing, but is never the function's to
// send). "ROLLBACK" is also ROLLBACK TO SAVEPOINT's tag, which leaves the
// transaction open, so it does not count; a ROLLBACK that ends the
// transaction leaves the connection outside one.
func committed(tag pgconn.CommandTag) bool {
	switch s := tag.String(); s {
	case "COMMIT", "BEGIN", "START TRANSACTION":
		return true
	default:
		// Not one literal: the pgbouncer package's session-state check
		// reads a Go string that starts with that word and a space as SQL.
		return strings.HasPrefix(s, "PREPARE") && strings.HasSuffix(s, " TRANSACTION")
	}
}

// pgConn is the library's transaction's connection, or nil while BEGIN
// has not gone out (a statement pgx refused before sending).
func (t *userTx) pgConn() *pgconn.PgConn {
	if t.root == nil {
		return t.Tx.Conn().PgConn()
	}
	if t.root.tx == nil {
		return nil
	}
	return t.root.conn.PgConn()
}

// closeTimeout bounds the Terminate message sent closing a connection user
// code left outside its transaction.
const closeTimeout = time.Second

// settle runs once user code returned, before its outcome is judged: the
// key insert's outcome comes first (a lost insert aborted the transaction,
// whatever user code made of its statements' errors), then a first
// statement the server refused to prepare (errRunAgain), then a
// transaction user code ended (errEndedBySQL).
func (t *userTx) settle(ctx context.Context) error {
	if err := t.root.start(ctx); err != nil {
		return err
	}
	if t.root.again {
		return errRunAgain
	}
	t.closeBatches()
	return t.endedBySQL()
}

// endedBySQL returns errEndedBySQL if a statement of user code ended the
// transaction, or, after user code returned, if the connection is outside
// a transaction (SQL sent on tx.Conn(), which watch does not see).
func (t *userTx) endedBySQL() error {
	t.rec.mu.Lock()
	ended := t.rec.ended
	t.rec.mu.Unlock()
	if pc := t.pgConn(); !ended && pc != nil && !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() == 'I' {
		ended = true
	}
	if ended {
		return errEndedBySQL
	}
	return nil
}

// note records err if the server refused a statement with it, and returns it.
func (s *stmtErrors) note(err error) error {
	if err == nil || pgerr.Code(err) == "" {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.first == nil {
		s.first = err
	}
	if s.retryable == nil && pgerr.IsRetryable(err) {
		s.retryable = err
	}
	return err
}

// retry returns the first serialization failure or deadlock a statement of
// user code met, or nil.
func (t *userTx) retry() error {
	t.rec.mu.Lock()
	defer t.rec.mu.Unlock()
	return t.rec.retryable
}

// usable checks, after user code returned and settle found the
// transaction still open, that it can commit: no result is left unread and
// no statement aborted it.
func (t *userTx) usable() error {
	pc := t.Conn().PgConn()
	if pc.IsClosed() {
		// The connection was lost; its status is the last one read, from
		// before the batch that broke it. An outage, not a misuse.
		return fmt.Errorf("the function's transaction: %w", pgerr.ErrConnectionLost)
	}
	if pc.IsBusy() {
		// An unread result holds the connection (the transaction's status
		// is not known until it is read): store nothing.
		return fmt.Errorf("%w: the function returned with Rows not closed or a Row not scanned", ErrInvalidUse)
	}
	if pc.TxStatus() == 'E' {
		return t.aborted(nil)
	}
	return nil
}

// explain turns err, an error met storing the phase's outcome, into the
// error that caused it when it only says that the transaction was aborted.
func (t *userTx) explain(err error) error {
	if !pgerr.IsInFailedTransaction(err) {
		return err
	}
	return t.aborted(err)
}

func (t *userTx) aborted(fallback error) error {
	t.rec.mu.Lock()
	first := t.rec.first
	t.rec.mu.Unlock()
	if first == nil {
		if fallback != nil {
			return fallback
		}
		return errors.New("the function's transaction was aborted by a failed statement")
	}
	return fmt.Errorf("a statement of the function failed, aborting its transaction: %w", first)
}

func (t *userTx) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := t.Tx.Begin(ctx)
	if err != nil {
		return nil, t.rec.note(err)
	}
	return &userTx{Tx: tx, rec: t.rec}, nil
}

func (t *userTx) Commit(ctx context.Context) error {
	if t.root != nil {
		return fmt.Errorf("txn: commit: %w: the transaction commits when the function returns", ErrInvalidUse)
	}
	return t.rec.note(t.Tx.Commit(ctx))
}

func (t *userTx) Rollback(ctx context.Context) error {
	if t.root != nil {
		return fmt.Errorf("txn: rollback: %w: return an error from the function to roll the transaction back", ErrInvalidUse)
	}
	return t.rec.note(t.Tx.Rollback(ctx))
}

func (t *userTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	n, err := t.Tx.CopyFrom(ctx, table, columns, src)
	t.watch(pgconn.CommandTag{})
	return n, t.rec.note(err)
}

func (t *userTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	ub := &userBatch{BatchResults: t.Tx.SendBatch(ctx, b), tx: t, batch: b}
	t.rec.mu.Lock()
	t.rec.batches = append(t.rec.batches, ub)
	t.rec.mu.Unlock()
	return ub
}

func (t *userTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	sd, err := t.Tx.Prepare(ctx, name, sql)
	return sd, t.rec.note(err)
}

func (t *userTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := t.Tx.Exec(ctx, sql, args...)
	t.watch(tag)
	return tag, t.rec.note(err)
}

func (t *userTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	rows, err := t.Tx.Query(ctx, sql, args...)
	if err != nil {
		t.watch(pgconn.CommandTag{})
		return rows, t.rec.note(err)
	}
	return &userRows{Rows: rows, rec: t.rec, tx: t}, nil
}

func (t *userTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return userRow{row: t.Tx.QueryRow(ctx, sql, args...), rec: t.rec, tx: t}
}

// userRows and userRow record their statement's errors and, outside a
// batch (tx set), watch the transaction once the result is read (the
// connection's status is known then).
type userRows struct {
	pgx.Rows
	rec *stmtErrors
	tx  *userTx // nil in a batch, which userBatch.Close watches
}

func (r *userRows) read() {
	if r.tx != nil {
		r.tx.watch(r.Rows.CommandTag())
	}
	_ = r.rec.note(r.Rows.Err())
}

func (r *userRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.read()
	return false
}

func (r *userRows) Close() {
	r.Rows.Close()
	r.read()
}

func (r *userRows) Err() error { return r.rec.note(r.Rows.Err()) }

func (r *userRows) Scan(dest ...any) error { return r.rec.note(r.Rows.Scan(dest...)) }

func (r *userRows) Values() ([]any, error) {
	v, err := r.Rows.Values()
	return v, r.rec.note(err)
}

type userRow struct {
	row pgx.Row
	rec *stmtErrors
	tx  *userTx // as in userRows
}

func (r userRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	if r.tx != nil {
		r.tx.watch(pgconn.CommandTag{}) // pgx.Row gives no tag
	}
	return r.rec.note(err)
}

// userBatch watches the transaction when the batch is closed: a batch's
// statements end with one status, read at its end.
type userBatch struct {
	pgx.BatchResults
	tx        *userTx
	batch     *pgx.Batch
	committed pgconn.CommandTag // the tag of a statement that committed (see committed)
}

func (b *userBatch) Exec() (pgconn.CommandTag, error) {
	tag, err := b.BatchResults.Exec()
	if committed(tag) {
		b.committed = tag
	}
	return tag, b.tx.rec.note(err)
}

func (b *userBatch) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	if err != nil {
		return rows, b.tx.rec.note(err)
	}
	return &userRows{Rows: rows, rec: b.tx.rec}, nil
}

func (b *userBatch) QueryRow() pgx.Row { return userRow{row: b.BatchResults.QueryRow(), rec: b.tx.rec} }

func (b *userBatch) Close() error {
	err := b.BatchResults.Close()
	b.tx.watch(b.committed)
	b.tx.rec.mu.Lock()
	b.tx.rec.batches = slices.DeleteFunc(b.tx.rec.batches, func(o *userBatch) bool { return o == b })
	b.tx.rec.mu.Unlock()
	return b.tx.rec.note(err)
}

// closeBatches closes the batches user code left open when it returned,
// reading the results it did not: a statement among them may have ended
// the transaction (a COMMIT the function never read the answer of), which
// Close's watch then sees. The results are the server's answers to what
// was sent; reading them changes nothing on the server. The callbacks user
// code queued with its statements (QueuedQuery.Exec, Query, QueryRow) are
// dropped first: they are user code, and must not run once the function
// returned. Reading waits for the statements still running, bounded by
// their batch's context (the function's).
func (t *userTx) closeBatches() {
	t.rec.mu.Lock()
	open := slices.Clone(t.rec.batches)
	t.rec.mu.Unlock()
	for _, b := range open {
		for _, q := range b.batch.QueuedQueries {
			q.Fn = nil
		}
		_ = b.Close() // its errors are noted
	}
}
