package txn

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/backoff"
	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/failure"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/txnbridge"
)

// Config configures a Runner. The zero value is usable; every field states its default.
type Config struct {
	// Workflows is the registry RunWorkflow and Resume take workflows from.
	// Default: an empty registry, so RunWorkflow fails with ErrUnknownWorkflow.
	Workflows *Registry

	// Logger receives replays, key conflicts and mismatches, and keys released
	// after transient errors. Default: slog.Default().
	Logger *slog.Logger

	// HitLogLevel is the level at which replays, in-use conflicts and key
	// reuse are logged. Default: slog.LevelInfo (the zero value).
	HitLogLevel slog.Level

	// LeaseDuration is how long an attempt holds a workflow key before
	// another attempt may take it over; each committed phase extends it.
	// Make it longer than the slowest phase, foreign calls included.
	// Default: 90 seconds.
	LeaseDuration time.Duration

	// MaxRetries is how many times a phase is retried after a serialization
	// failure (40001) or a deadlock (40P01) before ErrConflict. Default: 8.
	MaxRetries int

	// RetryBaseDelay is the first retry's backoff; each retry doubles it, up
	// to RetryMaxDelay, with equal jitter: the wait is drawn uniformly
	// between half the backoff and all of it. Default: 2 milliseconds.
	RetryBaseDelay time.Duration

	// RetryMaxDelay caps the retry backoff. Default: 250 milliseconds.
	RetryMaxDelay time.Duration

	// MaxParamsBytes is the largest Key.Params accepted. Default: 1 MiB.
	MaxParamsBytes int

	// WaitWhenInUse makes a call that finds the key held by another live
	// attempt wait for it (bounded by ctx) instead of failing at once with
	// ErrKeyInUse; it then replays the stored response, or takes the key over
	// if the holder's lease expires. Default: false.
	WaitWhenInUse bool

	// WaitPollInterval is how often a waiting call looks at the key again.
	// Default: 50 milliseconds.
	WaitPollInterval time.Duration

	// ReleaseTimeout bounds releasing a key after a transient error, or
	// removing one whose insert may have committed unseen. The release runs
	// on a context detached from the caller's, so a cancelled request still
	// releases its key. Default: 5 seconds.
	ReleaseTimeout time.Duration

	// MaxAge bounds how long after a key was created (by the database
	// clock) its operation may still be resumed. No attempt takes over a
	// key older than this, whether a client retry, a WaitWhenInUse takeover
	// or a Resume (the recovery Resumer's too), and no Foreign phase calls
	// out for one: the statement that would have taken the key over, or
	// extended its lease before the call, fails it instead, storing a 500
	// application/problem+json response with failure reason "max_age" that
	// every later retry replays. So a foreign call is never repeated more
	// than MaxAge after the key was created; keep it under MaxAgeLimit, the
	// window payment providers keep their idempotency keys for.
	// Default: MaxAgeDefault (12 hours).
	MaxAge time.Duration

	// Store decides, by status, whether a response returned before anything
	// took effect is the operation's terminal result (stored, replayed to
	// every retry) or a rejection the client is expected to correct (the
	// function's writes rolled back, no key left, the response returned
	// unstored, so the corrected request can retry with the same key). It
	// applies to a single-phase Run and to a workflow that answers before
	// any phase committed and before any foreign call; once something took
	// effect, every response is stored. httpidem follows it too.
	// Default: DefaultStore.
	Store func(status int) bool
}

// MaxAgeDefault is Config.MaxAge's default.
const MaxAgeDefault = 12 * time.Hour

// MaxAgeLimit bounds Config.MaxAge: payment providers keep idempotency keys
// for about 24 hours (Stripe: at least 24), so an operation must never call
// one again after that.
const MaxAgeLimit = 24 * time.Hour

// DefaultStore stores every response except the rejections a client is
// expected to correct and retry with the same key: 400, 401, 403, 404, 405,
// 409, 413, 415, 422 and 429. Successes, 402 (e.g. card declined) and the
// 5xx an operation chooses to return are stored and replayed.
func DefaultStore(status int) bool {
	switch status {
	case 400, 401, 403, 404, 405, 409, 413, 415, 422, 429:
		return false
	}
	return true
}

// Stats counts what a Runner did since it was created. A high Replayed or
// InUse rate is the first sign of unreliable clients or networks.
type Stats struct {
	Executed  uint64 // operations run to a stored terminal response by this runner
	Replayed  uint64 // stored responses returned without running anything
	InUse     uint64 // calls answered ErrKeyInUse
	Reused    uint64 // calls answered ErrKeyReused
	Conflicts uint64 // phases abandoned with ErrConflict after retries
	Retries   uint64 // phase retries after serialization failures or deadlocks
	LeaseLost uint64 // attempts that lost their lease (ErrLeaseLost)
	Released  uint64 // keys released after a transient error, resumable
	NotStored uint64 // rejections returned unstored (Config.Store), no key left
	TooOld    uint64 // keys failed instead of taken over: older than Config.MaxAge
}

