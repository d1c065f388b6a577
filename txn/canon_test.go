package txn

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// The canonical form of a request's params is computed on every Run, so it
// must stay cheap: a few allocations however many members, strings and
// nested objects the params hold (the result itself is one of them). The
// bound leaves room for the race detector, under which sync.Pool drops a
// quarter of what is put back and the scratch space is allocated again.
func TestCanonicalJSONAllocatesLittle(t *testing.T) {
	// Not parallel: AllocsPerRun counts the whole process's allocations.
	for _, in := range []string{
		`{"amount":100,"currency":"usd"}`,
		`{"order":{"lines":[{"sku":"a-1","qty":2,"price":"9.99"},{"sku":"b-2","qty":1,"price":"19.50"}],` +
			`"note":"caf\u00e9 \"quoted\"\n"},"customer":{"id":"cus_123","tags":["vip","eu"]},"amount":3948,"live":true}`,
	} {
		_, err := canonicalJSON([]byte(in))
		require.NoError(t, err)
		allocs := testing.AllocsPerRun(100, func() { _, _ = canonicalJSON([]byte(in)) })
		t.Logf("canonicalJSON: %.0f allocs for %d bytes", allocs, len(in))
		require.LessOrEqual(t, allocs, 8.0, in)
	}
}

// prepare (validation, canonical params, fingerprint) allocates little.
func TestPrepareAllocatesLittle(t *testing.T) {
	// Not parallel: AllocsPerRun counts the whole process's allocations.
	k := Key{Scope: "bench", Value: "order-1", Method: "POST", Path: "/orders",
		Params: []byte(`{"amount":100,"currency":"usd"}`)}
	_, err := prepare(k, 1<<20)
	require.NoError(t, err)
	allocs := testing.AllocsPerRun(100, func() { _, _ = prepare(k, 1<<20) })
	t.Logf("prepare: %.0f allocs", allocs)
	require.LessOrEqual(t, allocs, 10.0)
}
