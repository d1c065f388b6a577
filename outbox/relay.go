package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/backoff"
	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/service"
	"github.com/atomicphase/atomicphase/internal/telemetry"
)

// Stats describes a relay's work. The counters are this Relay's since New;
// OldestPendingAge is read from the database and covers every relay.
type Stats struct {
	// Published counts messages this relay published and marked published.
	Published uint64
	// Retried counts failed publishes this relay scheduled for another attempt.
	Retried uint64
	// Dead counts messages this relay dead-lettered.
	Dead uint64
	// Unavailable counts publishes that found the destination unavailable
	// (ErrUnavailable): scheduled for a retry without counting an attempt.
	Unavailable uint64
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
	down      atomic.Uint64 // publishes that found the destination unavailable

	tel    *telemetry.Outbox
	tracer *telemetry.Tracer

	wake      chan struct{} // a pending wake-up for the loop; capacity 1
	listening atomic.Bool   // the listener holds a LISTENing connection

	life service.Lifecycle

	retry    backoff.Policy // the wait before a failed message's next attempt
	limits   RelayLimits
	prepMu   sync.Mutex  // serializes PrepareRelay calls
	prepared atomic.Bool // PrepareRelay succeeded

	// idleConn holds the idle lock while the loop waits announced idle; the
	// loop's own, nil while closed.
	idleConn *pgx.Conn

	// testHookIdle, when set before Start, runs each time the loop is about
	// to wait for a notification or its timer.
	testHookIdle func()
	// testHookBeforeIdle, when set before Start, runs each time the loop,
	// listening, is about to announce itself idle.
	testHookBeforeIdle func()
}

var (
	// listenBackoff is the wait before the listener reconnects after
	// losing its connection: 100 ms, doubling with each consecutive failure
	// to connect, up to 30 s.
	listenBackoff = backoff.Policy{Base: 100 * time.Millisecond, Max: 30 * time.Second}
	// loopErrorBackoff is the wait after a failed batch: 100 ms, doubling
	// with each consecutive failure, up to 30 s.
	loopErrorBackoff = backoff.Policy{Base: 100 * time.Millisecond, Max: 30 * time.Second}
)

const (
	// wakeCooldown is the least time between the starts of two batches when
	// the second is woken by a notification, and the pause after a batch
	// that was neither full nor empty: a busy relay's producers do not
	// notify, so it is also how late a busy relay looks for new messages.
	// (20 ms gave a p99 commit-to-ack of 64 ms at c=8 in the bench; 5 ms,
	// 43 ms.)
	wakeCooldown = 5 * time.Millisecond
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
	c = c.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	r := &Relay{
		pool:  pool,
		pub:   pub,
		cfg:   c,
		log:   c.Logger,
		wake:  make(chan struct{}, 1),
		retry: backoff.Policy{Base: c.RetryBaseDelay, Max: c.RetryMaxDelay, Jitter: backoff.Equal},
		tel:   telemetry.NewOutbox(c.MeterProvider), tracer: telemetry.NewTracer(c.TracerProvider),
	}
	r.limits = RelayLimits{
		PublishDeadline:   r.publishDeadline(),
		RepublishInterval: c.RetryMaxDelay + 2*c.PublishTimeout + c.PollInterval,
	}
	if checker, ok := pub.(Checker); ok {
		if err := checker.CheckRelay(r.limits); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
	}
	return r, nil
}

// RelayLimits are the timings of a relay that a publisher checks its own
// settings against (see [Checker] and [Preparer]).
type RelayLimits struct {
	// PublishDeadline is how long after its claim a batch may publish:
	// three quarters of Config.PublishTimeout. A publisher's own time limit
	// for one message must not be longer, or the relay would cut off every
	// message that needs it.
	PublishDeadline time.Duration

	// RepublishInterval bounds the time from one publish attempt of a
	// message to the next, while relays run and keep up: a failed attempt is
	// recorded within PublishTimeout of its claim and falls due at most
	// RetryMaxDelay later (Retry-After included), and a relay claims it
	// within PollInterval when idle, or after its batch in flight (at most
	// PublishTimeout) when busy. It is RetryMaxDelay + 2 × PublishTimeout +
	// PollInterval. A broker that deduplicates on Envelope.ID must remember
	// an id at least this long to drop every republish.
	RepublishInterval time.Duration
}

// A Checker is a Publisher whose settings must fit the relay's. New calls
// CheckRelay with the relay's limits and fails, with an error wrapping
// ErrInvalidConfig, when it returns an error. CheckRelay must not block.
type Checker interface {
	CheckRelay(limits RelayLimits) error
}

// A Preparer is a Publisher that checks its broker against the relay's
// limits before the relay publishes through it. Start calls PrepareRelay
// and fails with its error; RunOnce calls it before its first batch, and
// again on later calls until it succeeds.
type Preparer interface {
	PrepareRelay(ctx context.Context, limits RelayLimits) error
}

// prepare runs the publisher's PrepareRelay, if it has one, unless it
// succeeded before and again is false.
func (r *Relay) prepare(ctx context.Context, again bool) error {
	p, ok := r.pub.(Preparer)
	if !ok || (!again && r.prepared.Load()) {
		return nil
	}
	r.prepMu.Lock()
	defer r.prepMu.Unlock()
	if !again && r.prepared.Load() {
		return nil
	}
	if err := p.PrepareRelay(ctx, r.limits); err != nil {
		return err
	}
	r.prepared.Store(true)
	return nil
}

// Stats returns the relay's counters and the age of the oldest pending
// message, which it reads from the database.
func (r *Relay) Stats(ctx context.Context) (Stats, error) {
	s := Stats{
		Published: r.published.Load(),
		Retried:   r.retried.Load(),
		Dead:      r.dead.Load(),

		Unavailable: r.down.Load(),
	}
	age, err := db.New(r.pool).OldestPendingAge(ctx)
	if err != nil {
		return s, fmt.Errorf("outbox: stats: %w", err)
	}
	s.OldestPendingAge = seconds(age)
	return s, nil
}
