// Package metrictest collects what instruments recorded, through the
// OpenTelemetry SDK's manual reader, in a shape tests can compare. Tests
// only: it links the SDK, which no library package does.
package metrictest

import (
	"context"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Point is one data point: its attributes, rendered "k=v,k=v" in key
// order (as attribute.Set sorts them), and its value (the sum of a counter, the value of a gauge, or the
// count and sum of a histogram).
type Point struct {
	Attrs string
	Value float64
	Count uint64
	Sum   float64
}

// Metric is one collected instrument.
type Metric struct {
	Name, Unit, Kind string // Kind: counter, gauge or histogram
	Points           map[string]Point
}

// NewProvider returns an SDK meter provider read by a manual reader.
func NewProvider(tb testing.TB) (*sdkmetric.MeterProvider, *sdkmetric.ManualReader) {
	tb.Helper()
	r := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(r))
	tb.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return mp, r
}

// Collect reads every metric now, by name, and fails the test if a
// callback failed.
func Collect(tb testing.TB, r *sdkmetric.ManualReader) map[string]Metric {
	tb.Helper()
	m, err := CollectWithError(r)
	if err != nil {
		tb.Fatalf("metrictest: collect: %v", err)
	}
	return m
}

// CollectWithError reads every metric now, by name, and returns the
// callbacks' errors too: what a failed callback leaves out, the others
// still report.
func CollectWithError(r *sdkmetric.ManualReader) (map[string]Metric, error) {
	var rm metricdata.ResourceMetrics
	err := r.Collect(context.Background(), &rm)
	out := map[string]Metric{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			c := Metric{Name: m.Name, Unit: m.Unit, Points: map[string]Point{}}
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				c.Kind = "counter"
				for _, p := range d.DataPoints {
					a := attrs(p.Attributes.ToSlice())
					c.Points[a] = Point{Attrs: a, Value: float64(p.Value)}
				}
			case metricdata.Sum[float64]:
				c.Kind = "counter"
				for _, p := range d.DataPoints {
					a := attrs(p.Attributes.ToSlice())
					c.Points[a] = Point{Attrs: a, Value: p.Value}
				}
			case metricdata.Gauge[int64]:
				c.Kind = "gauge"
				for _, p := range d.DataPoints {
					a := attrs(p.Attributes.ToSlice())
					c.Points[a] = Point{Attrs: a, Value: float64(p.Value)}
				}
			case metricdata.Gauge[float64]:
				c.Kind = "gauge"
				for _, p := range d.DataPoints {
					a := attrs(p.Attributes.ToSlice())
					c.Points[a] = Point{Attrs: a, Value: p.Value}
				}
			case metricdata.Histogram[float64]:
				c.Kind = "histogram"
				for _, p := range d.DataPoints {
					a := attrs(p.Attributes.ToSlice())
					c.Points[a] = Point{Attrs: a, Count: p.Count, Sum: p.Sum}
				}
			default:
				c.Kind = "other"
			}
			out[m.Name] = c
		}
	}
	return out, err
}

func attrs(kvs []attribute.KeyValue) string {
	parts := make([]string, 0, len(kvs))
	for _, kv := range kvs {
		parts = append(parts, string(kv.Key)+"="+kv.Value.String())
	}
	return strings.Join(parts, ",")
}
