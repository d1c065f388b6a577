package txn

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/backoff"
	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/failure"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/internal/txnbridge"
	"github.com/atomicphase/atomicphase/internal/txnhook"
	"github.com/atomicphase/atomicphase/internal/usercode"
)

// Stats counts what a Runner did since it was created. A high Replayed or
// InUse rate is the first sign of unreliable clients or networks.
type Stats struct {
	Executed  uint64 // operations run to a stored terminal response by this runner
	Replayed  uint64 // stored responses returned without running anything
	InUse     uint64 // calls answered ErrKeyInUse
	Waited    uint64 // calls that waited for another attempt's key (Config.WaitWhenInUse), once per call
	Reused    uint64 // calls answered ErrKeyReused
	Conflicts uint64 // phases abandoned with ErrConflict after retries
	Retries   uint64 // phase retries after serialization failures or deadlocks
	LeaseLost uint64 // attempts that lost their lease (ErrLeaseLost)
	Released  uint64 // keys released after a transient error, resumable
	NotStored uint64 // rejections returned unstored (Config.Store), no key left
	TooOld    uint64 // keys failed instead of taken over: older than Config.MaxAge
	// ExpiredRejected counts requests answered ErrKeyExpired; ExpiredReused
	// those run as new operations under ExpiredKeyNewOperation.
	ExpiredRejected, ExpiredReused uint64
}

// Runner runs operations under idempotency keys. It is safe for concurrent use.
type Runner struct {
	pool *pgxpool.Pool
	q    *db.Queries
	cfg  Config
	log  *slog.Logger

	executed, replayed, inUse, waited, reused, conflicts, retries, leaseLost, released, notStored, tooOld atomic.Uint64
	expiredRejected, expiredReused                                                                        atomic.Uint64

	maxAgeBody []byte            // the problem body stored for a key failed past MaxAge
	retry      backoff.Policy    // the wait before a phase's retry
	hook       txnhook.Func      // the test kit's, else nil (see hook.go)
	execMode   pgx.QueryExecMode // the pool's default exec mode
	modeByConn bool              // the pool's BeforeConnect may set each connection's mode

	tel    *telemetry.Txn
	tracer *telemetry.Tracer
	scopes telemetry.ScopeHasher
}

