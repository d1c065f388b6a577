package telemetry

// ScopeName is the instrumentation scope of every meter and tracer (the
// otel_scope_name label in Prometheus).
const ScopeName = "github.com/atomicphase/atomicphase"

// Metric names (see the package documentation for kinds and units).
const (
	MetricExecuted  = "atomicphase.txn.executed"
	MetricReplayed  = "atomicphase.txn.replayed"
	MetricInUse     = "atomicphase.txn.in_use"
	MetricReused    = "atomicphase.txn.reused"
	MetricConflicts = "atomicphase.txn.conflicts"
	MetricRetries   = "atomicphase.txn.retries"
	MetricLeaseLost = "atomicphase.txn.lease_lost"
	MetricReleased  = "atomicphase.txn.released"

	MetricRunDuration   = "atomicphase.txn.run.duration"
	MetricPhaseDuration = "atomicphase.txn.phase.duration"

	MetricResumed       = "atomicphase.recovery.resumed"
	MetricFailedStalled = "atomicphase.recovery.failed_stalled"

	MetricKeysDeleted    = "atomicphase.cleanup.keys_deleted"
	MetricOutboxDeleted  = "atomicphase.cleanup.outbox_deleted"
	MetricCleanupSkipped = "atomicphase.cleanup.skipped"

	MetricPublished     = "atomicphase.outbox.published"
	MetricPublishFailed = "atomicphase.outbox.publish_failed"
	MetricDeadLettered  = "atomicphase.outbox.dead_lettered"
	MetricCommitToAck   = "atomicphase.outbox.commit_to_ack.duration"

	MetricPending          = "atomicphase.outbox.pending"
	MetricOldestPendingAge = "atomicphase.outbox.oldest_pending.age"
	MetricDead             = "atomicphase.outbox.dead"
	MetricStalled          = "atomicphase.keys.stalled"
)

// Units (UCUM; curly braces are annotations, dropped by Prometheus).
const (
	UnitSeconds  = "s"
	UnitRuns     = "{run}"
	UnitRetries  = "{retry}"
	UnitKeys     = "{key}"
	UnitMessages = "{message}"
	UnitRounds   = "{round}"
)

// Attribute keys.
const (
	// On metrics and spans.
	AttrWorkflow      = "atomicphase.workflow"
	AttrOutcome       = "atomicphase.outcome"
	AttrPhase         = "atomicphase.phase"
	AttrPhaseKind     = "atomicphase.phase.kind"
	AttrFailureReason = "atomicphase.failure_reason"
	AttrTopic         = "messaging.destination.name"

	// On spans only: unbounded, or meaningful per operation.
	AttrScopeHash     = "atomicphase.scope.hash"
	AttrAttempts      = "atomicphase.attempts"
	AttrAttempt       = "atomicphase.attempt"
	AttrPhaseRetries  = "atomicphase.phase.retries"
	AttrRecoveryPoint = "atomicphase.recovery_point"
	AttrMessageID     = "messaging.message.id"
	AttrBatchSize     = "messaging.batch.message_count"
	AttrResumed       = "atomicphase.resumed"
	AttrFailed        = "atomicphase.failed"
	AttrKeysDeleted   = "atomicphase.keys_deleted"
	AttrOutboxDeleted = "atomicphase.outbox_deleted"
	AttrSkipped       = "atomicphase.skipped"
)

// Span names.
const (
	SpanRun          = "atomicphase.run"
	SpanRunWorkflow  = "atomicphase.run_workflow"
	SpanResume       = "atomicphase.resume"
	SpanPhaseAtomic  = "atomicphase.phase.atomic"
	SpanPhaseForeign = "atomicphase.phase.foreign"
	SpanPhaseFinish  = "atomicphase.phase.finish"
	SpanRecovery     = "atomicphase.recovery.round"
	SpanCleanup      = "atomicphase.cleanup.round"
	SpanRelayBatch   = "atomicphase.outbox.relay_batch"
	// SpanPublishPrefix is followed by the topic: "publish receipts".
	SpanPublishPrefix = "publish "
)

// Trace context headers injected into outbox messages (W3C Trace Context).
const (
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
)

// Outcome is how a Run, RunWorkflow or Resume ended: the
// atomicphase.outcome attribute.
type Outcome uint8

// Outcomes.
const (
	// OutcomeExecuted: user code ran to a stored response.
	OutcomeExecuted Outcome = iota
	// OutcomeReplayed: a stored response was returned; no user code ran.
	OutcomeReplayed
	// OutcomeInUse: ErrKeyInUse, another attempt holds the lease.
	OutcomeInUse
	// OutcomeReused: ErrKeyReused, another request's key.
	OutcomeReused
	// OutcomeConflict: ErrConflict, serialization retries exhausted.
	OutcomeConflict
	// OutcomeLeaseLost: ErrLeaseLost, fenced out by another attempt.
	OutcomeLeaseLost
	// OutcomeTransient: any other error; the key was released, resumable.
	OutcomeTransient
	// OutcomeInvalid: rejected before any SQL (ErrInvalidKey,
	// ErrInvalidRequest).
	OutcomeInvalid
	numOutcomes
)

var outcomeNames = [numOutcomes]string{
	OutcomeExecuted:  "executed",
	OutcomeReplayed:  "replayed",
	OutcomeInUse:     "in_use",
	OutcomeReused:    "reused",
	OutcomeConflict:  "conflict",
	OutcomeLeaseLost: "lease_lost",
	OutcomeTransient: "transient",
	OutcomeInvalid:   "invalid",
}

// String returns the attribute value.
func (o Outcome) String() string {
	if o < numOutcomes {
		return outcomeNames[o]
	}
	return "unknown"
}

// PhaseKind is a phase's kind: the atomicphase.phase.kind attribute.
type PhaseKind uint8

// Phase kinds.
const (
	PhaseAtomic PhaseKind = iota
	PhaseForeign
	PhaseFinish
	numPhaseKinds
)

var phaseKindNames = [numPhaseKinds]string{
	PhaseAtomic:  "atomic",
	PhaseForeign: "foreign",
	PhaseFinish:  "finish",
}

// String returns the attribute value.
func (k PhaseKind) String() string {
	if k < numPhaseKinds {
		return phaseKindNames[k]
	}
	return "unknown"
}

// SpanName returns the span name of a phase of kind k.
func (k PhaseKind) SpanName() string {
	switch k {
	case PhaseForeign:
		return SpanPhaseForeign
	case PhaseFinish:
		return SpanPhaseFinish
	default:
		return SpanPhaseAtomic
	}
}
