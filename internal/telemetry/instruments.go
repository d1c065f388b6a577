package telemetry

import (
	"context"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
)

// Histogram bucket boundaries, in seconds.
var (
	// durationBuckets cover a phase or a run: half a millisecond to a minute.
	durationBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}
	// deliveryBuckets cover commit to acknowledgement: milliseconds when
	// the relay keeps up, up to an hour through retries (RetryMaxDelay is
	// 10 minutes by default).
	deliveryBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600}
)

// instruments creates instruments from one meter. An instrument the meter
// refuses is replaced by a no-op one and the error goes to the
// OpenTelemetry error handler (otel.Handle), as instrumentation libraries
// do: telemetry never stops the library from working.
type instruments struct {
	m metric.Meter
}

func newInstruments(mp metric.MeterProvider) instruments {
	return instruments{m: Meter(mp)}
}

func (in instruments) counter(name, unit, desc string) metric.Int64Counter {
	c, err := in.m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
	if err != nil {
		otel.Handle(err)
		if c == nil {
			c = noop.Int64Counter{}
		}
	}
	return c
}

func (in instruments) histogram(name, desc string, buckets []float64) metric.Float64Histogram {
	h, err := in.m.Float64Histogram(name, metric.WithUnit(UnitSeconds), metric.WithDescription(desc),
		metric.WithExplicitBucketBoundaries(buckets...))
	if err != nil {
		otel.Handle(err)
		if h == nil {
			h = noop.Float64Histogram{}
		}
	}
	return h
}

// Txn holds the txn package's instruments. Its methods are safe for
// concurrent use, allocate nothing once a workflow's or phase's attributes
// are cached, and do nothing on a nil *Txn.
type Txn struct {
	retries, released metric.Int64Counter
	// byOutcome is the counter of each outcome; nil for outcomes without
	// one (transient: see released; invalid).
	byOutcome     [numOutcomes]metric.Int64Counter
	runDuration   metric.Float64Histogram
	phaseDuration metric.Float64Histogram
	workflows     *cache[string, workflowOptions]
	phases        *cache[phaseKey, options]
}

// workflowOptions are the attribute sets recorded for one workflow.
type workflowOptions struct {
	options                                    // workflow
	run     [numOutcomes][]metric.RecordOption // workflow and outcome
}

type phaseKey struct {
	workflow, phase string
	kind            PhaseKind
}

// NewTxn creates the txn instruments from mp (nil: the global provider).
func NewTxn(mp metric.MeterProvider) *Txn {
	in := newInstruments(mp)
	t := &Txn{
		retries:  in.counter(MetricRetries, UnitRetries, "Phases retried after a serialization failure or deadlock."),
		released: in.counter(MetricReleased, UnitKeys, "Keys released at their recovery point after a transient error, to be resumed."),
		runDuration: in.histogram(MetricRunDuration,
			"Duration of Run, RunWorkflow and Resume calls, by outcome.", durationBuckets),
		phaseDuration: in.histogram(MetricPhaseDuration,
			"Duration of workflow phases, retries included.", durationBuckets),
	}
	t.byOutcome[OutcomeExecuted] = in.counter(MetricExecuted, UnitRuns, "Operations whose code ran to a stored response.")
	t.byOutcome[OutcomeReplayed] = in.counter(MetricReplayed, UnitRuns, "Requests answered with a stored response; no code ran.")
	t.byOutcome[OutcomeInUse] = in.counter(MetricInUse, UnitRuns, "Requests refused because another attempt held the key (409).")
	t.byOutcome[OutcomeReused] = in.counter(MetricReused, UnitRuns, "Requests refused because the key belongs to another request (422).")
	t.byOutcome[OutcomeConflict] = in.counter(MetricConflicts, UnitRuns, "Requests that ran out of serialization retries (409).")
	t.byOutcome[OutcomeLeaseLost] = in.counter(MetricLeaseLost, UnitRuns, "Attempts fenced out after losing their lease; they committed nothing.")
	t.workflows = &cache[string, workflowOptions]{
		build:    func(w string) *workflowOptions { return newWorkflowOptions(w) },
		overflow: func() *workflowOptions { return newWorkflowOptions(OverflowValue) },
	}
	t.phases = &cache[phaseKey, options]{
		build: func(k phaseKey) *options {
			o := newOptions(attribute.String(AttrWorkflow, k.workflow), attribute.String(AttrPhase, k.phase),
				attribute.String(AttrPhaseKind, k.kind.String()))
			return &o
		},
		overflow: func() *options {
			o := newOptions(attribute.String(AttrWorkflow, OverflowValue), attribute.String(AttrPhase, OverflowValue),
				attribute.String(AttrPhaseKind, OverflowValue))
			return &o
		},
	}
	return t
}

func newWorkflowOptions(workflow string) *workflowOptions {
	w := &workflowOptions{options: newOptions(attribute.String(AttrWorkflow, workflow))}
	for o := range numOutcomes {
		set := attribute.NewSet(attribute.String(AttrWorkflow, workflow), attribute.String(AttrOutcome, o.String()))
		w.run[o] = []metric.RecordOption{metric.WithAttributeSet(set)}
	}
	return w
}

// RunEnded records a Run, RunWorkflow or Resume that ended with outcome o
// after d: its outcome's counter and the run duration. workflow is "" for
// a single-phase Run.
func (t *Txn) RunEnded(ctx context.Context, workflow string, o Outcome, d time.Duration) {
	if t == nil || o >= numOutcomes {
		return
	}
	w := t.workflows.get(workflow)
	if c := t.byOutcome[o]; c != nil {
		c.Add(ctx, 1, w.add...)
	}
	t.runDuration.Record(ctx, d.Seconds(), w.run[o]...)
}

