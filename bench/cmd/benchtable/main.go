// Command benchtable runs the atomicphase benchmark scenarios side by side
// with a bare transaction, DBOS-Go, River and Watermill, and prints the
// results as Markdown tables.
//
// The database is BENCH_DATABASE_URL (the database is created if missing),
// or else a throwaway local cluster started from the PostgreSQL binaries with
// fsync and synchronous_commit on. NATS is BENCH_NATS_URL, or else an
// in-process JetStream server.
//
// Usage:
//
//	go run ./cmd/benchtable            # short: 5 s per cell after 1 s warm-up
//	go run ./cmd/benchtable -long      # 30 s per cell after 5 s warm-up
//	go run ./cmd/benchtable -scenarios 1,2 -c 8 -duration 20s
//	go run ./cmd/benchtable -scale -out scale.md -chart scale.png
//
// The -scale mode measures how cost grows with the work instead of the
// scenarios: Run, replay and Resume beside 100k, 1M and 10M finished keys
// (-scale-keys), at c=1 and 8 unless -c says otherwise, and the relay's
// drain of 1,000,000 pending messages (-scale-drain) against -drain's.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
	"github.com/atomicphase/atomicphase/bench/internal/scenarios"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		os.Exit(1)
	}
}

type settingsFlag map[string]string

func (f settingsFlag) String() string { return fmt.Sprint(map[string]string(f)) }

func (f settingsFlag) Set(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if !ok || k == "" {
		return fmt.Errorf("want name=value, got %q", v)
	}
	f[k] = val
	return nil
}

