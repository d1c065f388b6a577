package telemetry_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	"go.uber.org/goleak"

	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/internal/telemetry/metrictest"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		// Re-executed by TestTracerUsesAGlobalSDKInstalledAfterItWasBuilt.
		os.Exit(m.Run())
	}
	goleak.VerifyTestMain(m)
}

// The instruments carry the documented names, units and attributes, and
// count what they were given.
func TestInstrumentsRecordDocumentedNamesUnitsAndAttributes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	mp, reader := metrictest.NewProvider(t)

	tx := telemetry.NewTxn(mp)
	tx.RunEnded(ctx, "", telemetry.OutcomeExecuted, 3*time.Millisecond)
	tx.RunEnded(ctx, "", telemetry.OutcomeReplayed, time.Millisecond)
	tx.RunEnded(ctx, "", telemetry.OutcomeReplayed, time.Millisecond)
	tx.RunEnded(ctx, "create_ride", telemetry.OutcomeInUse, time.Millisecond)
	tx.RunEnded(ctx, "create_ride", telemetry.OutcomeReused, time.Millisecond)
	tx.RunEnded(ctx, "create_ride", telemetry.OutcomeConflict, time.Millisecond)
	tx.RunEnded(ctx, "create_ride", telemetry.OutcomeLeaseLost, time.Millisecond)
	tx.RunEnded(ctx, "create_ride", telemetry.OutcomeTransient, 2*time.Second)
	tx.Retried(ctx, "create_ride")
	tx.Released(ctx, "create_ride")
	tx.PhaseEnded(ctx, "create_ride", "charge_created", telemetry.PhaseForeign, 250*time.Millisecond)

	ob := telemetry.NewOutbox(mp)
	ob.Published(ctx, "receipts", 40*time.Millisecond)
	ob.PublishFailed(ctx, "receipts")
	ob.DeadLettered(ctx, "receipts")

	rec := telemetry.NewRecovery(mp)
	rec.Resumed(ctx, 2)
	rec.FailedStalled(ctx, "max_age", 1)
	rec.FailedStalled(ctx, "unknown_workflow", 0)

	cl := telemetry.NewCleanup(mp)
	cl.Deleted(ctx, 10, 4)
	cl.Round(ctx, true)
	cl.Round(ctx, false)

	got := metrictest.Collect(t, reader)
	type want struct {
		kind, unit, attrs string
		value             float64
	}
	for name, w := range map[string]want{
		telemetry.MetricExecuted:       {"counter", "{run}", "atomicphase.workflow=", 1},
		telemetry.MetricReplayed:       {"counter", "{run}", "atomicphase.workflow=", 2},
		telemetry.MetricInUse:          {"counter", "{run}", "atomicphase.workflow=create_ride", 1},
		telemetry.MetricReused:         {"counter", "{run}", "atomicphase.workflow=create_ride", 1},
		telemetry.MetricConflicts:      {"counter", "{run}", "atomicphase.workflow=create_ride", 1},
		telemetry.MetricLeaseLost:      {"counter", "{run}", "atomicphase.workflow=create_ride", 1},
		telemetry.MetricRetries:        {"counter", "{retry}", "atomicphase.workflow=create_ride", 1},
		telemetry.MetricReleased:       {"counter", "{key}", "atomicphase.workflow=create_ride", 1},
		telemetry.MetricPublished:      {"counter", "{message}", "messaging.destination.name=receipts", 1},
		telemetry.MetricPublishFailed:  {"counter", "{message}", "messaging.destination.name=receipts", 1},
		telemetry.MetricDeadLettered:   {"counter", "{message}", "messaging.destination.name=receipts", 1},
		telemetry.MetricResumed:        {"counter", "{key}", "", 2},
		telemetry.MetricFailedStalled:  {"counter", "{key}", "atomicphase.failure_reason=max_age", 1},
		telemetry.MetricKeysDeleted:    {"counter", "{key}", "", 10},
		telemetry.MetricOutboxDeleted:  {"counter", "{message}", "", 4},
		telemetry.MetricCleanupSkipped: {"counter", "{round}", "", 1},
	} {
		m, ok := got[name]
		require.True(t, ok, "%s not recorded", name)
		require.Equal(t, w.kind, m.Kind, name)
		require.Equal(t, w.unit, m.Unit, name)
		p, ok := m.Points[w.attrs]
		require.True(t, ok, "%s has no point with attributes %q: %v", name, w.attrs, m.Points)
		require.Equal(t, w.value, p.Value, name)
	}
	// A reason with no failures yet still has its series, at 0.
	require.Contains(t, got[telemetry.MetricFailedStalled].Points, "atomicphase.failure_reason=unknown_workflow")

	run := got[telemetry.MetricRunDuration]
	require.Equal(t, "histogram", run.Kind)
	require.Equal(t, "s", run.Unit)
	require.Equal(t, uint64(2), run.Points["atomicphase.outcome=replayed,atomicphase.workflow="].Count)
	require.InDelta(t, 2.0, run.Points["atomicphase.outcome=transient,atomicphase.workflow=create_ride"].Sum, 1e-9)

	phase := got[telemetry.MetricPhaseDuration]
	require.InDelta(t, 0.25, phase.Points["atomicphase.phase=charge_created,atomicphase.phase.kind=foreign,atomicphase.workflow=create_ride"].Sum, 1e-9)

	ack := got[telemetry.MetricCommitToAck]
	require.Equal(t, "s", ack.Unit)
	require.InDelta(t, 0.04, ack.Points["messaging.destination.name=receipts"].Sum, 1e-9)
}

