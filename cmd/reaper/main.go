package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/cleanup"
	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/monitor"
	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// connectTimeout bounds the first connection and the schema check.
const connectTimeout = 15 * time.Second

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// options are the parsed command line.
type options struct {
	databaseURL          string
	ttl, outboxRetention time.Duration
	tombstoneRetention   time.Duration
	resumeDelay, maxAge  time.Duration
	unknownWorkflowDelay time.Duration
	maxAttempts          int
	batchSize            int
	cleanupPause         time.Duration
	once                 bool
	interval             time.Duration
	dryRun               bool
	logLevel             slog.Level
	httpAddr             string
}

// run is the whole command, minus signal handling: it returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseArgs(args, stdout)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "reaper: %v\nRun 'reaper -help' for usage.\n", err)
		return exitUsage
	}
	log := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: opts.logLevel}))

	poolCfg, err := pgxpool.ParseConfig(opts.databaseURL)
	if err != nil {
		fmt.Fprintf(stderr, "reaper: %v: invalid database URL: %v\nRun 'reaper -help' for usage.\n", errUsage, err)
		return exitUsage
	}
	poolCfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		fmt.Fprintf(stderr, "reaper: %v: %v\n", errUsage, err)
		return exitUsage
	}
	defer pool.Close()

	// No workflows: this binary has no user code, so it fails the stalled
	// keys it cannot resume. MaxAge is the runner's, the same setting a
	// service's own runner enforces on client retries.
	runner, err := txn.New(pool, &txn.Config{Logger: log, MaxAge: opts.maxAge})
	if err != nil {
		fmt.Fprintf(stderr, "reaper: %v: %v\nRun 'reaper -help' for usage.\n", errUsage, err)
		return exitUsage
	}
	resumer, err := recovery.New(runner, &recovery.Config{
		ResumeDelay:          opts.resumeDelay,
		MaxAttempts:          opts.maxAttempts,
		UnknownWorkflowDelay: opts.unknownWorkflowDelay,
		BatchSize:            opts.batchSize,
	})
	if err != nil {
		fmt.Fprintf(stderr, "reaper: %v: %v\nRun 'reaper -help' for usage.\n", errUsage, err)
		return exitUsage
	}
	cleaner, err := cleanup.New(pool, &cleanup.Config{
		Logger:             log,
		TTL:                opts.ttl,
		OutboxRetention:    opts.outboxRetention,
		TombstoneRetention: opts.tombstoneRetention,
		BatchSize:          opts.batchSize,
		BatchPause:         opts.cleanupPause,
	})
	if err != nil {
		fmt.Fprintf(stderr, "reaper: %v: %v\nRun 'reaper -help' for usage.\n", errUsage, err)
		return exitUsage
	}

	if msg, err := checkDatabase(ctx, pool); err != nil {
		if ctx.Err() != nil {
			log.Info("reaper stopped before its first round")
			return exitOK
		}
		log.Error(msg, "error", err.Error())
		return exitFailure
	}

	r := &reaper{log: log, resumer: resumer, cleaner: cleaner, dryRun: opts.dryRun,
		pool: pool, stalledAfter: opts.resumeDelay, interval: opts.interval,
		recoveryMetrics: telemetry.NewRecovery(nil), cleanupMetrics: telemetry.NewCleanup(nil)}
	if opts.httpAddr != "" {
		srv, err := startHTTP(opts.httpAddr, pool, r, log)
		if err != nil {
			log.Error("reaper: cannot serve http", "addr", opts.httpAddr, "error", err.Error())
			return exitFailure
		}
		defer srv.stop()
		log.Info("reaper http listening", "addr", srv.address)
	}
	if opts.once {
		if err := r.round(ctx); err != nil {
			return exitFailure
		}
		return exitOK
	}
	t := time.NewTicker(opts.interval)
	defer t.Stop()
	for {
		_ = r.round(ctx) // logged; a daemon keeps going
		select {
		case <-ctx.Done():
			log.Info("reaper stopped")
			return exitOK
		case <-t.C:
		}
	}
}

