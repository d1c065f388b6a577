package txn

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/telemetry"
)

// BenchmarkTelemetryOfARunWithoutSDK is what telemetry adds to each Run
// when no OpenTelemetry SDK is installed (the global no-op providers): the
// span start and end, the outcome counter and the duration histogram. It
// needs no database: the pool is never used. Compare its ns/op with
// bench's BenchmarkRun to bound the throughput cost (README, Performance).
func BenchmarkTelemetryOfARunWithoutSDK(b *testing.B) {
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?sslmode=disable")
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	r, err := New(pool, &Config{})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	resp := Response{Status: 201}
	b.ReportAllocs()
	for b.Loop() {
		sctx, span, start := r.startSpan(ctx, telemetry.SpanRun)
		r.ended(sctx, span, start, "", "tenant_1", resp, nil)
	}
}