// New returns a Runner using pool. cfg may be nil. Invalid values give an
// error wrapping ErrInvalidConfig.
func New(pool *pgxpool.Pool, cfg *Config) (*Runner, error) {
	if pool == nil {
		return nil, fmt.Errorf("txn: new: %w: pool is nil", ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("txn: new: %w", err)
	}
	pcfg := pool.Config()
	return &Runner{
		pool: pool, q: db.New(pool), cfg: c, log: c.Logger, maxAgeBody: failure.MaxAgeBody(c.MaxAge),
		retry: backoff.Policy{Base: c.RetryBaseDelay, Max: c.RetryMaxDelay, Jitter: backoff.Equal},
		tel:   telemetry.NewTxn(c.MeterProvider), tracer: telemetry.NewTracer(c.TracerProvider),
		scopes:   telemetry.NewScopeHasher(c.ScopeHashKey),
		execMode: pcfg.ConnConfig.DefaultQueryExecMode, modeByConn: pcfg.BeforeConnect != nil,
	}, nil
}

// connExecMode returns conn's default exec mode: the pool's, unless the
// pool's BeforeConnect may have set another for this connection (reading
// it copies the connection's config, so only then is it read).
func (r *Runner) connExecMode(conn *pgx.Conn) pgx.QueryExecMode {
	if r.modeByConn {
		return conn.Config().DefaultQueryExecMode
	}
	return r.execMode
}

// The module's packages built on txn (recovery, httpidem) reach the
// runner's pool and settings through txnbridge, not through the public API.
func init() {
	txnbridge.Register(func(r *Runner) txnbridge.Runner {
		return txnbridge.Runner{
			Pool: r.pool, Logger: r.log, MaxAge: r.cfg.MaxAge, Registered: r.cfg.Workflows.Names, Store: r.cfg.Store,
		}
	})
}

// Stats returns the runner's counters.
func (r *Runner) Stats() Stats {
	return Stats{
		Executed:  r.executed.Load(),
		Replayed:  r.replayed.Load(),
		InUse:     r.inUse.Load(),
		Waited:    r.waited.Load(),
		Reused:    r.reused.Load(),
		Conflicts: r.conflicts.Load(),
		Retries:   r.retries.Load(),
		LeaseLost: r.leaseLost.Load(),
		Released:  r.released.Load(),
		NotStored: r.notStored.Load(),
		TooOld:    r.tooOld.Load(),

		ExpiredRejected: r.expiredRejected.Load(),
		ExpiredReused:   r.expiredReused.Load(),
	}
}

// KeyStatus is the status of a stored idempotency key.
type KeyStatus string

// Key statuses, as stored.
const (
	// KeyRunning: an attempt is working on the key, or one stopped before
	// its operation reached a terminal response (then a retry or the
	// recovery Resumer resumes it).
	KeyRunning KeyStatus = "running"
	// KeyFinished: the operation's terminal response is stored.
	KeyFinished KeyStatus = "finished"
	// KeyFailed: atomicphase stopped the operation (see package recovery,
	// and Config.MaxAge) and stored a problem response in its place.
	KeyFailed KeyStatus = "failed"
)

// RecoveryPointStarted is the recovery point of a key before any of its
// phases committed.
const RecoveryPointStarted = "started"

// Key statuses and reserved recovery points, as the queries compare them.
const (
	statusRunning = string(KeyRunning)
	pointStarted  = RecoveryPointStarted
	pointFinished = "finished"
)

// errWait tells a loop to look at the key again after waiting for its holder.
var errWait = errors.New("waited for holder")

// existing decides what to do with a key that is already stored: replay it,
// reject the call, or (for workflow keys, via the caller) resume it.
func (r *Runner) existing(ctx context.Context, req request, workflow string, row db.LookupKeyRow) (Response, error) {
	if string(row.Fingerprint) != string(req.fingerprint) || row.Workflow.String != workflow {
		r.reused.Add(1)
		r.log.Log(ctx, r.cfg.HitLogLevel, "idempotency key reused for a different request",
			"scope", req.key.Scope, "key", req.key.Value, "status", row.Status.String)
		return Response{}, &KeyStateError{Err: ErrKeyReused, Status: KeyStatus(row.Status.String), RecoveryPoint: row.RecoveryPoint.String}
	}
	if row.Status.String != statusRunning {
		return r.replay(ctx, req, row.Status.String, row.ResponseStatus.Int32, row.ResponseHeaders, row.ResponseBody)
	}
	if row.LeaseLive || workflow == "" {
		return Response{}, r.heldByOther(ctx, req, row.Status.String, row.RecoveryPoint.String, row.LeaseRemainingSeconds)
	}
	return Response{}, errResumable
}

// errResumable tells RunWorkflow the key is running with a free or expired lease.
var errResumable = errors.New("key resumable")

func (r *Runner) replay(ctx context.Context, req request, status string, code int32, header, body []byte) (Response, error) {
	resp, err := storedResponse(code, header, body)
	if err != nil {
		return Response{}, err
	}
	r.replayed.Add(1)
	r.log.Log(ctx, r.cfg.HitLogLevel, "idempotency key replayed",
		"scope", req.key.Scope, "key", req.key.Value, "status", status, "response_status", code)
	return resp, nil
}

// heldByOther answers ErrKeyInUse, or waits (Config.WaitWhenInUse) and
// returns errWait so the caller looks again.
func (r *Runner) heldByOther(ctx context.Context, req request, status, point string, remaining float64) error {
	if r.cfg.WaitWhenInUse {
		if err := sleep(ctx, r.cfg.WaitPollInterval); err != nil {
			return fmt.Errorf("wait for key holder: %w", err)
		}
		return errWait
	}
	return r.inUseError(ctx, req, status, point, remaining)
}

// noteWait counts and logs, once per call, that the call waits for the
// key's holder; already says whether it did so before. It returns true.
func (r *Runner) noteWait(ctx context.Context, req request, workflow string, already bool) bool {
	if !already {
		r.waited.Add(1)
		r.log.Log(ctx, r.cfg.HitLogLevel, "idempotency key in use; waiting for its holder",
			"scope", req.key.Scope, "key", req.key.Value, "workflow", workflow)
	}
	return true
}

func (r *Runner) inUseError(ctx context.Context, req request, status, point string, remaining float64) error {
	r.inUse.Add(1)
	retry := max(time.Duration(remaining*float64(time.Second)).Round(time.Second), time.Second)
	r.log.Log(ctx, r.cfg.HitLogLevel, "idempotency key in use",
		"scope", req.key.Scope, "key", req.key.Value, "recovery_point", point, "retry_after", retry)
	return &KeyStateError{Err: ErrKeyInUse, Status: KeyStatus(status), RecoveryPoint: point, RetryAfter: retry}
}

// inFlight handles a key whose insert is uncommitted in another transaction.
func (r *Runner) inFlight(ctx context.Context, req request) error {
	err := r.heldByOther(ctx, req, statusRunning, pointStarted, 0)
	if errors.Is(err, errWait) {
		return nil
	}
	return err
}

// logFailure logs an operation's failure once, at the level its kind
// deserves: hits (in use, reuse) were logged where they were found, bad
// input and a caller's cancellation are the caller's to report, and every
// other failure is one WARN. releaseErr is the error of releasing the key
// afterwards, if that failed too.
func (r *Runner) logFailure(ctx context.Context, req request, workflow string, err, releaseErr error) {
	switch {
	case err == nil, errors.Is(err, context.Canceled),
		errors.Is(err, ErrKeyInUse), errors.Is(err, ErrKeyReused), errors.Is(err, ErrKeyExpired),
		errors.Is(err, ErrInvalidKey), errors.Is(err, ErrInvalidRequest), errors.Is(err, ErrRequestTooLarge):
		return
	}
	msg := "operation failed; the key keeps its last recovery point and a retry resumes it"
	switch {
	case errors.Is(err, ErrLeaseLost):
		msg = "lease lost; another attempt holds the key"
	case errors.Is(err, ErrConflict):
		msg = "serialization conflict persisted after retries; the key keeps its last recovery point"
	case workflow == "":
		msg = "operation failed; nothing was stored and a retry runs it again"
	}
	attrs := []any{"scope", req.key.Scope, "key", req.key.Value, "workflow", workflow, "error", err}
	if releaseErr != nil {
		attrs = append(attrs, "release_error", releaseErr, "lease", r.cfg.LeaseDuration)
	}
	r.log.WarnContext(ctx, msg, attrs...)
}

// logNotStored notes a rejection returned without storing it.
func (r *Runner) logNotStored(ctx context.Context, req request, workflow string, status int) {
	r.notStored.Add(1)
	r.log.DebugContext(ctx, "response not stored: a rejection the client may correct and retry with the same key",
		"scope", req.key.Scope, "key", req.key.Value, "workflow", workflow, "response_status", status)
}

// retryTx runs once, a whole transaction, again after serialization failures
// and deadlocks, with jittered exponential backoff, up to Config.MaxRetries
// times (then ErrConflict).
func (r *Runner) retryTx(ctx context.Context, once func() error) error {
	for tries := 0; ; tries++ {
		err := once()
		if err == nil || !pgerr.IsRetryable(err) {
			return err
		}
		if tries >= r.cfg.MaxRetries {
			r.conflicts.Add(1)
			return fmt.Errorf("%w: %w", ErrConflict, err)
		}
		r.retries.Add(1)
		r.tel.Retried(ctx, workflowOf(ctx))
		noteRetry(ctx)
		if err := r.backoff(ctx, tries); err != nil {
			return err
		}
	}
}

// rollback ends tx on a context detached from the caller's, which may be done.
func (r *Runner) rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// backoff waits before retry try of a phase (0 for the first), or until ctx ends.
func (r *Runner) backoff(ctx context.Context, try int) error {
	return sleep(ctx, r.retry.Delay(try))
}

func sleep(ctx context.Context, d time.Duration) error { return backoff.Sleep(ctx, d) }

// guard runs fn, which calls user code, turning a panic into a *PanicError
// so that the phase rolls back and the key is released as after any other
// transient error.
func guard[T any](fn func() (T, error)) (T, error) {
	return usercode.Call(fn, func(value any, stack []byte) error {
		return &PanicError{Value: value, Stack: stack}
	})
}

func int4(v int) pgtype.Int4 { return pgtype.Int4{Int32: int32(v), Valid: true} }