// checkDatabase connects and checks that every migration is applied. On
// failure it returns the message to log with the error.
func checkDatabase(ctx context.Context, pool *pgxpool.Pool) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := pool.Ping(cctx); err != nil {
		return "reaper: cannot connect to the database", err
	}
	if err := migrations.Check(cctx, pool); err != nil {
		if errors.Is(err, migrations.ErrSchemaBehind) {
			return "reaper: database schema is behind; apply the migrations first", err
		}
		return "reaper: cannot check the database schema", err
	}
	return "", nil
}

type reaper struct {
	log     *slog.Logger
	resumer *recovery.Resumer
	cleaner *cleanup.Cleaner
	dryRun  bool

	pool         *pgxpool.Pool
	stalledAfter time.Duration // the Resumer's ResumeDelay
	interval     time.Duration // 0 with -once
	// The rounds' counts, as metrics (exported with -http).
	recoveryMetrics *telemetry.Recovery
	cleanupMetrics  *telemetry.Cleanup

	mu   sync.Mutex
	last *roundResult // the last round that finished, for the status page
}

// roundResult is what the status page says about the last round.
type roundResult struct {
	At       time.Time
	Duration time.Duration
	DryRun   bool
	Recovery recovery.Report
	Cleanup  cleanup.Report
	Error    string
}

// Ago is how long ago the round ended.
func (r *roundResult) Ago() time.Duration { return time.Since(r.At) }

// lastRound returns the last round that finished, or nil.
func (r *reaper) lastRound() *roundResult {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.last
}

// round runs recovery, then cleanup, and logs one summary line. It returns
// an error if either failed; a stop (ctx ended) is not a failure.
func (r *reaper) round(ctx context.Context) error {
	began := time.Now()
	var (
		rec       recovery.Report
		cln       cleanup.Report
		recErr    error
		cleanErr  error
		operation = "reaper round"
	)
	if r.dryRun {
		operation = "reaper dry run"
		rec, recErr = r.resumer.DryRun(ctx)
		cln, cleanErr = r.cleaner.DryRun(ctx)
	} else {
		rec, recErr = r.resumer.RunOnce(ctx)
		if ctx.Err() == nil {
			cln, cleanErr = r.cleaner.RunOnce(ctx)
		}
	}
	// The outbox backlog, read after the round, for the summary line.
	var backlog monitor.Snapshot
	var backlogErr error
	if ctx.Err() == nil {
		backlog, backlogErr = monitor.Read(ctx, r.pool, &monitor.Config{StalledAfter: r.stalledAfter})
	}
	if !r.dryRun {
		r.record(rec, cln)
	}
	attrs := []any{
		"dry_run", r.dryRun,
		"resumed", rec.Resumed,
		"failed_unknown_workflow", rec.FailedUnknownWorkflow,
		"failed_max_attempts", rec.FailedMaxAttempts,
		"failed_max_age", rec.FailedMaxAge,
		"resume_errors", rec.Errors,
		"left", rec.Left,
		"keys_deleted", cln.KeysDeleted,
		"outbox_deleted", cln.OutboxDeleted,
		"inbox_deleted", cln.InboxDeleted,
		"delete_batches", cln.Batches,
		"cleanup_skipped", cln.Skipped,
		"outbox_pending", backlog.OutboxPending,
		"outbox_oldest_pending_age", backlog.OldestPendingAge,
		"duration_ms", time.Since(began).Milliseconds(),
	}
	if ctx.Err() != nil {
		r.log.Info(operation, append(attrs, "stopped", true)...)
		return nil
	}
	err := errors.Join(recErr, cleanErr, backlogErr)
	result := &roundResult{At: time.Now(), Duration: time.Since(began), DryRun: r.dryRun, Recovery: rec, Cleanup: cln}
	if err != nil {
		result.Error = err.Error()
	}
	r.mu.Lock()
	r.last = result
	r.mu.Unlock()
	if err != nil {
		r.log.Error(operation, append(attrs, "error", err.Error())...)
		return err
	}
	r.log.Info(operation, attrs...)
	return nil
}