func run() error {
	long := flag.Bool("long", false, "long mode: 30 s per cell after 5 s warm-up (default short: 5 s after 1 s)")
	duration := flag.Duration("duration", 0, "measurement window per cell (overrides the mode)")
	warmup := flag.Duration("warmup", 0, "warm-up per cell (overrides the mode)")
	conc := flag.String("c", "1,8,32", "concurrencies, comma-separated")
	which := flag.String("scenarios", "1,2,3,4,5", "scenarios to run, comma-separated (1-5; 6 is `go test -bench`)")
	cleanupRows := flag.Int("cleanup-rows", 0, "expired keys the cleanup scenario deletes (default: 300000 short, 1000000 long)")
	cleanupLoadRows := flag.Int("cleanup-load-rows", 0, "expired keys present while Run's p99 is compared with and without the cleaner (default: 300000)")
	cleanupBatch := flag.Int("cleanup-batch", 0, "cleanup.Config.BatchSize (0: the library default)")
	cleanupPause := flag.Duration("cleanup-pause", 0, "cleanup.Config.BatchPause (0: the library default)")
	drain := flag.Int("drain", 20_000, "messages the relay-capacity rows of the outbox scenario drain")
	wmPoll := flag.Duration("watermill-poll", 10*time.Millisecond, "Watermill SQL subscriber poll interval")
	experiments := flag.Bool("experiments", false, "add rows measuring proposed library changes (they bypass parts of the library)")
	out := flag.String("out", "", "also write the Markdown report to this file")
	statements := flag.String("statements", "", "write each cell's pg_stat_statements summary to this file (needs the extension preloaded; for the throwaway cluster add -pg shared_preload_libraries=pg_stat_statements; its plan ms column needs -pg pg_stat_statements.track_planning=on too)")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	scale := flag.Bool("scale", false, "scale mode: how cost grows with the work (key table size, outbox backlog) instead of the scenarios")
	scaleKeys := flag.String("scale-keys", "100000,1000000,10000000", "scale mode: finished keys in the table, comma-separated, smallest first (ratios are to the first)")
	scaleDrain := flag.Int("scale-drain", 1_000_000, "scale mode: pending outbox messages the relay drains (compared with -drain's); 0: none")
	scaleExplain := flag.String("scale-explain", "", "scale mode: write EXPLAIN (ANALYZE, BUFFERS) of the key lookup and insert at each size to this file")
	chart := flag.String("chart", "", "scale mode: also draw latency against table size as a PNG image to this file")
	pgSettings := settingsFlag{}
	execMode := flag.String("exec-mode", "cache_statement", "pgx query exec mode of every pool, ours and the baselines' (cache_statement, cache_describe, describe_exec, exec, simple_protocol)")
	flag.Var(pgSettings, "pg", "server setting name=value for the throwaway cluster (repeatable)")
	flag.Parse()

	timing := harness.Timing{Warmup: time.Second, Duration: 5 * time.Second}
	mode := "short"
	if *long {
		timing = harness.Timing{Warmup: 5 * time.Second, Duration: 30 * time.Second}
		mode = "long"
	}
	if *duration > 0 {
		timing.Duration = *duration
	}
	if *warmup > 0 {
		timing.Warmup = *warmup
	}
	if *cleanupRows == 0 {
		*cleanupRows = 300_000
		if *long {
			*cleanupRows = 1_000_000
		}
	}
	if *cleanupLoadRows == 0 {
		*cleanupLoadRows = 300_000
	}
	if *scale && !flagSet("c") {
		*conc = "1,8"
	}
	var cs []int
	for _, f := range strings.Split(*conc, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return fmt.Errorf("-c: bad concurrency %q", f)
		}
		cs = append(cs, n)
	}
	enabled := map[int]bool{}
	for _, f := range strings.Split(*which, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > 5 {
			return fmt.Errorf("-scenarios: bad scenario %q (1-5)", f)
		}
		enabled[n] = true
	}

	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *scale {
		var sizes []int
		for _, f := range strings.Split(*scaleKeys, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 1 || (len(sizes) > 0 && n <= sizes[len(sizes)-1]) {
				return fmt.Errorf("-scale-keys: bad size %q (positive, increasing)", f)
			}
			sizes = append(sizes, n)
		}
		return runScale(ctx, scaleRun{
			timing: timing, mode: mode, concurrency: cs, sizes: sizes, drain: *scaleDrain, smallDrain: *drain,
			out: *out, chart: *chart, explain: *scaleExplain, pgSettings: pgSettings,
		})
	}

	began := time.Now()
	env, err := harness.Setup(ctx, enabled[4], pgSettings)
	if err != nil {
		return err
	}
	defer env.Close()
	if env.ExecMode, err = parseExecMode(*execMode); err != nil {
		return err
	}

	suite := &scenarios.Suite{
		Env: env, Timing: timing, Concurrency: cs,
		CleanupRows: *cleanupRows, CleanupBatch: *cleanupBatch, CleanupPause: *cleanupPause, CleanupLoadRows: *cleanupLoadRows, DrainMessages: *drain,
		WatermillPoll: *wmPoll, Log: os.Stderr, Experiments: *experiments,
	}
	if *statements != "" {
		f, err := os.Create(*statements)
		if err != nil {
			return err
		}
		defer f.Close()
		suite.Statements = f
	}
	if err := suite.Prepare(ctx); err != nil {
		return err
	}
	if enabled[1] || enabled[2] || enabled[3] {
		if err := suite.RunCore(ctx, enabled[1], enabled[2], enabled[3]); err != nil {
			return err
		}
	}
	if enabled[4] {
		if err := suite.RunOutbox(ctx); err != nil {
			return err
		}
		if err := suite.RunInbox(ctx); err != nil { // the consumer side
			return err
		}
	}
	if enabled[5] {
		if err := suite.RunCleanup(ctx); err != nil {
			return err
		}
	}

	var w io.Writer = os.Stdout
	var file *os.File
	if *out != "" {
		file, err = os.Create(*out)
		if err != nil {
			return err
		}
		defer file.Close()
		w = io.MultiWriter(os.Stdout, file)
	}
	fmt.Fprintf(w, "## atomicphase benchmarks (%s mode)\n\n", mode)
	fmt.Fprintf(w, "- Date: %s; total run time %s\n", began.UTC().Format("2006-01-02 15:04 MST"), time.Since(began).Round(time.Second))
	fmt.Fprintf(w, "- Machine: %d CPUs (GOMAXPROCS %d), %s/%s, %s; load average before the run: %s\n",
		runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.GOOS, runtime.GOARCH, runtime.Version(), loadAvg())
	fmt.Fprintf(w, "- Database: %s (%s); pgx exec mode %s for every pool\n", env.ServerInfo(ctx), env.Source, env.ExecMode)
	fmt.Fprintf(w, "- Each cell: fresh pool (c+10 connections), tables truncated, CHECKPOINT, %v warm-up, then %v measured; closed loop, c goroutines back to back. Ratios compare figures measured in the same run.\n", timing.Warmup, timing.Duration)
	fmt.Fprintf(w, "- Command: `%s`\n\n", reproduce())
	for _, t := range suite.Tables {
		t.Markdown(w)
	}
	scenarios.Summary(w, suite.Tables)
	return nil
}

