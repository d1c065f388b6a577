package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// handlerTx is the transaction handed to a handler. The inbox ends it:
// Commit and Rollback return an error wrapping ErrInvalidUse (savepoints
// from Begin may be ended as usual).
type handlerTx struct{ pgx.Tx }

func (t *handlerTx) Commit(context.Context) error {
	return fmt.Errorf("inbox: commit: %w: the transaction commits when the handler returns nil", ErrInvalidUse)
}

func (t *handlerTx) Rollback(context.Context) error {
	return fmt.Errorf("inbox: rollback: %w: return an error from the handler to roll the transaction back", ErrInvalidUse)
}

// errAborted reports a handler that returned nil from a transaction a
// failed statement had aborted.
var errAborted = errors.New("a statement of the handler failed and aborted the transaction, but the handler returned nil; return the statement's error")

// usable checks, after the handler returned nil, that the transaction can
// still commit: the handler did not end it with SQL, and no statement
// aborted it.
func (t *handlerTx) usable() error {
	switch t.Conn().PgConn().TxStatus() {
	case 'I':
		return fmt.Errorf("%w: the handler ended the transaction itself (COMMIT or ROLLBACK sent as SQL)", ErrInvalidUse)
	case 'E':
		return errAborted
	}
	return nil
}
