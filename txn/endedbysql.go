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

// failEndedSingleKey is failEndedKey for a single-phase run whose
// transaction committed without the library (see Runner.settleUnsure):
// the key is inserted only with its response, so it stores the key,
// failed, under the id the run was allotted. Until it does, the key is
// free: a twin that takes it in that moment runs the operation again.
func (r *Runner) failEndedSingleKey(ctx context.Context, req request, id int64) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	n, err := r.q.InsertFailedSingleKey(fctx, db.InsertFailedSingleKeyParams{
		ID: id, Scope: req.key.Scope, Key: req.key.Value, Fingerprint: req.fingerprint,
		RequestMethod: req.key.Method, RequestPath: req.key.Path, RequestParams: req.params,
		ResponseStatus: failure.Status, ResponseHeaders: failure.Header, ResponseBody: failure.EndedByFunctionBody(),
		FailureReason: pgtype.Text{String: failure.ReasonEndedByFunction, Valid: true},
	})
	if err == nil && n == 0 {
		r.logRanTwice(ctx, req) // a twin stored the key first
		return
	}
	r.logEndedKey(ctx, req, "", n, err)
}

// logRanTwice logs a single-phase key that a concurrent call stored after
// the run's function committed its own transaction, before the key could
// be failed.
func (r *Runner) logRanTwice(ctx context.Context, req request) {
	r.log.ErrorContext(ctx, "the operation's code committed its transaction through SQL, and a concurrent call "+
		"stored the key before it could be failed: the operation may have run twice",
		"scope", req.key.Scope, "key", req.key.Value)
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