// Retried records one phase retry after a serialization failure or
// deadlock.
func (t *Txn) Retried(ctx context.Context, workflow string) {
	if t == nil {
		return
	}
	t.retries.Add(ctx, 1, t.workflows.get(workflow).add...)
}

// Released records a key released after a transient error.
func (t *Txn) Released(ctx context.Context, workflow string) {
	if t == nil {
		return
	}
	t.released.Add(ctx, 1, t.workflows.get(workflow).add...)
}

// PhaseEnded records the duration of one phase, retries included.
func (t *Txn) PhaseEnded(ctx context.Context, workflow, phase string, kind PhaseKind, d time.Duration) {
	if t == nil {
		return
	}
	t.phaseDuration.Record(ctx, d.Seconds(), t.phases.get(phaseKey{workflow, phase, kind}).record...)
}

// Outbox holds the relay's instruments; safe for concurrent use, and a
// nil *Outbox records nothing.
type Outbox struct {
	published, publishFailed, deadLettered metric.Int64Counter
	commitToAck                            metric.Float64Histogram
	topics                                 *cache[string, options]
}

// NewOutbox creates the outbox instruments from mp (nil: the global
// provider).
func NewOutbox(mp metric.MeterProvider) *Outbox {
	in := newInstruments(mp)
	return &Outbox{
		published:     in.counter(MetricPublished, UnitMessages, "Messages acknowledged by the publisher and marked published."),
		publishFailed: in.counter(MetricPublishFailed, UnitMessages, "Publish attempts that failed; the message is retried later."),
		deadLettered:  in.counter(MetricDeadLettered, UnitMessages, "Messages dead-lettered after their last attempt or a permanent failure."),
		commitToAck: in.histogram(MetricCommitToAck,
			"Time from a message's staging (its transaction's start, by the database clock) to the publisher's acknowledgement.",
			deliveryBuckets),
		topics: stringCache(AttrTopic),
	}
}

// Published records a message acknowledged commitToAck after it was staged.
func (o *Outbox) Published(ctx context.Context, topic string, commitToAck time.Duration) {
	if o == nil {
		return
	}
	a := o.topics.get(topic)
	o.published.Add(ctx, 1, a.add...)
	o.commitToAck.Record(ctx, commitToAck.Seconds(), a.record...)
}

// PublishFailed records a failed publish attempt that will be retried.
func (o *Outbox) PublishFailed(ctx context.Context, topic string) {
	if o == nil {
		return
	}
	o.publishFailed.Add(ctx, 1, o.topics.get(topic).add...)
}

// DeadLettered records a dead-lettered message.
func (o *Outbox) DeadLettered(ctx context.Context, topic string) {
	if o == nil {
		return
	}
	o.deadLettered.Add(ctx, 1, o.topics.get(topic).add...)
}

// Recovery holds the Resumer's instruments; a nil *Recovery records
// nothing.
type Recovery struct {
	resumed, failedStalled metric.Int64Counter
	reasons                *cache[string, options]
}

// NewRecovery creates the recovery instruments from mp (nil: the global
// provider).
func NewRecovery(mp metric.MeterProvider) *Recovery {
	in := newInstruments(mp)
	return &Recovery{
		resumed:       in.counter(MetricResumed, UnitKeys, "Stalled keys resumed to a terminal response."),
		failedStalled: in.counter(MetricFailedStalled, UnitKeys, "Stalled keys failed with a stored 500, by reason."),
		reasons:       stringCache(AttrFailureReason),
	}
}

// Resumed records n keys resumed (0 makes the series exist).
func (r *Recovery) Resumed(ctx context.Context, n int) {
	if r == nil {
		return
	}
	r.resumed.Add(ctx, int64(n))
}

// FailedStalled records n keys failed for reason (0 makes the series
// exist).
func (r *Recovery) FailedStalled(ctx context.Context, reason string, n int) {
	if r == nil {
		return
	}
	r.failedStalled.Add(ctx, int64(n), r.reasons.get(reason).add...)
}

// Cleanup holds the Cleaner's instruments; a nil *Cleanup records
// nothing.
type Cleanup struct {
	keysDeleted, outboxDeleted, skipped metric.Int64Counter
}

// NewCleanup creates the cleanup instruments from mp (nil: the global
// provider).
func NewCleanup(mp metric.MeterProvider) *Cleanup {
	in := newInstruments(mp)
	return &Cleanup{
		keysDeleted:   in.counter(MetricKeysDeleted, UnitKeys, "Expired idempotency keys deleted."),
		outboxDeleted: in.counter(MetricOutboxDeleted, UnitMessages, "Published or dead-lettered outbox messages deleted past retention."),
		skipped:       in.counter(MetricCleanupSkipped, UnitRounds, "Cleanup rounds stopped because another cleaner held the cleanup lock."),
	}
}

// Deleted records keys and messages deleted (0 makes the series exist).
func (c *Cleanup) Deleted(ctx context.Context, keys, messages int64) {
	if c == nil {
		return
	}
	c.keysDeleted.Add(ctx, keys)
	c.outboxDeleted.Add(ctx, messages)
}

// Round records the end of a cleanup round: skipped when another cleaner
// held the lock (a round that was not adds 0, so the series exists).
func (c *Cleanup) Round(ctx context.Context, skipped bool) {
	if c == nil {
		return
	}
	var n int64
	if skipped {
		n = 1
	}
	c.skipped.Add(ctx, n)
}