// record adds a round's counts to the metrics. Every series is added to,
// zeros included, so that each exists from the first round on.
func (r *reaper) record(rec recovery.Report, cln cleanup.Report) {
	ctx := context.Background()
	r.recoveryMetrics.Resumed(ctx, rec.Resumed)
	r.recoveryMetrics.FailedStalled(ctx, recovery.ReasonUnknownWorkflow, rec.FailedUnknownWorkflow)
	r.recoveryMetrics.FailedStalled(ctx, recovery.ReasonMaxAttempts, rec.FailedMaxAttempts)
	r.recoveryMetrics.FailedStalled(ctx, recovery.ReasonMaxAge, rec.FailedMaxAge)
	r.cleanupMetrics.Deleted(ctx, cln.KeysDeleted, cln.OutboxDeleted)
	r.cleanupMetrics.Round(ctx, cln.Skipped)
}

// parseArgs parses the command line, with environment variables as the
// defaults of the settings. -help prints the usage to stdout.
func parseArgs(args []string, stdout io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("reaper", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	e := envDefaults{fs: fs}
	e.stringVar(&o.databaseURL, "database-url", "DATABASE_URL", "",
		"PostgreSQL connection URL (required)")
	e.durationVar(&o.ttl, "ttl", "REAPER_TTL", cleanup.TTLDefault,
		fmt.Sprintf("delete terminal idempotency keys finished longer ago than this (%v to %v)", cleanup.MinTTL, cleanup.MaxTTL))
	e.durationVar(&o.outboxRetention, "outbox-retention", "REAPER_OUTBOX_RETENTION", cleanup.OutboxRetentionDefault,
		"delete outbox messages published or dead-lettered longer ago than this")
	e.durationVar(&o.tombstoneRetention, "tombstone-retention", "REAPER_TOMBSTONE_RETENTION", cleanup.TombstoneRetentionDefault,
		"keep a tombstone of each deleted key this long: a request reusing the key meets it instead of running again")
	e.durationVar(&o.resumeDelay, "resume-delay", "REAPER_RESUME_DELAY", recovery.ResumeDelayDefault,
		"a running key with a free or expired lease is stalled this long after its last run")
	e.intVar(&o.maxAttempts, "max-attempts", "REAPER_MAX_ATTEMPTS", recovery.MaxAttemptsDefault,
		"fail stalled keys that have had this many attempts")
	e.durationVar(&o.maxAge, "max-age", "REAPER_MAX_AGE", txn.MaxAgeDefault,
		fmt.Sprintf("fail stalled keys created longer ago than this (under %v)", txn.MaxAgeLimit))
	e.durationVar(&o.unknownWorkflowDelay, "unknown-workflow-delay", "REAPER_UNKNOWN_WORKFLOW_DELAY", recovery.UnknownWorkflowDelayDefault,
		"fail stalled keys this binary cannot resume (every workflow) once they are this old")
	e.intVar(&o.batchSize, "batch-size", "REAPER_BATCH_SIZE", cleanup.BatchSizeDefault,
		fmt.Sprintf("most rows changed by one transaction (at most %d)", min(recovery.BatchSizeMax, cleanup.BatchSizeMax)))
	e.durationVar(&o.cleanupPause, "cleanup-pause", "REAPER_CLEANUP_PAUSE", cleanup.BatchPauseDefault,
		fmt.Sprintf("wait this long before each cleanup transaction after a round's first, to pace a large backlog (at most %v)", cleanup.BatchPauseMax))
	e.levelVar(&o.logLevel, "log-level", "REAPER_LOG_LEVEL", slog.LevelInfo,
		"log level: debug, info, warn or error")
	e.stringVar(&o.httpAddr, "http", "REAPER_HTTP", "",
		"with -interval, serve /metrics (Prometheus), /healthz and a status page on this address, e.g. :9090")
	fs.BoolVar(&o.once, "once", false, "run one round and exit (for cron)")
	fs.DurationVar(&o.interval, "interval", 0, "run a round every interval until SIGTERM or SIGINT (as a daemon)")
	fs.BoolVar(&o.dryRun, "dry-run", false, "report what a round would resume, fail and delete; change nothing")
	fs.Usage = func() {
		fmt.Fprint(stdout, usageText)
		fs.SetOutput(stdout)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}

	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return o, err
		}
		return o, fmt.Errorf("%w: %w", errUsage, err)
	}
	switch {
	case len(e.errs) > 0:
		return o, fmt.Errorf("%w: %w", errUsage, errors.Join(e.errs...))
	case fs.NArg() > 0:
		return o, fmt.Errorf("%w: unexpected argument %q", errUsage, fs.Arg(0))
	case o.once == (o.interval != 0):
		return o, fmt.Errorf("%w: give exactly one of -once and -interval", errUsage)
	case o.interval < 0:
		return o, fmt.Errorf("%w: -interval must be positive", errUsage)
	case o.databaseURL == "":
		return o, fmt.Errorf("%w: no database: set -database-url or DATABASE_URL", errUsage)
	case o.httpAddr != "" && o.once:
		return o, fmt.Errorf("%w: -http serves while the reaper runs: use it with -interval", errUsage)
	}
	return o, nil
}

