package recovery

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/failure"
	"github.com/atomicphase/atomicphase/internal/service"
	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/internal/txnbridge"
	"github.com/atomicphase/atomicphase/txn"
)

// Failure reasons, stored in a failed key's failure_reason column and in the
// "reason" member of its problem response.
const (
	// ReasonUnknownWorkflow: no workflow registered under the key's name
	// (or a single-phase key, which cannot be resumed) and the key is older
	// than Config.UnknownWorkflowDelay.
	ReasonUnknownWorkflow = failure.ReasonUnknownWorkflow
	// ReasonMaxAttempts: the key was taken Config.MaxAttempts times without
	// reaching a terminal response.
	ReasonMaxAttempts = failure.ReasonMaxAttempts
	// ReasonMaxAge: the key is older than the runner's txn.Config.MaxAge.
	// The runner fails such a key too, when a client retry would take it over.
	ReasonMaxAge = failure.ReasonMaxAge
)

// FailureStatus is the HTTP status stored for a key that recovery fails.
const FailureStatus = failure.Status

// Report says what one round did.
type Report struct {
	// Resumed counts keys resumed to a stored terminal response.
	Resumed int
	// FailedUnknownWorkflow, FailedMaxAttempts and FailedMaxAge count keys
	// failed, by reason.
	FailedUnknownWorkflow, FailedMaxAttempts, FailedMaxAge int
	// Errors counts resumes that ended in an error: the workflow failed
	// transiently (the key is released at its last recovery point, with its
	// attempts incremented, and is resumed again after ResumeDelay) or lost
	// its lease.
	Errors int
	// Skipped counts claimed keys that a client retry took over or finished
	// before the resume could.
	Skipped int
	// Left counts the keys still stalled when the round ended: keys of
	// unregistered workflows younger than UnknownWorkflowDelay, and keys
	// that stalled during the round.
	Left int
}

// Failed is the number of keys failed, for every reason.
func (r Report) Failed() int {
	return r.FailedUnknownWorkflow + r.FailedMaxAttempts + r.FailedMaxAge
}

// Resumer resumes or fails stalled keys. It is safe for concurrent use, and
// several Resumers (in one process or many) may work on one database.
type Resumer struct {
	tracer     *telemetry.Tracer
	q          *db.Queries
	runner     *txn.Runner
	registered func() []string // the runner's registered workflows
	maxAge     time.Duration
	cfg        Config
	log        *slog.Logger

	bodies map[string][]byte

	life service.Lifecycle
}

