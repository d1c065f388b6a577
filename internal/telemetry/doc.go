// Package telemetry defines atomicphase's OpenTelemetry instruments, span
// names and attribute keys, and records them through the OpenTelemetry API
// only: no SDK is linked into a library package. A service that installs
// an SDK (otel.SetMeterProvider, otel.SetTracerProvider, or a provider
// given in a package's Config) sees everything below; one that does not
// pays close to nothing (see "Cost" below).
//
// # Providers
//
// Every public Config that records telemetry takes a metric.MeterProvider
// and a trace.TracerProvider; nil means the OpenTelemetry globals. Meters
// are created with [Meter], tracers with [NewTracer], both under the
// instrumentation scope [ScopeName]. A nil TracerProvider is resolved at
// each span, not once, so an SDK installed after the Runner was built is
// still used.
//
// # Metrics
//
// Names follow the OpenTelemetry conventions (dot-separated, unit in the
// unit field, no _total). Through the Prometheus exporter they become
// atomicphase_txn_executed_total, atomicphase_txn_run_duration_seconds and
// so on (dots to underscores, counters get _total, seconds get _seconds).
// The README's "Operating" section has the same table.
//
//	name                                     kind       unit       attributes                      recorded by
//	atomicphase.txn.executed                 counter    {run}      atomicphase.workflow            Run/RunWorkflow: user code ran to a stored response
//	atomicphase.txn.replayed                 counter    {run}      atomicphase.workflow            a stored response was replayed
//	atomicphase.txn.in_use                   counter    {run}      atomicphase.workflow            ErrKeyInUse (409)
//	atomicphase.txn.reused                   counter    {run}      atomicphase.workflow            ErrKeyReused (422)
//	atomicphase.txn.conflicts                counter    {run}      atomicphase.workflow            ErrConflict: serialization retries exhausted
//	atomicphase.txn.retries                  counter    {retry}    atomicphase.workflow            a phase retried after 40001/40P01
//	atomicphase.txn.lease_lost               counter    {run}      atomicphase.workflow            ErrLeaseLost: fenced out
//	atomicphase.txn.released                 counter    {key}      atomicphase.workflow            key released after a transient error
//	atomicphase.txn.run.duration             histogram  s          atomicphase.workflow, atomicphase.outcome
//	atomicphase.txn.phase.duration           histogram  s          atomicphase.workflow, atomicphase.phase, atomicphase.phase.kind
//	atomicphase.recovery.resumed             counter    {key}                                      Resumer: resumed to a terminal response
//	atomicphase.recovery.failed_stalled      counter    {key}      atomicphase.failure_reason      Resumer: stalled key failed
//	atomicphase.cleanup.keys_deleted         counter    {key}                                      Cleaner: expired keys deleted
//	atomicphase.cleanup.outbox_deleted       counter    {message}                                  Cleaner: relayed or dead messages deleted
//	atomicphase.cleanup.skipped              counter    {round}                                    Cleaner: round stopped, another cleaner held the lock
//	atomicphase.outbox.published             counter    {message}  messaging.destination.name      Relay: acknowledged and marked published
//	atomicphase.outbox.publish_failed        counter    {message}  messaging.destination.name      Relay: attempt failed, retry scheduled
//	atomicphase.outbox.dead_lettered         counter    {message}  messaging.destination.name      Relay: dead-lettered
//	atomicphase.outbox.commit_to_ack.duration histogram s          messaging.destination.name      Relay: from staging (created_at) to the broker's ack
//	atomicphase.outbox.pending               gauge      {message}                                  monitor: neither published nor dead
//	atomicphase.outbox.oldest_pending.age    gauge      s                                          monitor: age of the oldest pending message
//	atomicphase.outbox.dead                  gauge      {message}                                  monitor: dead-lettered messages kept
//	atomicphase.keys.stalled                 gauge      {key}                                      monitor: stalled keys (the Resumer's rule)
//
// Metric attributes have bounded values only: workflow and phase names
// (registered in code), outcomes and phase kinds (constants here), failure
// reasons, and topics. Each string attribute is capped at
// [MaxAttributeValues] distinct values per instrument set; later ones are
// recorded as [OverflowValue]. A scope, a key, a message id or an error
// text is never a metric attribute.
//
// The gauges are observable: one callback reads all four with one cheap
// statement (package monitor, and queries/operations.sql for the plans).
// They are the database's figures, the same from every process, so one
// process should register them (the reaper with -http does).
//
// # Spans (wired in the txn, outbox, recovery and cleanup packages)
//
//	span                              kind      parent                 attributes
//	atomicphase.run                   internal  caller's               atomicphase.scope.hash, atomicphase.workflow (""),
//	                                                                   atomicphase.outcome, atomicphase.attempts
//	atomicphase.run_workflow          internal  caller's               the same, with the workflow's name
//	atomicphase.resume                internal  atomicphase.recovery.round, or caller's: Runner.Resume
//	atomicphase.phase.atomic          internal  run_workflow/resume    atomicphase.phase, atomicphase.phase.retries
//	atomicphase.phase.foreign         internal  run_workflow/resume    atomicphase.phase
//	atomicphase.phase.finish          internal  run_workflow/resume    atomicphase.phase (the final phase), atomicphase.phase.retries
//	atomicphase.recovery.round        internal  root (a new trace)     atomicphase.resumed, atomicphase.failed
//	atomicphase.cleanup.round         internal  root                   atomicphase.keys_deleted, atomicphase.outbox_deleted, atomicphase.skipped
//	atomicphase.outbox.relay_batch    internal  root                   messaging.batch.message_count
//	publish <topic>                   producer  relay_batch            messaging.destination.name, messaging.message.id,
//	                                                                   atomicphase.attempt; linked to the staging trace
//
// A span ends with status Error and the error recorded (span.RecordError)
// only for failures of the library's own work (a transient error, a lost
// lease, a failed publish); the outcomes replayed, in_use and reused are
// answers, recorded in atomicphase.outcome with status Unset. pgx spans
// (otelpgx, or any pgx.QueryTracer) nest under ours because ctx flows into
// every query.
//
// Trace context through the outbox: Enqueue injects the current context
// with the configured propagator (otel.GetTextMapPropagator by default,
// W3C traceparent and tracestate) into each message's headers, unless the
// message already carries those headers. The headers are stored with the
// message, so the NATS and webhook publishers send them as they send every
// header. The relay extracts them and adds a span link from its publish
// span to the staging span (the publish does not become a child: it runs
// later, in another trace, usually in another process).
//
// # Where each is recorded
//
// The public Configs gain MeterProvider and TracerProvider fields (nil:
// the globals), and txn.Config a ScopeHashKey; each component builds its
// instruments once, in its constructor: NewTxn, NewOutbox, NewRecovery,
// NewCleanup and NewTracer.
//
//   - txn, Run / RunWorkflow / Resume: a span (SpanRun, SpanRunWorkflow,
//     SpanResume) around the whole call; at its end Txn.RunEnded with the
//     outcome the returned error maps to (executed or replayed on success,
//     then ErrKeyInUse, ErrKeyReused, ErrConflict, ErrLeaseLost, invalid
//     input before any SQL, anything else transient) and the span's
//     attributes: the scope through ScopeHasher.Attribute, workflow,
//     outcome, attempts.
//   - txn, each phase (Atomic, Foreign, Finish): a child span named by
//     PhaseKind.SpanName, Txn.PhaseEnded when it ends, Txn.Retried at each
//     retry after 40001/40P01 (and the retries on the span).
//   - txn, the release after a transient error: Txn.Released.
//   - outbox.Enqueue: inject the context with otel.GetTextMapPropagator()
//     into each message's headers (HeaderTraceparent, HeaderTracestate)
//     unless the message sets them.
//   - outbox.Relay, each batch: a root span SpanRelayBatch; each message a
//     producer span SpanPublishPrefix+topic with a link to the context
//     extracted from its headers; when the outcomes are recorded,
//     Outbox.Published (with now minus the message's created_at),
//     Outbox.PublishFailed or Outbox.DeadLettered.
//   - recovery.Resumer, each round: a root span SpanRecovery;
//     Recovery.Resumed and Recovery.FailedStalled for every reason, zeros
//     included.
//   - cleanup.Cleaner, each round: a root span SpanCleanup; Cleanup.Deleted
//     and Cleanup.Round.
//
// cmd/reaper records the recovery and cleanup counters from its rounds'
// reports (reaper.record) until the Resumer and the Cleaner record them
// themselves; then that function goes, or every count doubles.
//
// # Scope hashing
//
// A scope is the caller's principal (account, user, tenant). It is recorded
// on spans only as atomicphase.scope.hash, an HMAC-SHA256 of the scope
// ([ScopeHasher]) truncated to 128 bits, hex; never raw, never on a metric.
// Without a key the HMAC uses a fixed, public key, which hides the scope
// from a casual reader but not from someone who can guess it (sequential
// account ids, e-mail addresses); give the same secret key to every
// service whose traces should correlate.
//
// # Cost
//
// With the default providers and no SDK installed, a span start returns the
// caller's context and a shared no-op span ([Tracer.Start]); counters and
// histograms take precomputed attribute sets from copy-on-write caches.
// Nothing allocates: TestNoSDKRecordsWithoutAllocating holds that for the
// whole sequence a Run records. Callers build span attributes only when
// span.IsRecording() is true.
package telemetry
