package outbox

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/pgerr"
)

// Config configures a Relay. The zero value is usable; every field states
// its default.
type Config struct {
	// Logger receives failed publishes, dead letters and relay errors, with
	// snake_case attribute keys. Default: slog.Default().
	Logger *slog.Logger

	// BatchSize is the most messages one claim transaction takes.
	// Default: 100.
	BatchSize int

	// PollInterval is how often an idle relay looks for messages when no
	// notification wakes it (and always, with DisableNotify). An idle relay
	// also wakes when the earliest retry or delayed message falls due.
	// Default: 1 second.
	PollInterval time.Duration

	// PublishTimeout is the longest a claim transaction stays open, and so
	// the longest a batch's rows stay locked. Publishing gets three quarters
	// of it; the rest is kept for recording the results and committing.
	// Messages still unacknowledged at the publishing deadline count as
	// failed attempts. Default: 10 seconds.
	PublishTimeout time.Duration

	// MaxAttempts is how many times a message is tried before it is
	// dead-lettered: kept, with dead_at and last_error set, and never
	// published again. Default: 10.
	MaxAttempts int

	// RetryBaseDelay is the wait before a failed message's second attempt.
	// Each further failure doubles it, up to RetryMaxDelay; the actual wait
	// is drawn uniformly from the upper half of that (equal jitter), so
	// successive waits never shrink. Default: 1 second.
	RetryBaseDelay time.Duration

	// RetryMaxDelay caps the retry wait. Default: 10 minutes.
	RetryMaxDelay time.Duration

	// DisableNotify turns off LISTEN/NOTIFY wake-ups: the relay only polls,
	// every PollInterval. Use it where connections cannot LISTEN, as behind a
	// transaction-pooling PgBouncer. Default: false (listen on a dedicated
	// connection taken from the pool, and poll as a fallback).
	DisableNotify bool
}

// Stats describes a relay's work. The counters are this Relay's since New;
// OldestPendingAge is read from the database and covers every relay.
type Stats struct {
	// Published counts messages this relay published and marked published.
	Published uint64
	// Retried counts failed publishes this relay scheduled for another attempt.
	Retried uint64
	// Dead counts messages this relay dead-lettered.
	Dead uint64
	// OldestPendingAge is how long ago, by the database clock, the oldest
	// message that is neither published nor dead-lettered was staged;
	// 0 when there is none. A growing value means the relays are behind
	// or a key is held back by a failing message.
	OldestPendingAge time.Duration
}

// Relay moves committed messages from the outbox table to a Publisher.
// Several relays, in one process or many, can serve the same table at once.
// Use RunOnce to relay one batch (from a cron job or a test), or Start and
// Stop to run it as a background service.
type Relay struct {
	pool *pgxpool.Pool
	pub  Publisher
	cfg  Config
	log  *slog.Logger

	published atomic.Uint64
	retried   atomic.Uint64
	dead      atomic.Uint64

	wake      chan struct{} // a pending wake-up for the loop; capacity 1
	listening atomic.Bool   // the listener holds a LISTENing connection

	mu     sync.Mutex
	cancel context.CancelFunc
	done   chan struct{}

	// testHookIdle, when set before Start, runs each time the loop is about
	// to wait for a notification or its timer.
	testHookIdle func()
}

const (
	// listenRetryMin and listenRetryMax bound the wait before the listener
	// reconnects after losing its connection.
	listenRetryMin = 100 * time.Millisecond
	listenRetryMax = 30 * time.Second
	// loopErrorMin and loopErrorMax bound the wait after failed batches,
	// doubling with each consecutive failure.
	loopErrorMin = 100 * time.Millisecond
	loopErrorMax = 30 * time.Second
	// wakeCooldown is the least time between the starts of two batches when
	// the second is woken by a notification.
	wakeCooldown = 20 * time.Millisecond
	// maxErrorBytes bounds last_error.
	maxErrorBytes = 2000
)

