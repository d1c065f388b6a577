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
			attribute.String(telemetry.AttrOutcome, o.String()),
			attribute.Int(telemetry.AttrAttempts, attemptOf(ctx)))
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
	kind telemetry.PhaseKind, retriesBefore int, err error) {
	a.r.tel.PhaseEnded(ctx, a.workflow, name, kind, time.Since(start))
	if span.IsRecording() {
		span.SetAttributes(attribute.String(telemetry.AttrPhase, name),
			attribute.Int(telemetry.AttrPhaseRetries, retriesOf(ctx)-retriesBefore))
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

// callKey carries a public call's telemetry state through ctx, for what is
// recorded deep in the call: the workflow's name (retries, releases), the
// attempt number, and the phase retries so far.
type callKey struct{}

type callInfo struct {
	workflow string
	attempt  int // the key's attempt number; 0 until an attempt holds the key
	retries  int // transaction retries after 40001/40P01 so far
}

func withWorkflow(ctx context.Context, name string) context.Context {
	return context.WithValue(ctx, callKey{}, &callInfo{workflow: name})
}

func callOf(ctx context.Context) *callInfo {
	c, _ := ctx.Value(callKey{}).(*callInfo)
	return c
}

// nameWorkflow names the workflow of a call that learnt it late (Resume).
func nameWorkflow(ctx context.Context, name string) {
	if c := callOf(ctx); c != nil {
		c.workflow = name
	}
}

// noteAttempt records the attempt number of the attempt holding the key.
func noteAttempt(ctx context.Context, number int) {
	if c := callOf(ctx); c != nil {
		c.attempt = number
	}
}

// noteRetry counts a transaction retry of the call.
func noteRetry(ctx context.Context) {
	if c := callOf(ctx); c != nil {
		c.retries++
	}
}

// workflowOf returns the workflow name ctx carries, "" for a single-phase Run.
func workflowOf(ctx context.Context) string {
	if c := callOf(ctx); c != nil {
		return c.workflow
	}
	return ""
}

// attemptOf returns the attempt number ctx carries: 1 for a single-phase
// Run (it has one transaction, retried whole), 0 when no attempt held the key.
func attemptOf(ctx context.Context) int {
	if c := callOf(ctx); c != nil {
		return c.attempt
	}
	return 1
}

// retriesOf returns the call's transaction retries so far.
func retriesOf(ctx context.Context) int {
	if c := callOf(ctx); c != nil {
		return c.retries
	}
	return 0
}