// New returns a Resumer that resumes stalled keys with runner, the service's
// own: its pool, its registry of workflows (which may be empty, in a process
// without user code), its lease and its MaxAge, so that recovery and the
// request path follow the same settings. cfg may be nil. Invalid values give
// an error wrapping ErrInvalidConfig.
func New(runner *txn.Runner, cfg *Config) (*Resumer, error) {
	if runner == nil {
		return nil, fmt.Errorf("recovery: new: %w: runner is nil", ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	rc := txnbridge.Of(runner)
	c := cfg.withDefaults(rc.Logger)
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("recovery: new: %w", err)
	}
	r := &Resumer{
		tracer: telemetry.NewTracer(c.TracerProvider),
		q:      db.New(rc.Pool), runner: runner, registered: rc.Registered, maxAge: rc.MaxAge, cfg: c, log: c.Logger,
		bodies: map[string][]byte{
			ReasonUnknownWorkflow: failure.Body(ReasonUnknownWorkflow,
				"no handler that can complete it is available, so it was stopped after its last completed step"),
			ReasonMaxAttempts: failure.Body(ReasonMaxAttempts,
				fmt.Sprintf("it was attempted %d times without finishing, so it was stopped after its last completed step", c.MaxAttempts)),
			ReasonMaxAge: failure.MaxAgeBody(rc.MaxAge),
		},
	}
	return r, nil
}

// RunOnce runs one round: it fails the stalled keys that meet a failure rule,
// then claims and resumes the others in batches until a batch comes back
// short, and counts what is left. A resume that fails is counted in
// Report.Errors, not returned; the error is for the database failing, or ctx
// ending (then it wraps ctx's error, and the report holds what was done).
func (r *Resumer) RunOnce(ctx context.Context) (Report, error) {
	ctx, span := r.tracer.Start(ctx, telemetry.SpanRecovery, trace.SpanKindInternal)
	rep, err := r.runOnce(ctx)
	if span.IsRecording() {
		span.SetAttributes(attribute.Int("atomicphase.resumed", rep.Resumed),
			attribute.Int("atomicphase.failed", rep.FailedUnknownWorkflow+rep.FailedMaxAttempts+rep.FailedMaxAge))
		if err != nil && ctx.Err() == nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	}
	span.End()
	return rep, err
}

func (r *Resumer) runOnce(ctx context.Context) (Report, error) {
	var rep Report
	registered := append([]string{}, r.registered()...) // never NULL in SQL
	if err := r.failStalled(ctx, registered, &rep); err != nil {
		return rep, err
	}
	for {
		if err := ctx.Err(); err != nil {
			return rep, service.Wrap(ctx, "recovery", "claim stalled keys", err)
		}
		var rows []db.ClaimStalledKeysRow
		err := service.InBatch(ctx, func(ctx context.Context) (err error) {
			rows, err = r.q.ClaimStalledKeys(ctx, db.ClaimStalledKeysParams{
				ResumeDelaySeconds: r.cfg.ResumeDelay.Seconds(),
				Registered:         registered,
				MaxAttempts:        int32(r.cfg.MaxAttempts),
				MaxAgeSeconds:      r.maxAge.Seconds(),
				BatchSize:          int32(r.cfg.BatchSize),
			})
			return err
		})
		if err != nil {
			return rep, service.Wrap(ctx, "recovery", "claim stalled keys", err)
		}
		r.resumeAll(ctx, rows, &rep)
		if err := ctx.Err(); err != nil {
			return rep, fmt.Errorf("recovery: %w", err)
		}
		if len(rows) < r.cfg.BatchSize {
			break
		}
	}
	counts, err := r.count(ctx, registered)
	if err != nil {
		return rep, err
	}
	rep.Left = int(counts.UnknownWorkflow + counts.MaxAttempts + counts.MaxAge + counts.Resumable + counts.Waiting)
	return rep, nil
}

// DryRun reports what a round would do now, and changes nothing: Resumed
// counts the keys it would resume, the Failed fields the keys it would fail,
// and Left the stalled keys it would leave waiting.
func (r *Resumer) DryRun(ctx context.Context) (Report, error) {
	counts, err := r.count(ctx, append([]string{}, r.registered()...))
	if err != nil {
		return Report{}, err
	}
	return Report{
		Resumed:               int(counts.Resumable),
		FailedUnknownWorkflow: int(counts.UnknownWorkflow),
		FailedMaxAttempts:     int(counts.MaxAttempts),
		FailedMaxAge:          int(counts.MaxAge),
		Left:                  int(counts.Waiting),
	}, nil
}

func (r *Resumer) count(ctx context.Context, registered []string) (db.CountStalledKeysRow, error) {
	counts, err := r.q.CountStalledKeys(ctx, db.CountStalledKeysParams{
		Registered:                  registered,
		UnknownWorkflowDelaySeconds: r.cfg.UnknownWorkflowDelay.Seconds(),
		MaxAttempts:                 int32(r.cfg.MaxAttempts),
		MaxAgeSeconds:               r.maxAge.Seconds(),
		ResumeDelaySeconds:          r.cfg.ResumeDelay.Seconds(),
	})
	if err != nil {
		return counts, service.Wrap(ctx, "recovery", "count stalled keys", err)
	}
	return counts, nil
}

func (r *Resumer) failStalled(ctx context.Context, registered []string, rep *Report) error {
	for {
		if err := ctx.Err(); err != nil {
			return service.Wrap(ctx, "recovery", "fail stalled keys", err)
		}
		var rows []db.FailStalledKeysRow
		err := service.InBatch(ctx, func(ctx context.Context) (err error) {
			rows, err = r.q.FailStalledKeys(ctx, db.FailStalledKeysParams{
				ResponseStatus:              FailureStatus,
				ResponseHeaders:             failure.Header,
				UnknownWorkflowBody:         r.bodies[ReasonUnknownWorkflow],
				MaxAttemptsBody:             r.bodies[ReasonMaxAttempts],
				MaxAgeBody:                  r.bodies[ReasonMaxAge],
				Registered:                  registered,
				UnknownWorkflowDelaySeconds: r.cfg.UnknownWorkflowDelay.Seconds(),
				MaxAttempts:                 int32(r.cfg.MaxAttempts),
				ResumeDelaySeconds:          r.cfg.ResumeDelay.Seconds(),
				MaxAgeSeconds:               r.maxAge.Seconds(),
				BatchSize:                   int32(r.cfg.BatchSize),
			})
			return err
		})
		if err != nil {
			return service.Wrap(ctx, "recovery", "fail stalled keys", err)
		}
		for _, row := range rows {
			switch row.Reason {
			case ReasonUnknownWorkflow:
				rep.FailedUnknownWorkflow++
			case ReasonMaxAttempts:
				rep.FailedMaxAttempts++
			default:
				rep.FailedMaxAge++
			}
			r.log.WarnContext(ctx, "stalled key failed",
				"scope", row.Scope, "key", row.Key, "workflow", row.Workflow, "reason", row.Reason,
				"recovery_point", row.RecoveryPoint, "attempts", row.Attempts)
		}
		if len(rows) < r.cfg.BatchSize {
			return nil
		}
	}
}

// resumeAll resumes the claimed keys, Concurrency at a time.
func (r *Resumer) resumeAll(ctx context.Context, rows []db.ClaimStalledKeysRow, rep *Report) {
	var (
		mu  sync.Mutex
		wg  sync.WaitGroup
		sem = make(chan struct{}, r.cfg.Concurrency)
	)
	defer wg.Wait()
	for _, row := range rows {
		select {
		case <-ctx.Done():
			return
		case sem <- struct{}{}:
		}
		wg.Go(func() {
			defer func() { <-sem }()
			outcome := r.resume(ctx, row)
			mu.Lock()
			defer mu.Unlock()
			switch outcome {
			case resumed:
				rep.Resumed++
			case skipped:
				rep.Skipped++
			case failed:
				rep.Errors++
			case failedMaxAge:
				rep.FailedMaxAge++
			}
		})
	}
}

type outcome int

const (
	cancelled outcome = iota
	resumed
	skipped
	failed
	failedMaxAge
)

func (r *Resumer) resume(ctx context.Context, row db.ClaimStalledKeysRow) outcome {
	rctx, settled := txnbridge.WithOutcome(ctx)
	resp, err := r.runner.Resume(rctx, row.Scope, row.Key)
	switch {
	case err == nil && settled.FailedMaxAge:
		return failedMaxAge // it reached MaxAge since it was claimed; the runner logged it
	case err == nil && resp.Replayed:
		return skipped // a client retry finished it first
	case err == nil:
		r.log.InfoContext(ctx, "stalled key resumed",
			"scope", row.Scope, "key", row.Key, "workflow", row.Workflow, "response_status", resp.Status)
		return resumed
	case errors.Is(err, txn.ErrKeyInUse), errors.Is(err, txn.ErrKeyNotFound):
		r.log.DebugContext(ctx, "stalled key taken by another attempt",
			"scope", row.Scope, "key", row.Key, "workflow", row.Workflow)
		return skipped
	case ctx.Err() != nil:
		return cancelled // released by txn; resumed by a later round
	default:
		// The runner logged the failure (one WARN); the round counts it.
		r.log.DebugContext(ctx, "resume failed; key left resumable",
			"scope", row.Scope, "key", row.Key, "workflow", row.Workflow, "error", err)
		return failed
	}
}

// Start runs a round at once and then every Config.Interval, in a goroutine,
// until ctx ends or Stop is called. Each round's outcome is logged; a
// round's error does not stop the loop. Start on a running Resumer returns
// ErrAlreadyStarted; one whose ctx ended may be started again.
func (r *Resumer) Start(ctx context.Context) error {
	if err := r.life.Start(ctx, nil, service.Every(r.cfg.Interval, r.round)); err != nil {
		return fmt.Errorf("recovery: start: %w", err)
	}
	return nil
}

// Stop ends the loop Start began, abandoning the round in progress (a resume
// in flight is cancelled and its key released at its last recovery point),
// and returns when the loop has ended. It does nothing if not started.
func (r *Resumer) Stop() { r.life.Stop() }

// round runs one round for the Start loop and logs its outcome; an error
// does not stop the loop.
func (r *Resumer) round(ctx context.Context) {
	rep, err := r.RunOnce(ctx)
	switch {
	case err != nil && ctx.Err() != nil:
		return // stopped
	case err != nil:
		r.log.ErrorContext(ctx, "recovery round failed", "error", err)
	default:
		level := slog.LevelInfo
		if rep == (Report{}) {
			level = slog.LevelDebug
		}
		r.log.Log(ctx, level, "recovery round",
			"resumed", rep.Resumed, "failed_unknown_workflow", rep.FailedUnknownWorkflow,
			"failed_max_attempts", rep.FailedMaxAttempts, "failed_max_age", rep.FailedMaxAge,
			"errors", rep.Errors, "skipped", rep.Skipped, "left", rep.Left)
	}
}