// New returns a Relay that publishes pool's outbox messages with pub.
// cfg may be nil for the defaults. It validates its arguments and does not
// touch the database.
func New(pool *pgxpool.Pool, pub Publisher, cfg *Config) (*Relay, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: nil pool", ErrInvalidConfig)
	}
	if pub == nil {
		return nil, fmt.Errorf("%w: nil publisher", ErrInvalidConfig)
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	switch {
	case c.BatchSize < 0, c.BatchSize > 10000:
		return nil, fmt.Errorf("%w: BatchSize %d is not between 1 and 10000", ErrInvalidConfig, c.BatchSize)
	case c.PollInterval < 0:
		return nil, fmt.Errorf("%w: negative PollInterval", ErrInvalidConfig)
	case c.PublishTimeout < 0:
		return nil, fmt.Errorf("%w: negative PublishTimeout", ErrInvalidConfig)
	case c.MaxAttempts < 0:
		return nil, fmt.Errorf("%w: negative MaxAttempts", ErrInvalidConfig)
	case c.RetryBaseDelay < 0, c.RetryMaxDelay < 0:
		return nil, fmt.Errorf("%w: negative retry delay", ErrInvalidConfig)
	}
	c.Logger = cmp.Or(c.Logger, slog.Default())
	c.BatchSize = cmp.Or(c.BatchSize, 100)
	c.PollInterval = cmp.Or(c.PollInterval, time.Second)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, 10*time.Second)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, 10)
	c.RetryBaseDelay = cmp.Or(c.RetryBaseDelay, time.Second)
	c.RetryMaxDelay = cmp.Or(c.RetryMaxDelay, 10*time.Minute)
	if c.RetryMaxDelay < c.RetryBaseDelay {
		return nil, fmt.Errorf("%w: RetryMaxDelay %v is less than RetryBaseDelay %v",
			ErrInvalidConfig, c.RetryMaxDelay, c.RetryBaseDelay)
	}
	return &Relay{
		pool: pool,
		pub:  pub,
		cfg:  c,
		log:  c.Logger,
		wake: make(chan struct{}, 1),
	}, nil
}

// Stats returns the relay's counters and the age of the oldest pending
// message, which it reads from the database.
func (r *Relay) Stats(ctx context.Context) (Stats, error) {
	s := Stats{
		Published: r.published.Load(),
		Retried:   r.retried.Load(),
		Dead:      r.dead.Load(),
	}
	age, err := db.New(r.pool).OldestPendingAge(ctx)
	if err != nil {
		return s, fmt.Errorf("outbox: stats: %w", err)
	}
	s.OldestPendingAge = seconds(age)
	return s, nil
}

// RunOnce claims one batch of publishable messages, publishes it, records
// the outcome and commits, and returns how many messages it published.
// It returns 0 and no error when nothing is due.
//
// Cancelling ctx stops publishing: messages already acknowledged are still
// marked published (the database work runs to completion, bounded by
// PublishTimeout), and the others are left as they were, without counting
// an attempt. If ctx is done already, RunOnce returns its error at once.
func (r *Relay) RunOnce(ctx context.Context) (int, error) {
	b, err := r.runBatch(ctx)
	return b.published, err
}

