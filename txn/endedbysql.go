package txn

import (
	"context"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/failure"
)

// failEndedKey fails the key of an attempt whose function ended its
// transaction through SQL (errEndedBySQL; see userTx.watch): what the
// function wrote before may have committed without the outcome, so no
// retry may run the operation again. token is the workflow attempt's lease
// (NULL for a single-phase run, whose key was inserted terminal). A key
// the function's statement did not commit (a ROLLBACK) is not there to
// fail, and a retry runs the operation as new.
func (r *Runner) failEndedKey(ctx context.Context, req request, workflow string, id int64, token uuid.NullUUID) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	n, err := r.q.FailKeyEndedByFunction(fctx, db.FailKeyEndedByFunctionParams{
		FailureReason:  pgtype.Text{String: failure.ReasonEndedByFunction, Valid: true},
		ResponseStatus: failure.Status, ResponseHeaders: failure.Header, ResponseBody: failure.EndedByFunctionBody(),
		ID: id, LeaseToken: token,
	})
	attrs := []any{"scope", req.key.Scope, "key", req.key.Value, "workflow", workflow}
	switch {
	case err != nil:
		r.log.ErrorContext(ctx, "the operation's code ended its transaction through SQL, and its key could not be failed: "+
			"a retry may run again what committed; fail the key by hand (atomicphase keys fail)", append(attrs, "error", err)...)
	case n == 1:
		r.log.ErrorContext(ctx, "the operation's code ended its transaction through SQL (COMMIT sent as a statement): "+
			"its key is failed, so that what it wrote is not written again", attrs...)
	}
}
