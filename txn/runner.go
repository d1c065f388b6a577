package txn

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/phasectx"
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
	// to RetryMaxDelay, with full jitter. Default: 2 milliseconds.
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

	// ReleaseTimeout bounds releasing a key after a transient error. The
	// release runs on a context detached from the caller's, so a cancelled
	// request still releases its key. Default: 5 seconds.
	ReleaseTimeout time.Duration
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
}

// Runner runs operations under idempotency keys. It is safe for concurrent use.
type Runner struct {
	pool *pgxpool.Pool
	q    *db.Queries
	cfg  Config
	log  *slog.Logger

	executed, replayed, inUse, reused, conflicts, retries, leaseLost, released atomic.Uint64
}

// New returns a Runner using pool. cfg may be nil.
func New(pool *pgxpool.Pool, cfg *Config) (*Runner, error) {
	if pool == nil {
		return nil, fmt.Errorf("txn: new: %w: pool is nil", ErrInvalidUse)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	c := *cfg
	if c.LeaseDuration < 0 || c.MaxRetries < 0 || c.RetryBaseDelay < 0 || c.RetryMaxDelay < 0 ||
		c.MaxParamsBytes < 0 || c.WaitPollInterval < 0 || c.ReleaseTimeout < 0 {
		return nil, fmt.Errorf("txn: new: %w: negative durations and counts are not allowed", ErrInvalidUse)
	}
	if c.LeaseDuration != 0 && c.LeaseDuration < 10*time.Millisecond {
		return nil, fmt.Errorf("txn: new: %w: LeaseDuration %v is shorter than 10ms", ErrInvalidUse, c.LeaseDuration)
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
	return &Runner{pool: pool, q: db.New(pool), cfg: c, log: c.Logger}, nil
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
	}
}

// Func is the body of a single-phase operation: it writes through tx and
// returns the terminal response, or an error to roll everything back.
type Func func(ctx context.Context, tx pgx.Tx) (Response, error)

// Run runs fn exactly once for key. The key row, fn's writes and the stored
// response commit together in one SERIALIZABLE transaction, so a single-phase
// Run costs one commit, like the bare business transaction.
//
// A retry of a finished key returns the stored response (Replayed set) with
// one read and runs nothing. A key held by a concurrent attempt gives
// ErrKeyInUse (unless Config.WaitWhenInUse), a key stored for a different
// request ErrKeyReused. If fn returns an error, nothing is stored and the
// error is returned: a retry runs fn again. Serialization failures and
// deadlocks are retried up to Config.MaxRetries, then ErrConflict.
func (r *Runner) Run(ctx context.Context, key Key, fn Func) (Response, error) {
	if fn == nil {
		return Response{}, fmt.Errorf("txn: run: %w: nil func", ErrInvalidUse)
	}
	req, err := prepare(key, r.cfg.MaxParamsBytes)
	if err != nil {
		return Response{}, fmt.Errorf("txn: run: %w", err)
	}
	tries := 0
	raced := false // the last insert lost to a concurrent attempt
	for {
		if err := ctx.Err(); err != nil {
			return Response{}, fmt.Errorf("txn: run: %w", err)
		}
		row, err := r.q.LookupKey(ctx, db.LookupKeyParams{Scope: key.Scope, Key: key.Value})
		switch {
		case err == nil:
			resp, err := r.existing(ctx, req, "", row)
			if errors.Is(err, errWait) {
				continue
			}
			return resp, err
		case !errors.Is(err, pgx.ErrNoRows):
			return Response{}, fmt.Errorf("txn: run: look up key: %w", err)
		}
		if raced {
			// Lost the insert, yet no committed row: the other attempt's
			// transaction is still open.
			raced = false
			if err := r.inFlight(ctx, req); err != nil {
				return Response{}, err
			}
			continue
		}

		resp, err := r.runSingle(ctx, req, fn)
		switch {
		case err == nil:
			r.executed.Add(1)
			return resp, nil
		case errors.Is(err, errRaced):
			// Another attempt inserted the key after our lookup: committed
			// (the next lookup sees it) or still in flight.
			raced = true
			continue
		case pgerr.IsRetryable(err):
			if tries >= r.cfg.MaxRetries {
				r.conflicts.Add(1)
				r.log.WarnContext(ctx, "serialization conflict persisted", "scope", key.Scope, "key", key.Value, "retries", tries, "error", err)
				return Response{}, fmt.Errorf("txn: run: %w: %w", ErrConflict, err)
			}
			r.retries.Add(1)
			if err := r.backoff(ctx, tries); err != nil {
				return Response{}, fmt.Errorf("txn: run: %w", err)
			}
			tries++
			continue
		default:
			r.logTransient(ctx, req, "", err)
			return Response{}, fmt.Errorf("txn: run: %w", err)
		}
	}
}

// errRaced reports that the key appeared (or is being inserted) between our
// lookup and our insert; the caller looks again.
var errRaced = errors.New("txn: key inserted concurrently")

// errWait tells a loop to look at the key again after waiting for its holder.
var errWait = errors.New("txn: waited for holder")

func (r *Runner) runSingle(ctx context.Context, req request, fn Func) (resp Response, err error) {
	// The connection is acquired explicitly so that the last statement and
	// COMMIT can go out in one round trip (see commitWith).
	conn, err := r.pool.Acquire(ctx)
	if err != nil {
		return Response{}, fmt.Errorf("acquire: %w", err)
	}
	defer conn.Release()
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	if err != nil {
		return Response{}, fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			r.rollback(ctx, tx)
		}
	}()
	q := r.q.WithTx(tx)
	ins, err := q.InsertSingleKey(ctx, db.InsertSingleKeyParams{
		Scope: req.key.Scope, Key: req.key.Value, Fingerprint: req.fingerprint,
		RequestMethod: req.key.Method, RequestPath: req.key.Path, RequestParams: req.params,
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return Response{}, errRaced // held by an uncommitted attempt, or committed since our lookup
	}
	if err != nil {
		return Response{}, fmt.Errorf("insert key: %w", err)
	}
	resp, err = callPhase(phasectx.WithKeyID(ctx, ins.ID), tx, fn)
	if err != nil {
		return Response{}, err
	}
	if err := resp.validate(); err != nil {
		return Response{}, err
	}
	header, err := resp.encodedHeader()
	if err != nil {
		return Response{}, err
	}
	// By ctid: a TID scan takes no predicate lock on shared index pages.
	err = commitWith(ctx, tx, func(q *db.Queries) error {
		return q.FinishSingleKey(ctx, db.FinishSingleKeyParams{
			Tid: ins.Ctid, ID: ins.ID,
			ResponseStatus: int4(resp.Status), ResponseHeaders: header, ResponseBody: resp.Body,
		})
	})
	if err != nil {
		return Response{}, err
	}
	resp.Replayed = false
	return resp, nil
}

// commitWith sends the statement queue issues, then COMMIT, in one round
// trip. The statement must fail (not match nothing) when its precondition
// does not hold, since the COMMIT is already on its way: an error aborts the
// transaction and turns the COMMIT into a no-op. tx must run on a connection
// the caller acquired (not a pool transaction, which would wait for its own
// Commit to release the connection); on success tx is committed and must not
// be used again.
func commitWith(ctx context.Context, tx pgx.Tx, queue func(q *db.Queries) error) error {
	b := &pgx.Batch{}
	if err := queue(db.New(batchQueue{b})); err != nil {
		return err
	}
	b.Queue("commit")
	br := tx.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		if pgerr.Code(err) == pgerr.DivisionByZero {
			return fmt.Errorf("store response: the key row changed under the run (was it written by the function?): %w", err)
		}
		return fmt.Errorf("store response: %w", err)
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	if tag.String() == "ROLLBACK" {
		return fmt.Errorf("commit: %w", pgx.ErrTxCommitRollback)
	}
	return nil
}

// batchQueue is a db.DBTX that queues statements in a batch instead of
// running them, so generated queries can be pipelined.
type batchQueue struct{ b *pgx.Batch }

func (q batchQueue) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	q.b.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

func (q batchQueue) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	q.b.Queue(sql, args...)
	return nil, errors.New("txn: a queued query has no rows yet")
}