// Start runs the relay in the background until ctx is done or Stop is
// called: it relays batches back to back while there is work, then waits for
// a notification, the earliest retry falling due, or PollInterval. It
// returns ErrRelayRunning if the relay is already running.
func (r *Relay) Start(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done != nil {
		select {
		case <-r.done:
		default:
			return ErrRelayRunning
		}
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	var wg sync.WaitGroup
	if !r.cfg.DisableNotify {
		wg.Go(func() { r.listen(runCtx) })
	}
	wg.Go(func() { r.loop(runCtx) })
	go func() {
		wg.Wait()
		close(done)
	}()
	r.cancel, r.done = cancel, done
	r.log.Info("outbox: relay started",
		"batch_size", r.cfg.BatchSize,
		"poll_interval", r.cfg.PollInterval,
		"notify", !r.cfg.DisableNotify)
	return nil
}

// Stop stops a relay started with Start and waits for it: a batch in flight
// stops publishing, records what was acknowledged and commits. Stop is safe
// to call more than once, and on a relay that was never started.
func (r *Relay) Stop() {
	r.mu.Lock()
	cancel, done := r.cancel, r.done
	r.mu.Unlock()
	if cancel == nil {
		return
	}
	cancel()
	<-done
}

// loop is the background service. A full batch is followed at once by the
// next one, any other non-empty batch after wakeCooldown; after an empty one
// the relay waits for a wake-up (a notification, or the listener's start),
// the next retry or delayed message falling due, or PollInterval. Wake-ups are taken at most once per wakeCooldown, so that a
// stream of committing transactions, each notifying every relay, costs each
// relay a bounded number of claims rather than one per commit.
func (r *Relay) loop(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	defer r.log.Info("outbox: relay stopped")
	errWait := loopErrorMin
	for {
		started := time.Now()
		b, err := r.runBatch(ctx)
		if ctx.Err() != nil {
			return
		}
		var wait time.Duration
		switch {
		case err != nil:
			r.logBatchError(err)
			wait, errWait = errWait, min(2*errWait, loopErrorMax)
		case b.claimed >= r.cfg.BatchSize:
			errWait = loopErrorMin
			continue // a backlog: keep going
		case b.claimed > 0:
			// Look again shortly: the batch may have released held-back
			// messages, and a short retry may already be due.
			errWait = loopErrorMin
			wait = wakeCooldown
		default:
			errWait = loopErrorMin
			wait = r.cfg.PollInterval
			if b.nextDue >= 0 {
				// A millisecond late, so the database clock has passed it.
				wait = min(wait, max(b.nextDue-time.Since(started), 0)+time.Millisecond)
			}
		}
		if r.testHookIdle != nil {
			r.testHookIdle()
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
			continue
		case <-r.wake:
		}
		if rest := wakeCooldown - time.Since(started); rest > 0 {
			timer.Reset(rest)
			select {
			case <-ctx.Done():
				return
			case <-timer.C:
			}
		}
	}
}

func (r *Relay) logBatchError(err error) {
	switch {
	case errors.Is(err, context.Canceled):
	case pgerr.IsUndefinedTable(err):
		r.log.Error("outbox: relay: outbox table missing; apply the migrations", "error", err)
	case pgerr.IsConnection(err):
		r.log.Warn("outbox: relay: database unavailable", "error", err)
	default:
		r.log.Error("outbox: relay: batch failed", "error", err)
	}
}

// signal wakes the loop, or leaves a wake-up pending if it is busy.
func (r *Relay) signal() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// listen keeps a LISTEN connection open and turns notifications for this
// relay's schema into wake-ups, reconnecting with backoff when it fails.
// While it is down, the loop's polling delivers.
func (r *Relay) listen(ctx context.Context) {
	delay := listenRetryMin
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		connected, err := r.listenOnce(ctx)
		r.listening.Store(false)
		if ctx.Err() != nil {
			return
		}
		if connected {
			delay = listenRetryMin
		}
		r.log.Warn("outbox: relay listener failed; polling until it reconnects",
			"error", err, "retry_in", delay)
		timer.Reset(delay)
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		delay = min(2*delay, listenRetryMax)
	}
}

// listenOnce runs one listening connection until it fails or ctx is done.
func (r *Relay) listenOnce(ctx context.Context) (connected bool, err error) {
	pc, err := r.pool.Acquire(ctx)
	if err != nil {
		return false, err
	}
	// The connection leaves the pool: it stays in LISTEN state and is
	// closed, never reused, when the listener ends.
	conn := pc.Hijack()
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	var schema string
	if err := conn.QueryRow(ctx, "SELECT coalesce(current_schema(), '')").Scan(&schema); err != nil {
		return false, err
	}
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{NotifyChannel}.Sanitize()); err != nil {
		return false, err
	}
	// Messages committed while no one was listening are found by this
	// wake-up; the flag is set after it, so a loop that sees the flag and
	// no pending wake-up has already run a batch since listening began.
	r.signal()
	r.listening.Store(true)
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return true, err
		}
		if n.Channel == NotifyChannel && (n.Payload == schema || n.Payload == "") {
			r.signal()
		}
	}
}

// outcome is what happened to one claimed message.
type outcome struct {
	attempted bool  // the publisher was asked to publish it
	err       error // nil: published
}

// batch is what runBatch did.
type batch struct {
	published int
	claimed   int
	// nextDue, after a batch that claimed nothing, is when (from the start
	// of the batch) the earliest message that was not due yet falls due;
	// -1 when there is none or it is unknown.
	nextDue time.Duration
}