// Metric attributes never take more than MaxAttributeValues distinct
// values: a topic per customer cannot make unbounded series.
func TestAttributeValuesPastTheBoundAreRecordedAsOther(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	mp, reader := metrictest.NewProvider(t)
	ob := telemetry.NewOutbox(mp)
	for i := range telemetry.MaxAttributeValues + 50 {
		ob.DeadLettered(ctx, fmt.Sprintf("topic-%d", i))
	}
	points := metrictest.Collect(t, reader)[telemetry.MetricDeadLettered].Points
	require.Len(t, points, telemetry.MaxAttributeValues+1)
	require.Equal(t, 50.0, points["messaging.destination.name="+telemetry.OverflowValue].Value)
}

// With no SDK installed (the default globals) and with the noop
// providers, the whole sequence a workflow Run records allocates nothing:
// instrumenting Run adds no allocation of its own when no SDK is installed.
func TestNoSDKRecordsWithoutAllocating(t *testing.T) {
	// Not parallel: AllocsPerRun counts the whole process's allocations.
	ctx := context.Background()
	for name, tel := range map[string]struct {
		tracer *telemetry.Tracer
		txn    *telemetry.Txn
		outbox *telemetry.Outbox
	}{
		"global providers, no SDK": {telemetry.NewTracer(nil), telemetry.NewTxn(nil), telemetry.NewOutbox(nil)},
		"noop providers": {telemetry.NewTracer(tracenoop.NewTracerProvider()),
			telemetry.NewTxn(metricnoop.NewMeterProvider()), telemetry.NewOutbox(metricnoop.NewMeterProvider())},
	} {
		require.False(t, tel.tracer.Enabled(), name)
		record := func() {
			rctx, run := tel.tracer.Start(ctx, telemetry.SpanRunWorkflow, trace.SpanKindInternal)
			pctx, phase := tel.tracer.Start(rctx, telemetry.SpanPhaseAtomic, trace.SpanKindInternal)
			if phase.IsRecording() {
				t.Fatal("a no-op span records")
			}
			tel.txn.Retried(pctx, "create_ride")
			tel.txn.PhaseEnded(pctx, "create_ride", "ride_created", telemetry.PhaseAtomic, time.Millisecond)
			phase.End()
			tel.txn.RunEnded(rctx, "create_ride", telemetry.OutcomeExecuted, 2*time.Millisecond)
			tel.txn.RunEnded(rctx, "", telemetry.OutcomeReplayed, time.Millisecond)
			tel.outbox.Published(rctx, "receipts", time.Millisecond)
			run.End()
		}
		record() // fill the attribute caches
		require.Zero(t, testing.AllocsPerRun(200, record), name)
	}
}

