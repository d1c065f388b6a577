package txn

import (
	"context"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/failure"
)

// failEndedKey fails the key of a workflow attempt whose function ended
// its transaction through SQL (errEndedBySQL; see userTx.watch): what the
// function wrote before may have committed without the outcome, so no
// retry may run the operation again. token is the attempt's lease. A key
// the function's statement did not commit (a ROLLBACK of the first phase)
// is not there to fail, and a retry runs the operation as new.
func (r *Runner) failEndedKey(ctx context.Context, req request, workflow string, id int64, token uuid.NullUUID) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	n, err := r.q.FailKeyEndedByFunction(fctx, db.FailKeyEndedByFunctionParams{
		FailureReason:  pgtype.Text{String: failure.ReasonEndedByFunction, Valid: true},
		ResponseStatus: failure.Status, ResponseHeaders: failure.Header, ResponseBody: failure.EndedByFunctionBody(),
		ID: id, LeaseToken: token,
	})
	r.logEndedKey(ctx, req, workflow, n, err)
}

// failUnstoredKey is failEndedKey for a transaction that was to insert
// its key row with its commit (a single-phase run, or a workflow's first
// phase; workflow is empty for a run) and committed without the library
// (see Runner.settleUnsure): it stores the key, failed, under the id the
// run was allotted. Until it does, the key is free: a twin that takes it
// in that moment runs the operation again.
func (r *Runner) failUnstoredKey(ctx context.Context, req request, workflow string, id int64) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	n, err := r.q.InsertFailedKey(fctx, db.InsertFailedKeyParams{
		ID: id, Scope: req.key.Scope, Key: req.key.Value, Fingerprint: req.fingerprint,
		RequestMethod: req.key.Method, RequestPath: req.key.Path, RequestParams: req.params, Workflow: workflow,
		ResponseStatus: failure.Status, ResponseHeaders: failure.Header, ResponseBody: failure.EndedByFunctionBody(),
		FailureReason: pgtype.Text{String: failure.ReasonEndedByFunction, Valid: true},
	})
	if err == nil && n == 0 {
		r.logRanTwice(ctx, req, workflow) // a twin stored the key first
		return
	}
	r.logEndedKey(ctx, req, workflow, n, err)
}

// logRanTwice logs a key that a concurrent call stored after the run's
// function committed its own transaction, before the key could be failed.
func (r *Runner) logRanTwice(ctx context.Context, req request, workflow string) {
	r.log.ErrorContext(ctx, "the operation's code committed its transaction through SQL, and a concurrent call "+
		"stored the key before it could be failed: the operation may have run twice",
		"scope", req.key.Scope, "key", req.key.Value, "workflow", workflow)
}

// logEndedKey logs the outcome of failing an ended key: n rows failed.
func (r *Runner) logEndedKey(ctx context.Context, req request, workflow string, n int64, err error) {
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
