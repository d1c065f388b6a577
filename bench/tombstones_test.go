package bench

import (
	"context"
	"testing"
)

// BenchmarkRunBesideAMillionTombstones is BenchmarkRun with 1,000,000
// expired-key tombstones in the same scope: the cost of the tombstone
// probe in a first attempt's key insert (compare with BenchmarkRun in the
// same run). The tombstones are removed when it ends.
func BenchmarkRunBesideAMillionTombstones(b *testing.B) {
	p := pool(b)
	ctx := context.Background()
	if _, err := p.Exec(ctx, `
		INSERT INTO idempotency_key_tombstones (scope, key_hash, fingerprint, finished_at, response_status, expires_at)
		SELECT 'bench', sha256(convert_to('tomb-' || i, 'UTF8')), sha256(convert_to('fp-' || i, 'UTF8')),
		       now() - interval '2 days', 201, now() + interval '30 days'
		FROM generate_series(1, 1000000) AS i
		ON CONFLICT DO NOTHING`); err != nil {
		b.Fatal(err)
	}
	if _, err := p.Exec(ctx, `ANALYZE idempotency_key_tombstones`); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = p.Exec(context.Background(), `TRUNCATE idempotency_key_tombstones`) })
	r := runner(b, nil)
	b.ReportAllocs()
	for b.Loop() {
		k := freshKey()
		if _, err := r.Run(ctx, key(k), runFunc(k)); err != nil {
			b.Fatal(err)
		}
	}
}