// runBatch claims, publishes and records one batch in one transaction.
func (r *Relay) runBatch(ctx context.Context) (b batch, err error) {
	b.nextDue = -1
	if err := ctx.Err(); err != nil {
		return b, err
	}
	start := time.Now()
	// The database work is not cut short by ctx (a cancelled relay still
	// records what it published), only by PublishTimeout.
	txCtx, cancel := context.WithDeadline(context.WithoutCancel(ctx), start.Add(r.cfg.PublishTimeout))
	defer cancel()
	tx, err := r.pool.Begin(txCtx)
	if err != nil {
		return b, fmt.Errorf("outbox: relay: begin: %w", err)
	}
	defer func() {
		rctx, rcancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer rcancel()
		_ = tx.Rollback(rctx) // no-op after Commit
	}()
	q := db.New(tx)
	rows, err := q.ClaimMessages(txCtx, int32(r.cfg.BatchSize))
	if err != nil {
		return b, fmt.Errorf("outbox: relay: claim: %w", err)
	}
	if len(rows) == 0 {
		// In the claim's transaction, now() is the time the claim judged
		// due messages by: every message that falls due after it counts,
		// including one that falls due while this runs.
		due, err := q.NextDueIn(txCtx)
		if err == nil && due >= 0 {
			b.nextDue = seconds(due)
		}
		return b, nil
	}
	b.claimed = len(rows)

	envs := make([]Envelope, len(rows))
	outcomes := make([]outcome, len(rows))
	for i, row := range rows {
		envs[i] = Envelope{
			ID:          row.ID,
			Topic:       row.Topic,
			OrderingKey: row.OrderingKey.String,
			Payload:     row.Payload,
			Attempt:     int(row.Attempts) + 1,
			CreatedAt:   row.CreatedAt,
		}
		if string(row.Headers) != "{}" {
			if err := json.Unmarshal(row.Headers, &envs[i].Headers); err != nil {
				// Only a row written around Enqueue can get here; it can
				// never be published.
				outcomes[i] = outcome{attempted: true, err: Permanent(fmt.Errorf("headers are not an object of strings: %w", err))}
			}
		}
	}

	pubCtx, pubCancel := context.WithDeadline(ctx, start.Add(r.cfg.PublishTimeout-r.cfg.PublishTimeout/4))
	r.publish(pubCtx, envs, outcomes)
	pubCancel()

	// Record. When the relay itself is stopping, failures are left as they
	// were: they are most likely the cancellation, not the publisher's.
	stopping := ctx.Err() != nil
	var ok []int64
	var fail db.RecordFailuresParams
	type logged struct {
		env   *Envelope
		err   error
		delay time.Duration
		dead  bool
	}
	var failures []logged
	for i := range envs {
		o := outcomes[i]
		switch {
		case !o.attempted:
		case o.err == nil:
			ok = append(ok, envs[i].ID)
		case stopping:
		default:
			dead := errors.Is(o.err, ErrPermanent) || envs[i].Attempt >= r.cfg.MaxAttempts
			var delay time.Duration
			if !dead {
				delay = r.backoff(envs[i].Attempt)
			}
			fail.Ids = append(fail.Ids, envs[i].ID)
			fail.Errors = append(fail.Errors, errorText(o.err))
			fail.DelaysUs = append(fail.DelaysUs, delay.Microseconds())
			fail.Dead = append(fail.Dead, dead)
			failures = append(failures, logged{&envs[i], o.err, delay, dead})
		}
	}
	if len(ok) > 0 {
		if err := q.MarkPublished(txCtx, ok); err != nil {
			return b, fmt.Errorf("outbox: relay: mark published: %w", err)
		}
	}
	if len(fail.Ids) > 0 {
		if err := q.RecordFailures(txCtx, fail); err != nil {
			return b, fmt.Errorf("outbox: relay: record failures: %w", err)
		}
	}
	if err := tx.Commit(txCtx); err != nil {
		return b, fmt.Errorf("outbox: relay: commit: %w", err)
	}

	r.published.Add(uint64(len(ok)))
	for _, f := range failures {
		attrs := []any{
			"message_id", f.env.ID, "topic", f.env.Topic, "attempt", f.env.Attempt, "error", f.err,
		}
		if f.env.OrderingKey != "" {
			attrs = append(attrs, "ordering_key", f.env.OrderingKey)
		}
		if f.dead {
			r.dead.Add(1)
			r.log.Error("outbox: message dead-lettered", attrs...)
		} else {
			r.retried.Add(1)
			r.log.Warn("outbox: publish failed; will retry", append(attrs, "retry_in", f.delay)...)
		}
	}
	b.published = len(ok)
	return b, nil
}

