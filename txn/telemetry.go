package txn

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/atomicphase/atomicphase/internal/telemetry"
)

// startSpan starts the span of a public call (Run, RunWorkflow, Resume)
// and notes its start for the duration histogram.
func (r *Runner) startSpan(ctx context.Context, name string) (context.Context, trace.Span, time.Time) {
	ctx, span := r.tracer.Start(ctx, name, trace.SpanKindInternal)
	return ctx, span, time.Now()
}

// ended records a public call's outcome: its counter and duration, and, on
// a recording span, the hashed scope, the workflow and the outcome. Only a
// failure of the library's own work (transient, conflict, lease lost) sets
// the span's status to Error; the other outcomes are answers.
func (r *Runner) ended(ctx context.Context, span trace.Span, start time.Time, workflow, scope string, resp Response, err error) {
	o := outcomeOf(resp, err)
	r.tel.RunEnded(ctx, workflow, o, time.Since(start))
	if span.IsRecording() {
		span.SetAttributes(r.scopes.Attribute(scope),
			attribute.String(telemetry.AttrWorkflow, workflow),
			attribute.String(telemetry.AttrOutcome, o.String()))
		switch o {
		case telemetry.OutcomeTransient, telemetry.OutcomeConflict, telemetry.OutcomeLeaseLost:
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	}
	span.End()
}

// phaseEnded records a phase's duration and ends its span, with the
// phase's name and an error status when it failed.
func (a *Attempt) phaseEnded(ctx context.Context, span trace.Span, start time.Time, name string,
	kind telemetry.PhaseKind, err error) {
	a.r.tel.PhaseEnded(ctx, a.workflow, name, kind, time.Since(start))
	if span.IsRecording() {
		span.SetAttributes(attribute.String(telemetry.AttrPhase, name))
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	}
	span.End()
}

// outcomeOf maps a public call's result to its telemetry outcome.
func outcomeOf(resp Response, err error) telemetry.Outcome {
	switch {
	case err == nil && resp.Replayed:
		return telemetry.OutcomeReplayed
	case err == nil:
		return telemetry.OutcomeExecuted
	case errors.Is(err, ErrKeyInUse):
		return telemetry.OutcomeInUse
	case errors.Is(err, ErrKeyReused), errors.Is(err, ErrKeyExpired):
		return telemetry.OutcomeReused
	case errors.Is(err, ErrConflict):
		return telemetry.OutcomeConflict
	case errors.Is(err, ErrLeaseLost):
		return telemetry.OutcomeLeaseLost
	case errors.Is(err, ErrInvalidKey), errors.Is(err, ErrInvalidRequest), errors.Is(err, ErrRequestTooLarge),
		errors.Is(err, ErrInvalidUse), errors.Is(err, ErrUnknownWorkflow):
		return telemetry.OutcomeInvalid
	default:
		return telemetry.OutcomeTransient
	}
}

// workflowKey carries the running workflow's name through ctx, for the
// metrics recorded deep in a call (retries, releases).
type workflowKey struct{}

type workflowName struct{ v string }

func withWorkflow(ctx context.Context, name string) context.Context {
	return context.WithValue(ctx, workflowKey{}, &workflowName{v: name})
}

// nameWorkflow names the workflow of a call that learnt it late (Resume).
func nameWorkflow(ctx context.Context, name string) {
	if w, ok := ctx.Value(workflowKey{}).(*workflowName); ok {
		w.v = name
	}
}

// workflowOf returns the workflow name ctx carries, "" for a single-phase Run.
func workflowOf(ctx context.Context) string {
	if w, ok := ctx.Value(workflowKey{}).(*workflowName); ok {
		return w.v
	}
	return ""
}