const usageText = `Usage: reaper (-once | -interval D) [flags]

Resumes or fails stalled idempotency keys and deletes expired keys and
outbox messages. This generic binary has no workflows registered: it fails
stalled keys older than -unknown-workflow-delay and leaves younger ones to
the services that run their own recovery.Resumer.

With -interval and -http ADDR it also serves /metrics (Prometheus),
/healthz (database reachable, schema current) and a read-only status page
at / on ADDR.

Exit status: 0 ok (also when stopped by SIGTERM or SIGINT), 1 failure,
2 usage error.

Flags (environment variables give the defaults):
`

// envDefaults defines flags whose default comes from an environment
// variable when it is set, and collects the variables that do not parse.
type envDefaults struct {
	fs   *flag.FlagSet
	errs []error
}

func (e *envDefaults) lookup(env string) (string, bool) {
	v, ok := os.LookupEnv(env)
	return v, ok && v != ""
}

func (e *envDefaults) stringVar(p *string, name, env, def, usage string) {
	if v, ok := e.lookup(env); ok {
		def = v
	}
	e.fs.StringVar(p, name, def, usage+" ($"+env+")")
	if name == "database-url" && def != "" {
		// Never print a password in the usage text.
		e.fs.Lookup(name).DefValue = "$" + env
	}
}

func (e *envDefaults) durationVar(p *time.Duration, name, env string, def time.Duration, usage string) {
	if v, ok := e.lookup(env); ok {
		d, err := time.ParseDuration(v)
		if err != nil {
			e.errs = append(e.errs, fmt.Errorf("$%s: %w", env, err))
		} else {
			def = d
		}
	}
	e.fs.DurationVar(p, name, def, usage+" ($"+env+")")
}

func (e *envDefaults) intVar(p *int, name, env string, def int, usage string) {
	if v, ok := e.lookup(env); ok {
		n, err := strconv.Atoi(v)
		if err != nil {
			e.errs = append(e.errs, fmt.Errorf("$%s: %w", env, err))
		} else {
			def = n
		}
	}
	e.fs.IntVar(p, name, def, usage+" ($"+env+")")
}

func (e *envDefaults) levelVar(p *slog.Level, name, env string, def slog.Level, usage string) {
	if v, ok := e.lookup(env); ok {
		if err := def.UnmarshalText([]byte(v)); err != nil {
			e.errs = append(e.errs, fmt.Errorf("$%s: %w", env, err))
		}
	}
	*p = def
	e.fs.TextVar(p, name, def, usage+" ($"+env+")")
}
