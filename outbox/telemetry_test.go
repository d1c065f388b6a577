package outbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/atomicphase/atomicphase/internal/outboxtest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/internal/telemetry/metrictest"
	"github.com/atomicphase/atomicphase/outbox"
)

// setPropagator installs the W3C trace-context propagator globally, as a
// service with an OpenTelemetry SDK does. Enqueue writes trace headers only
// when ctx carries a span, which no other test's context does.
var setPropagator sync.Once

// One request's trace reaches the broker: Enqueue, called under the
// request's span, stores its traceparent with the message; the publisher
// sends it as a header; the relay's publish span (a producer span, child of
// its batch span) links to the request's span. The relay's counters and
// commit-to-ack histogram record each outcome by topic.
func TestTraceContextTravelsThroughTheOutboxAndTheRelayRecordsMetrics(t *testing.T) {
	t.Parallel()
	setPropagator.Do(func() { otel.SetTextMapPropagator(propagation.TraceContext{}) })
	d := pgtest.New(t)
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	mp, reader := metrictest.NewProvider(t)

	ctx, request := tp.Tracer("service").Start(context.Background(), "POST /orders")
	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, outbox.Enqueue(ctx, tx,
		outbox.Message{Topic: "orders.created", Payload: []byte("1"), Headers: map[string]string{"Content-Type": "application/json"}},
		outbox.Message{Topic: "orders.audit", Payload: []byte("2"), Headers: map[string]string{"Traceparent": "00-11111111111111111111111111111111-2222222222222222-01"}},
		outbox.Message{Topic: "orders.rejected", Payload: []byte("3")}))
	require.NoError(t, tx.Commit(ctx))
	request.End()
	traceID := request.SpanContext().TraceID().String()

	var mu sync.Mutex
	sent := map[string]map[string]string{}
	pub := outbox.PublisherFunc(func(_ context.Context, e outbox.Envelope) error {
		mu.Lock()
		sent[e.Topic] = e.Headers
		mu.Unlock()
		if e.Topic == "orders.rejected" {
			return outbox.Permanent(errors.New("rejected by the receiver"))
		}
		return nil
	})
	r := outboxtest.NewRelay(t, d.Pool, pub, outbox.Config{MeterProvider: mp, TracerProvider: tp})
	n, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, n)

	require.Contains(t, sent["orders.created"][telemetry.HeaderTraceparent], traceID, "the request's trace went with the message")
	require.Equal(t, "application/json", sent["orders.created"]["Content-Type"])
	require.Equal(t, "00-11111111111111111111111111111111-2222222222222222-01", sent["orders.audit"]["Traceparent"],
		"a message's own trace header is kept")
	require.NotContains(t, sent["orders.audit"], telemetry.HeaderTraceparent)

	var batch sdktrace.ReadOnlySpan
	publishes := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range spans.Ended() {
		switch {
		case s.Name() == telemetry.SpanRelayBatch:
			batch = s
		case s.SpanKind() == trace.SpanKindProducer:
			publishes[s.Name()] = s
		}
	}
	require.NotNil(t, batch)
	require.Len(t, publishes, 3)
	created := publishes[telemetry.SpanPublishPrefix+"orders.created"]
	require.Equal(t, batch.SpanContext().SpanID(), created.Parent().SpanID(), "a publish is a child of its batch")
	require.NotEqual(t, request.SpanContext().TraceID(), created.SpanContext().TraceID(), "the relay runs in its own trace")
	require.Len(t, created.Links(), 1)
	require.Equal(t, request.SpanContext().SpanID(), created.Links()[0].SpanContext.SpanID(), "linked to the request")
	rejected := publishes[telemetry.SpanPublishPrefix+"orders.rejected"]
	require.Equal(t, codes.Error, rejected.Status().Code)

	m := metrictest.Collect(t, reader)
	require.Equal(t, float64(1), m[telemetry.MetricPublished].Points["messaging.destination.name=orders.created"].Value)
	require.Equal(t, float64(1), m[telemetry.MetricPublished].Points["messaging.destination.name=orders.audit"].Value)
	require.Equal(t, float64(1), m[telemetry.MetricDeadLettered].Points["messaging.destination.name=orders.rejected"].Value)
	require.Equal(t, uint64(1), m[telemetry.MetricCommitToAck].Points["messaging.destination.name=orders.created"].Count)
}