// Runner runs operations under idempotency keys. It is safe for concurrent use.
type Runner struct {
	pool *pgxpool.Pool
	q    *db.Queries
	cfg  Config
	log  *slog.Logger

	executed, replayed, inUse, reused, conflicts, retries, leaseLost, released, notStored, tooOld atomic.Uint64

	maxAgeBody []byte         // the problem body stored for a key failed past MaxAge
	retry      backoff.Policy // the wait before a phase's retry
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
	c := *cfg
	if c.LeaseDuration < 0 || c.MaxRetries < 0 || c.RetryBaseDelay < 0 || c.RetryMaxDelay < 0 ||
		c.MaxParamsBytes < 0 || c.WaitPollInterval < 0 || c.ReleaseTimeout < 0 || c.MaxAge < 0 {
		return nil, fmt.Errorf("txn: new: %w: negative durations and counts are not allowed", ErrInvalidConfig)
	}
	if c.LeaseDuration != 0 && c.LeaseDuration < 10*time.Millisecond {
		return nil, fmt.Errorf("txn: new: %w: LeaseDuration %v is shorter than 10ms", ErrInvalidConfig, c.LeaseDuration)
	}
	if c.MaxAge >= MaxAgeLimit {
		return nil, fmt.Errorf("txn: new: %w: MaxAge %v must be shorter than %v, the payment providers' idempotency window",
			ErrInvalidConfig, c.MaxAge, MaxAgeLimit)
	}
	c.Workflows = cmp.Or(c.Workflows, NewRegistry())
	c.Logger = cmp.Or(c.Logger, slog.Default())
	c.LeaseDuration = cmp.Or(c.LeaseDuration, 90*time.Second)
	c.MaxRetries = cmp.Or(c.MaxRetries, 8)
	c.RetryBaseDelay = cmp.Or(c.RetryBaseDelay, 2*time.Millisecond)
	c.RetryMaxDelay = cmp.Or(c.RetryMaxDelay, 250*time.Millisecond)
	c.MaxParamsBytes = cmp.Or(c.MaxParamsBytes, 1<<20)
	c.WaitPollInterval = cmp.Or(c.WaitPollInterval, 50*time.Millisecond)
	c.ReleaseTimeout = cmp.Or(c.ReleaseTimeout, 5*time.Second)
	c.MaxAge = cmp.Or(c.MaxAge, MaxAgeDefault)
	if c.Store == nil {
		c.Store = DefaultStore
	}
	return &Runner{
		pool: pool, q: db.New(pool), cfg: c, log: c.Logger, maxAgeBody: failure.MaxAgeBody(c.MaxAge),
		retry: backoff.Policy{Base: c.RetryBaseDelay, Max: c.RetryMaxDelay, Jitter: backoff.Equal},
	}, nil
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
		Reused:    r.reused.Load(),
		Conflicts: r.conflicts.Load(),
		Retries:   r.retries.Load(),
		LeaseLost: r.leaseLost.Load(),
		Released:  r.released.Load(),
		NotStored: r.notStored.Load(),
		TooOld:    r.tooOld.Load(),
	}
}

// Key statuses and reserved recovery points, as stored.
const (
	statusRunning = "running"
	pointStarted  = "started"
	pointFinished = "finished"
)

// errWait tells a loop to look at the key again after waiting for its holder.
var errWait = errors.New("waited for holder")

// existing decides what to do with a key that is already stored: replay it,
// reject the call, or (for workflow keys, via the caller) resume it.
func (r *Runner) existing(ctx context.Context, req request, workflow string, row db.LookupKeyRow) (Response, error) {
	if string(row.Fingerprint) != string(req.fingerprint) || row.Workflow != workflow {
		r.reused.Add(1)
		r.log.Log(ctx, r.cfg.HitLogLevel, "idempotency key reused for a different request",
			"scope", req.key.Scope, "key", req.key.Value, "status", row.Status)
		return Response{}, &KeyStateError{Err: ErrKeyReused, Status: row.Status, RecoveryPoint: row.RecoveryPoint}
	}
	if row.Status != statusRunning {
		return r.replay(ctx, req, row.Status, row.ResponseStatus.Int32, row.ResponseHeaders, row.ResponseBody)
	}
	if row.LeaseLive || workflow == "" {
		return Response{}, r.heldByOther(ctx, req, row.Status, row.RecoveryPoint, row.LeaseRemainingSeconds)
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

func (r *Runner) inUseError(ctx context.Context, req request, status, point string, remaining float64) error {
	r.inUse.Add(1)
	retry := max(time.Duration(remaining*float64(time.Second)).Round(time.Second), time.Second)
	r.log.Log(ctx, r.cfg.HitLogLevel, "idempotency key in use",
		"scope", req.key.Scope, "key", req.key.Value, "recovery_point", point, "retry_after", retry)
	return &KeyStateError{Err: ErrKeyInUse, Status: status, RecoveryPoint: point, RetryAfter: retry}
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
		errors.Is(err, ErrKeyInUse), errors.Is(err, ErrKeyReused),
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

// inTx runs fn in a SERIALIZABLE transaction, retrying the whole transaction
// on serialization failures and deadlocks with jittered exponential backoff.
func (r *Runner) inTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	for tries := 0; ; tries++ {
		err := r.txOnce(ctx, fn)
		if err == nil || !pgerr.IsRetryable(err) {
			return err
		}
		if tries >= r.cfg.MaxRetries {
			r.conflicts.Add(1)
			return fmt.Errorf("%w: %w", ErrConflict, err)
		}
		r.retries.Add(1)
		if err := r.backoff(ctx, tries); err != nil {
			return err
		}
	}
}

func (r *Runner) txOnce(ctx context.Context, fn func(tx pgx.Tx) error) (err error) {
	tx, err := r.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			r.rollback(ctx, tx)
		}
	}()
	if err := fn(tx); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
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

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// guard runs fn, which calls user code, turning a panic into a *PanicError
// so that the phase rolls back and the key is released as after any other
// transient error.
func guard[T any](fn func() (T, error)) (v T, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return fn()
}

func int4(v int) pgtype.Int4 { return pgtype.Int4{Int32: int32(v), Valid: true} }