func (q batchQueue) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	q.b.Queue(sql, args...)
	return queuedRow{}
}

type queuedRow struct{}

func (queuedRow) Scan(...any) error { return nil }

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
var errResumable = errors.New("txn: key resumable")

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
			return fmt.Errorf("txn: wait for key holder: %w", err)
		}
		return errWait
	}
	return r.inUseError(ctx, req, status, point, remaining)
}

func (r *Runner) inUseError(ctx context.Context, req request, status, point string, remaining float64) error {
	r.inUse.Add(1)
	r.log.Log(ctx, r.cfg.HitLogLevel, "idempotency key in use",
		"scope", req.key.Scope, "key", req.key.Value, "recovery_point", point)
	retry := time.Duration(remaining * float64(time.Second)).Round(time.Second)
	return &KeyStateError{Err: ErrKeyInUse, Status: status, RecoveryPoint: point, RetryAfter: max(retry, time.Second)}
}

// inFlight handles a key whose insert is uncommitted in another transaction.
func (r *Runner) inFlight(ctx context.Context, req request) error {
	err := r.heldByOther(ctx, req, statusRunning, pointStarted, 0)
	if errors.Is(err, errWait) {
		return nil
	}
	return err
}

func (r *Runner) logTransient(ctx context.Context, req request, workflow string, err error) {
	if errors.Is(err, context.Canceled) {
		return
	}
	r.log.WarnContext(ctx, "operation failed; nothing committed for its current phase",
		"scope", req.key.Scope, "key", req.key.Value, "workflow", workflow, "error", err)
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

func (r *Runner) backoff(ctx context.Context, try int) error {
	d := r.cfg.RetryBaseDelay << min(try, 20)
	if d <= 0 || d > r.cfg.RetryMaxDelay {
		d = r.cfg.RetryMaxDelay
	}
	return sleep(ctx, d/2+rand.N(d/2+1))
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

// callPhase runs a user function, turning a panic into a *PanicError so that
// the transaction is rolled back and the key released like any other error.
func callPhase[T any](ctx context.Context, tx pgx.Tx, fn func(context.Context, pgx.Tx) (T, error)) (v T, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return fn(ctx, tx)
}