// publish publishes envs in waves: wave n holds the n-th claimed message of
// every ordering key (unordered messages all go in the first wave), so no
// two messages of one call share a key, and a key's message is published
// only after its predecessor was acknowledged. A key whose message fails is
// left out of the later waves: its remaining messages stay pending, held
// back behind the failed one. Messages already failed (outcomes set) are
// treated the same way.
func (r *Relay) publish(ctx context.Context, envs []Envelope, outcomes []outcome) {
	var waves [][]int
	next := make(map[string]int)
	for i := range envs {
		w := 0
		if k := envs[i].OrderingKey; k != "" {
			w = next[k]
			next[k] = w + 1
		}
		if w == len(waves) {
			waves = append(waves, nil)
		}
		waves[w] = append(waves[w], i)
	}
	stopped := make(map[string]bool)
	for _, wave := range waves {
		if ctx.Err() != nil {
			return
		}
		var idx []int
		var batch []Envelope
		for _, i := range wave {
			k := envs[i].OrderingKey
			if k != "" && stopped[k] {
				continue
			}
			if outcomes[i].attempted { // failed before publishing
				if k != "" {
					stopped[k] = true
				}
				continue
			}
			idx = append(idx, i)
			batch = append(batch, envs[i])
		}
		if len(batch) == 0 {
			continue
		}
		errs := r.callPublisher(ctx, batch)
		for j, i := range idx {
			outcomes[i] = outcome{attempted: true, err: errs[j]}
			if errs[j] != nil && envs[i].OrderingKey != "" {
				stopped[envs[i].OrderingKey] = true
			}
		}
	}
}

// callPublisher runs the publisher on its own goroutine so that the relay
// stops waiting at ctx's deadline even if the publisher does not, keeping
// the transaction's bound. It turns a panic into errors.
func (r *Relay) callPublisher(ctx context.Context, batch []Envelope) []error {
	ch := make(chan []error, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				ch <- fill(len(batch), fmt.Errorf("outbox: publisher panicked: %v", p))
			}
		}()
		ch <- r.pub.Publish(ctx, batch)
	}()
	var errs []error
	select {
	case errs = <-ch:
	case <-ctx.Done():
		select {
		case errs = <-ch: // finished just now: keep its results
		default:
			return fill(len(batch), fmt.Errorf("outbox: publish: %w", ctx.Err()))
		}
	}
	switch len(errs) {
	case len(batch):
		return errs
	case 0:
		if errs == nil {
			return make([]error, len(batch))
		}
	}
	return fill(len(batch), fmt.Errorf("outbox: publisher returned %d results for %d messages", len(errs), len(batch)))
}

func fill(n int, err error) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}

// backoff returns the wait before the attempt after the given failed one:
// RetryBaseDelay doubled per earlier failure, capped at RetryMaxDelay, with
// equal jitter (uniform in the upper half), so that waits never shrink from
// one attempt to the next.
func (r *Relay) backoff(attempt int) time.Duration {
	d := r.cfg.RetryMaxDelay
	if shift := attempt - 1; shift < 62 {
		if b := r.cfg.RetryBaseDelay << shift; b > 0 && b>>shift == r.cfg.RetryBaseDelay && b < d {
			d = b
		}
	}
	half := d / 2
	return half + rand.N(d-half+1)
}

// errorText makes err storable as last_error: valid UTF-8, no NUL, bounded.
func errorText(err error) string {
	s := strings.ReplaceAll(strings.ToValidUTF8(err.Error(), "\uFFFD"), "\x00", "")
	if len(s) > maxErrorBytes {
		cut := maxErrorBytes
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut]
	}
	return s
}

func seconds(s float64) time.Duration {
	return time.Duration(s * float64(time.Second))
}
