// Allocation benchmarks for the library's hot paths (scenario 6), and a test
// that compares their allocations with the committed baseline in
// testdata/allocs-baseline.txt. Nothing here asserts on time.
//
//	go test -run '^$' -bench . -benchmem          # the benchmarks
//	go test -run TestAllocsBaseline -v            # compare with the baseline
//	BENCH_ALLOCS_UPDATE=1 go test -run TestAllocsBaseline   # rewrite it
//	BENCH_ALLOCS_STRICT=1 go test -run TestAllocsBaseline   # fail on >10% more allocs
package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/txn"
)

var (
	envOnce sync.Once
	env     *harness.Env
	envPool *pgxpool.Pool
	envErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if envPool != nil {
		envPool.Close()
	}
	if env != nil {
		env.Close()
	}
	os.Exit(code)
}

// pool returns the shared benchmark pool, starting the database on first use.
func pool(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	envOnce.Do(func() {
		ctx := context.Background()
		env, envErr = harness.Setup(ctx, false, nil)
		if envErr != nil {
			return
		}
		envPool, _, envErr = env.NewPool(ctx, 4)
		if envErr != nil {
			return
		}
		if envErr = migrations.Up(ctx, envPool); envErr != nil {
			return
		}
		_, envErr = envPool.Exec(ctx, `CREATE TABLE IF NOT EXISTS bench_rows (
		    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, op_key text NOT NULL,
		    step smallint NOT NULL, amount bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`)
	})
	if envErr != nil {
		tb.Fatalf("benchmark database: %v", envErr)
	}
	return envPool
}

const insertRow = `INSERT INTO bench_rows (op_key, step, amount) VALUES ($1, $2, $3)`

var (
	params = []byte(`{"amount":100,"currency":"usd"}`)
	body   = []byte(`{"status":"created"}`)
	keySeq atomic.Int64
	prefix = strconv.FormatInt(int64(os.Getpid()), 36)
)

func freshKey() string { return fmt.Sprintf("alloc-%s-%d", prefix, keySeq.Add(1)) }

func key(v string) txn.Key {
	return txn.Key{Scope: "bench", Value: v, Method: "POST", Path: "/orders", Params: params}
}

func runFunc(k string) txn.Func {
	return func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, insertRow, k, 1, 100); err != nil {
			return txn.Response{}, err
		}
		return txn.Response{Status: 201, Body: body}, nil
	}
}

func runner(tb testing.TB, reg *txn.Registry) *txn.Runner {
	r, err := txn.New(pool(tb), &txn.Config{Workflows: reg, Logger: harness.Discard})
	if err != nil {
		tb.Fatal(err)
	}
	return r
}

// BenchmarkBareTx is the baseline: the same row in a bare SERIALIZABLE transaction.
func BenchmarkBareTx(b *testing.B) {
	p := pool(b)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		tx, err := p.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := tx.Exec(ctx, insertRow, freshKey(), 1, 100); err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRun is one single-phase Run of a new key.
func BenchmarkRun(b *testing.B) {
	r := runner(b, nil)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		k := freshKey()
		if _, err := r.Run(ctx, key(k), runFunc(k)); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRunRejected is one Run of a new key whose function writes its
// row and then answers 422, a response Config.Store does not store: the
// writes are rolled back and no key is left, after the read that tells
// whether a twin stored the key meanwhile.
func BenchmarkRunRejected(b *testing.B) {
	r := runner(b, nil)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		k := freshKey()
		resp, err := r.Run(ctx, key(k), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, insertRow, k, 1, 100); err != nil {
				return txn.Response{}, err
			}
			return txn.Response{Status: 422, Body: rejectedBody}, nil
		})
		if err != nil || resp.Status != 422 {
			b.Fatal(err, resp.Status)
		}
	}
}

var rejectedBody = []byte(`{"error":"amount too large"}`)

// BenchmarkReplay is one Run of a finished key: the stored response, replayed.
func BenchmarkReplay(b *testing.B) {
	r := runner(b, nil)
	ctx := context.Background()
	k := freshKey()
	if _, err := r.Run(ctx, key(k), runFunc(k)); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		resp, err := r.Run(ctx, key(k), runFunc(k))
		if err != nil || !resp.Replayed {
			b.Fatal(err, resp.Replayed)
		}
	}
}

