package telemetry

import (
	"context"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// Meter returns the atomicphase meter of mp, or of the global
// MeterProvider when mp is nil. Instruments created from the global one
// before an SDK is installed forward to it once it is.
func Meter(mp metric.MeterProvider) metric.Meter {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	return mp.Meter(ScopeName)
}

// defaultTracerProvider is the global TracerProvider as it is before any
// SDK is installed: a delegating no-op. otel.GetTracerProvider returns it
// until otel.SetTracerProvider replaces it.
var defaultTracerProvider = otel.GetTracerProvider()

// noopSpan is a span that records nothing, shared: calling its methods
// allocates nothing.
var noopSpan = trace.SpanFromContext(context.Background())

// startOptions holds one precomputed option slice per span kind, so that a
// span start passes no freshly built variadic slice.
var startOptions = func() [6][]trace.SpanStartOption {
	var o [6][]trace.SpanStartOption
	for k := range o {
		o[k] = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKind(k))}
	}
	return o
}()

// Tracer starts atomicphase spans from a TracerProvider, or from the
// global one resolved at each span when none is given. When the provider is
// a no-op (the global default before an SDK is installed, or a noop
// package provider) Start allocates nothing and returns ctx unchanged.
type Tracer struct {
	fixed trace.Tracer // from an explicit, live provider; nil otherwise
	noop  bool         // an explicit no-op provider
	// cached is the tracer of the last global provider seen.
	cached atomic.Pointer[cachedTracer]
}

type cachedTracer struct {
	tp     trace.TracerProvider
	tracer trace.Tracer
}

// NewTracer returns a Tracer over tp; nil means the global provider,
// looked up at each span.
func NewTracer(tp trace.TracerProvider) *Tracer {
	t := &Tracer{}
	switch tp.(type) {
	case nil:
	case tracenoop.TracerProvider, *tracenoop.TracerProvider:
		t.noop = true
	default:
		t.fixed = tp.Tracer(ScopeName)
	}
	return t
}

// tracer returns the tracer to use now, or nil when spans would record
// nothing.
func (t *Tracer) tracer() trace.Tracer {
	if t.fixed != nil || t.noop {
		return t.fixed
	}
	tp := otel.GetTracerProvider()
	if tp == defaultTracerProvider {
		return nil
	}
	if c := t.cached.Load(); c != nil && c.tp == tp {
		return c.tracer
	}
	if _, ok := tp.(tracenoop.TracerProvider); ok {
		return nil
	}
	c := &cachedTracer{tp: tp, tracer: tp.Tracer(ScopeName)}
	t.cached.Store(c)
	return c.tracer
}

// Start starts a span named name of the given kind, a child of ctx's span.
// With a no-op provider it returns ctx itself and a shared no-op span.
// Set attributes only when span.IsRecording() is true: building them
// costs allocations a no-op span does not need.
func (t *Tracer) Start(ctx context.Context, name string, kind trace.SpanKind) (context.Context, trace.Span) {
	tr := t.tracer()
	if tr == nil {
		return ctx, noopSpan
	}
	if kind < 0 || int(kind) >= len(startOptions) {
		kind = trace.SpanKindInternal
	}
	return tr.Start(ctx, name, startOptions[kind]...)
}

// StartWith starts a span like Start, with further options (a start
// time, links). Call it only when Enabled: building the options allocates.
func (t *Tracer) StartWith(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	tr := t.tracer()
	if tr == nil {
		return ctx, noopSpan
	}
	return tr.Start(ctx, name, opts...)
}

// Enabled reports whether spans started now would go to an SDK.
func (t *Tracer) Enabled() bool { return t.tracer() != nil }
