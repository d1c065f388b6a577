package txn

import (
	"context"
	"errors"
	"fmt"
	"sync"

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
type userTx struct {
	pgx.Tx
	rec    *stmtErrors
	nested bool
}

func newUserTx(tx pgx.Tx) *userTx { return &userTx{Tx: tx, rec: &stmtErrors{}} }

// stmtErrors holds the errors the server returned for user code's statements.
type stmtErrors struct {
	mu        sync.Mutex
	first     error // the first statement the server refused
	retryable error // the first serialization failure or deadlock
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

// usable checks, after user code returned, that the transaction can still
// commit: user code did not end it through SQL, and no statement aborted it.
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
	switch pc.TxStatus() {
	case 'I':
		return fmt.Errorf("%w: the function ended the transaction itself (COMMIT or ROLLBACK sent as SQL)", ErrInvalidUse)
	case 'E':
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
	return &userTx{Tx: tx, rec: t.rec, nested: true}, nil
}

func (t *userTx) Commit(ctx context.Context) error {
	if !t.nested {
		return fmt.Errorf("txn: commit: %w: the transaction commits when the function returns", ErrInvalidUse)
	}
	return t.rec.note(t.Tx.Commit(ctx))
}

func (t *userTx) Rollback(ctx context.Context) error {
	if !t.nested {
		return fmt.Errorf("txn: rollback: %w: return an error from the function to roll the transaction back", ErrInvalidUse)
	}
	return t.rec.note(t.Tx.Rollback(ctx))
}

func (t *userTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	n, err := t.Tx.CopyFrom(ctx, table, columns, src)
	return n, t.rec.note(err)
}

func (t *userTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return &userBatch{BatchResults: t.Tx.SendBatch(ctx, b), rec: t.rec}
}

func (t *userTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	sd, err := t.Tx.Prepare(ctx, name, sql)
	return sd, t.rec.note(err)
}

func (t *userTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := t.Tx.Exec(ctx, sql, args...)
	return tag, t.rec.note(err)
}

func (t *userTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	rows, err := t.Tx.Query(ctx, sql, args...)
	if err != nil {
		return rows, t.rec.note(err)
	}
	return &userRows{Rows: rows, rec: t.rec}, nil
}

func (t *userTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return userRow{row: t.Tx.QueryRow(ctx, sql, args...), rec: t.rec}
}

type userRows struct {
	pgx.Rows
	rec *stmtErrors
}

func (r *userRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	_ = r.rec.note(r.Rows.Err())
	return false
}

func (r *userRows) Close() {
	r.Rows.Close()
	_ = r.rec.note(r.Rows.Err())
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
}

func (r userRow) Scan(dest ...any) error { return r.rec.note(r.row.Scan(dest...)) }

type userBatch struct {
	pgx.BatchResults
	rec *stmtErrors
}

func (b *userBatch) Exec() (pgconn.CommandTag, error) {
	tag, err := b.BatchResults.Exec()
	return tag, b.rec.note(err)
}

func (b *userBatch) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	if err != nil {
		return rows, b.rec.note(err)
	}
	return &userRows{Rows: rows, rec: b.rec}, nil
}

func (b *userBatch) QueryRow() pgx.Row { return userRow{row: b.BatchResults.QueryRow(), rec: b.rec} }

func (b *userBatch) Close() error { return b.rec.note(b.BatchResults.Close()) }