// A span started with no SDK is no span: the context comes back as it was,
// so pgx spans and the caller's span stay parent and child.
func TestNoSDKSpanStartReturnsTheContextUnchanged(t *testing.T) {
	t.Parallel()
	type ctxKey struct{}
	ctx := context.WithValue(context.Background(), ctxKey{}, "x")
	got, span := telemetry.NewTracer(nil).Start(ctx, telemetry.SpanRun, trace.SpanKindInternal)
	require.Equal(t, ctx, got)
	require.False(t, span.IsRecording())
}

// With an SDK given explicitly, spans are recorded with their kind and
// nest under the caller's span.
func TestTracerRecordsNestedSpansWithAnSDK(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tr := telemetry.NewTracer(tp)
	require.True(t, tr.Enabled())

	ctx, parent := tp.Tracer("caller").Start(context.Background(), "handler")
	ctx, run := tr.Start(ctx, telemetry.SpanRunWorkflow, trace.SpanKindInternal)
	_, pub := tr.Start(ctx, telemetry.SpanPublishPrefix+"receipts", trace.SpanKindProducer)
	pub.End()
	run.End()
	parent.End()

	spans := rec.Ended()
	require.Len(t, spans, 3)
	require.Equal(t, "publish receipts", spans[0].Name())
	require.Equal(t, trace.SpanKindProducer, spans[0].SpanKind())
	require.Equal(t, telemetry.ScopeName, spans[0].InstrumentationScope().Name)
	require.Equal(t, spans[1].SpanContext().SpanID(), spans[0].Parent().SpanID())
	require.Equal(t, telemetry.SpanRunWorkflow, spans[1].Name())
	require.Equal(t, spans[2].SpanContext().SpanID(), spans[1].Parent().SpanID())
}

const childEnv = "TELEMETRY_TEST_GLOBAL_CHILD"

// A Tracer built before the service installs its SDK (a Runner built in
// an init, say) uses the SDK once it is installed. Runs in a child process:
// installing a global provider cannot be undone, and the other tests need
// the default.
func TestTracerUsesAGlobalSDKInstalledAfterItWasBuilt(t *testing.T) {
	if os.Getenv(childEnv) == "" {
		t.Parallel()
		cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v")
		cmd.Env = append(os.Environ(), childEnv+"=1")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", out)
		require.Contains(t, string(out), "--- PASS: "+t.Name())
		return
	}
	tr := telemetry.NewTracer(nil)
	_, span := tr.Start(context.Background(), telemetry.SpanRun, trace.SpanKindInternal)
	require.False(t, span.IsRecording(), "no SDK yet")

	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	otel.SetTracerProvider(tp)
	defer func() { _ = tp.Shutdown(context.Background()) }()
	_, span = tr.Start(context.Background(), telemetry.SpanRun, trace.SpanKindInternal)
	require.True(t, span.IsRecording())
	span.End()
	require.Len(t, rec.Ended(), 1)
	require.Equal(t, telemetry.SpanRun, rec.Ended()[0].Name())
}

// Scopes reach traces only hashed: a keyed HMAC, 128 bits in hex, stable
// for a key, different under another key, never the scope itself.
func TestScopeHashNeverRevealsTheScope(t *testing.T) {
	t.Parallel()
	scope := "acct_1MqLx2ABC"
	def := telemetry.NewScopeHasher(nil)
	h := def.Hash(scope)
	require.Regexp(t, regexp.MustCompile(`^[0-9a-f]{32}$`), h)
	require.NotContains(t, h, strings.ToLower(scope))
	require.Equal(t, h, telemetry.ScopeHasher{}.Hash(scope), "the zero value uses the default key")
	require.Equal(t, h, def.Hash(scope), "stable")
	require.NotEqual(t, h, def.Hash("acct_2"))
	keyed := telemetry.NewScopeHasher([]byte("service secret"))
	require.NotEqual(t, h, keyed.Hash(scope))
	kv := keyed.Attribute(scope)
	require.Equal(t, telemetry.AttrScopeHash, string(kv.Key))
	require.Equal(t, keyed.Hash(scope), kv.Value.AsString())
}