// parseExecMode returns the pgx query exec mode named as pgx names it, with
// underscores for spaces.
func parseExecMode(name string) (pgx.QueryExecMode, error) {
	for _, m := range []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
		pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
	} {
		if strings.ReplaceAll(m.String(), " ", "_") == name {
			return m, nil
		}
	}
	return 0, fmt.Errorf("-exec-mode: unknown mode %q", name)
}

// flagSet reports whether the named flag was given on the command line.
func flagSet(name string) bool {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

type scaleRun struct {
	timing      harness.Timing
	mode        string
	concurrency []int
	sizes       []int
	drain       int
	smallDrain  int
	out, chart  string
	explain     string
	pgSettings  map[string]string
}

// runScale runs the scale mode and writes its report (and chart).
func runScale(ctx context.Context, r scaleRun) error {
	env, err := harness.Setup(ctx, r.drain > 0, r.pgSettings)
	if err != nil {
		return err
	}
	defer env.Close()
	suite := &scenarios.Suite{Env: env, Timing: r.timing, Concurrency: r.concurrency, DrainMessages: r.smallDrain, Log: os.Stderr}
	if err := suite.Prepare(ctx); err != nil {
		return err
	}
	loadBefore := loadAvg()
	rep, err := suite.RunScale(ctx, r.sizes, r.drain)
	if err != nil {
		return err
	}
	var w io.Writer = os.Stdout
	if r.out != "" {
		file, err := os.Create(r.out)
		if err != nil {
			return err
		}
		defer file.Close()
		w = io.MultiWriter(os.Stdout, file)
	}
	fmt.Fprintf(w, "## atomicphase: how cost grows with the work (%s mode)\n\n", r.mode)
	fmt.Fprintf(w, "- Date: %s; total run time %s\n", rep.Began.UTC().Format("2006-01-02 15:04 MST"), rep.Took.Round(time.Second))
	fmt.Fprintf(w, "- Machine: %d CPUs (GOMAXPROCS %d), %s/%s, %s; load average before the run: %s\n",
		runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.GOOS, runtime.GOARCH, runtime.Version(), loadBefore)
	fmt.Fprintf(w, "- Database: %s (%s); pgx exec mode %s for every pool\n", env.ServerInfo(ctx), env.Source, env.ExecMode)
	fmt.Fprintf(w, "- Command: `%s`\n\n", reproduce())
	rep.Markdown(w)
	if r.chart != "" {
		if err := rep.Chart(r.chart); err != nil {
			return fmt.Errorf("chart: %w", err)
		}
		fmt.Fprintf(os.Stderr, "benchtable: chart written to %s\n", r.chart)
	}
	if r.explain != "" {
		var b strings.Builder
		for _, p := range rep.Points {
			b.WriteString(p.Plans + "\n")
		}
		if err := os.WriteFile(r.explain, []byte(b.String()), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// reproduce returns the command line, less the flags that only name output files.
func reproduce() string {
	var args []string
	skip := false
	for _, a := range os.Args[1:] {
		if skip {
			skip = false
			continue
		}
		name := strings.TrimLeft(a, "-")
		name, _, hasValue := strings.Cut(name, "=")
		if slices.Contains([]string{"out", "statements", "cpuprofile", "chart", "scale-explain"}, name) {
			skip = !hasValue
			continue
		}
		args = append(args, a)
	}
	return strings.TrimSpace("go run ./cmd/benchtable " + strings.Join(args, " "))
}
