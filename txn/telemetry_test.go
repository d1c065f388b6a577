package txn_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/internal/telemetry/metrictest"
	"github.com/atomicphase/atomicphase/txn"
)

// queryParents is a pgx.QueryTracer, as otelpgx is: it records the span
// each statement's ctx carries, to show that pgx's spans nest under ours.
type queryParents struct {
	mu    sync.Mutex
	spans []trace.SpanID
}

func (q *queryParents) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.spans = append(q.spans, trace.SpanContextFromContext(ctx).SpanID())
	return ctx
}

func (q *queryParents) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (q *queryParents) reset() []trace.SpanID {
	q.mu.Lock()
	defer q.mu.Unlock()
	s := q.spans
	q.spans = nil
	return s
}

func spanAttr(s sdktrace.ReadOnlySpan, key string) attribute.Value {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// A Runner given OpenTelemetry providers records a span per call with the
// outcome and the scope's hash (never the scope), the outcome counters and
// the run duration, by workflow; every statement the call sends runs under
// its span, so a pgx tracer's spans nest under it.
func TestRunnerRecordsSpansAndMetricsThroughOpenTelemetry(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	mp, reader := metrictest.NewProvider(t)
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tracer := &queryParents{}
	pool := e.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	reg := txn.NewRegistry()
	r, err := txn.New(pool, &txn.Config{Workflows: reg, MeterProvider: mp, TracerProvider: tp})
	require.NoError(t, err)

	var calls atomic.Int64
	_, err = r.Run(ctx, chargeKey("k1", 7), insertCharge(&calls, "c1", 7))
	require.NoError(t, err)
	resp, err := r.Run(ctx, chargeKey("k1", 7), insertCharge(&calls, "c1", 7))
	require.NoError(t, err)
	require.True(t, resp.Replayed)
	_, err = r.Run(ctx, chargeKey("k1", 8), insertCharge(&calls, "c1", 8))
	require.ErrorIs(t, err, txn.ErrKeyReused)

	ended := spans.Ended()
	require.Len(t, ended, 3)
	for i, want := range []string{"executed", "replayed", "reused"} {
		s := ended[i]
		require.Equal(t, telemetry.SpanRun, s.Name())
		require.Equal(t, want, spanAttr(s, telemetry.AttrOutcome).AsString())
		hash := spanAttr(s, telemetry.AttrScopeHash).AsString()
		require.Len(t, hash, 32)
		require.NotContains(t, hash, "acct_1")
		require.Equal(t, codes.Unset, s.Status().Code, "an answer is not an error")
	}
	parents := tracer.reset()
	require.NotEmpty(t, parents)
	for _, p := range parents {
		require.True(t, p.IsValid(), "a statement ran outside the call's span")
	}
	require.Contains(t, parents, ended[0].SpanContext().SpanID())

	// A workflow, and a failure of the library's own work.
	f := newRideFlow(t, reg, "ride")
	_, err = r.RunWorkflow(ctx, rideKey("w1"), f.wf)
	require.NoError(t, err)
	f.failAt.Store("after_p1")
	_, err = r.RunWorkflow(ctx, rideKey("w2"), f.wf)
	require.ErrorIs(t, err, errInjected)
	var runs, phases []sdktrace.ReadOnlySpan
	for _, s := range spans.Ended()[3:] {
		if s.Name() == telemetry.SpanRunWorkflow {
			runs = append(runs, s)
		} else {
			phases = append(phases, s)
		}
	}
	require.Len(t, runs, 2)
	require.Equal(t, "ride", spanAttr(runs[0], telemetry.AttrWorkflow).AsString())
	require.Equal(t, "executed", spanAttr(runs[0], telemetry.AttrOutcome).AsString())
	require.Equal(t, "transient", spanAttr(runs[1], telemetry.AttrOutcome).AsString())
	require.Equal(t, codes.Error, runs[1].Status().Code)
	require.Equal(t, int64(1), spanAttr(runs[0], telemetry.AttrAttempts).AsInt64())
	require.Equal(t, int64(1), spanAttr(runs[1], telemetry.AttrAttempts).AsInt64())
	// The first run's phases are its children, named by kind and phase.
	var first []string
	for _, p := range phases {
		if p.Parent().SpanID() == runs[0].SpanContext().SpanID() {
			first = append(first, p.Name()+" "+spanAttr(p, telemetry.AttrPhase).AsString())
		}
	}
	require.Equal(t, []string{
		telemetry.SpanPhaseAtomic + " ride_created", telemetry.SpanPhaseForeign + " charge_created",
		telemetry.SpanPhaseFinish + " finish",
	}, first)
	for _, p := range phases {
		require.Equal(t, int64(0), spanAttr(p, telemetry.AttrPhaseRetries).AsInt64())
	}

	// The retry of the failed key is its second attempt.
	f.failAt.Store("")
	before := len(spans.Ended())
	_, err = r.RunWorkflow(ctx, rideKey("w2"), f.wf)
	require.NoError(t, err)
	retry := spans.Ended()[len(spans.Ended())-1]
	require.Greater(t, len(spans.Ended()), before)
	require.Equal(t, telemetry.SpanRunWorkflow, retry.Name())
	require.Equal(t, int64(2), spanAttr(retry, telemetry.AttrAttempts).AsInt64())

	m := metrictest.Collect(t, reader)
	require.Equal(t, float64(1), m[telemetry.MetricExecuted].Points["atomicphase.workflow="].Value)
	require.Equal(t, float64(2), m[telemetry.MetricExecuted].Points["atomicphase.workflow=ride"].Value)
	require.Equal(t, float64(1), m[telemetry.MetricReplayed].Points["atomicphase.workflow="].Value)
	require.Equal(t, float64(1), m[telemetry.MetricReused].Points["atomicphase.workflow="].Value)
	require.Equal(t, float64(1), m[telemetry.MetricReleased].Points["atomicphase.workflow=ride"].Value,
		"the failed workflow's key was released, counted under its workflow")
	require.Equal(t, uint64(1),
		m[telemetry.MetricRunDuration].Points["atomicphase.outcome=transient,atomicphase.workflow=ride"].Count)
	require.Equal(t, uint64(2), m[telemetry.MetricPhaseDuration].
		Points["atomicphase.phase=ride_created,atomicphase.phase.kind=atomic,atomicphase.workflow=ride"].Count,
		"ride_created ran in the first two runs; the retry resumed after it")
}