var threeSteps = txn.NewWorkflow("alloc_three_steps", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
	_, k := a.Key()
	if _, err := txn.Atomic(ctx, a, "first_write", func(ctx context.Context, tx pgx.Tx) (int, error) {
		_, err := tx.Exec(ctx, insertRow, k, 1, 100)
		return 1, err
	}); err != nil {
		return txn.Response{}, err
	}
	if _, err := txn.Foreign(ctx, a, "foreign_noop", func(context.Context, string) (string, error) { return "ok", nil }); err != nil {
		return txn.Response{}, err
	}
	return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, insertRow, k, 3, 100); err != nil {
			return txn.Response{}, err
		}
		return txn.Response{Status: 201, Body: body}, nil
	})
})

// BenchmarkWorkflow is one three-phase workflow of a new key.
func BenchmarkWorkflow(b *testing.B) {
	reg := txn.NewRegistry()
	if err := reg.Register(threeSteps); err != nil {
		b.Fatal(err)
	}
	r := runner(b, reg)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := r.RunWorkflow(ctx, key(freshKey()), threeSteps); err != nil {
			b.Fatal(err)
		}
	}
}

const baselineFile = "testdata/allocs-baseline.txt"

type allocs struct{ bytes, allocs int64 }

// TestAllocsBaseline measures the benchmarks' allocations and reports them
// against the committed baseline. It fails only with BENCH_ALLOCS_STRICT=1
// and more than 10% more allocations per op; it never looks at time.
func TestAllocsBaseline(t *testing.T) {
	pool(t)
	benches := []struct {
		name string
		fn   func(*testing.B)
	}{
		{"BenchmarkBareTx", BenchmarkBareTx},
		{"BenchmarkRun", BenchmarkRun},
		{"BenchmarkRunRejected", BenchmarkRunRejected},
		{"BenchmarkReplay", BenchmarkReplay},
		{"BenchmarkWorkflow", BenchmarkWorkflow},
	}
	base, err := readBaseline(baselineFile)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var lines []string
	for _, bm := range benches {
		res := testing.Benchmark(bm.fn)
		got := allocs{bytes: res.AllocedBytesPerOp(), allocs: res.AllocsPerOp()}
		lines = append(lines, fmt.Sprintf("%s-%d\t%d\t%d ns/op\t%d B/op\t%d allocs/op",
			bm.name, runtime.GOMAXPROCS(0), res.N, res.NsPerOp(), got.bytes, got.allocs))
		want, ok := base[bm.name]
		if !ok {
			t.Logf("%-18s %6d allocs/op %8d B/op (no baseline)", bm.name, got.allocs, got.bytes)
			continue
		}
		t.Logf("%-18s %6d allocs/op (baseline %d, %+.1f%%) %8d B/op (baseline %d, %+.1f%%)", bm.name,
			got.allocs, want.allocs, pct(got.allocs, want.allocs), got.bytes, want.bytes, pct(got.bytes, want.bytes))
		if os.Getenv("BENCH_ALLOCS_STRICT") == "1" && float64(got.allocs) > 1.10*float64(want.allocs) {
			t.Errorf("%s: %d allocs/op, more than 10%% over the baseline's %d", bm.name, got.allocs, want.allocs)
		}
	}
	if os.Getenv("BENCH_ALLOCS_UPDATE") == "1" {
		header := "# Allocations per op of the hot paths, in `go test -bench` format (ns/op is informational only).\n" +
			"# Regenerate with: BENCH_ALLOCS_UPDATE=1 go test -run TestAllocsBaseline\n"
		if err := os.MkdirAll(filepath.Dir(baselineFile), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(baselineFile, []byte(header+strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", baselineFile)
	}
}

func pct(got, want int64) float64 {
	if want == 0 {
		return 0
	}
	return 100 * float64(got-want) / float64(want)
}

// readBaseline parses `go test -bench -benchmem` lines into B/op and allocs/op by name.
func readBaseline(path string) (map[string]allocs, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]allocs{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 || !strings.HasPrefix(fields[0], "Benchmark") {
			continue
		}
		name, _, _ := strings.Cut(fields[0], "-")
		var a allocs
		for i := 1; i+1 < len(fields); i++ {
			v, err := strconv.ParseInt(fields[i], 10, 64)
			if err != nil {
				continue
			}
			switch fields[i+1] {
			case "B/op":
				a.bytes = v
			case "allocs/op":
				a.allocs = v
			}
		}
		out[name] = a
	}
	return out, sc.Err()
}
