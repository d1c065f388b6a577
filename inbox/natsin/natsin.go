// Package natsin consumes a NATS JetStream pull consumer through an inbox:
// each message's handler runs in the inbox's transaction, and the message is
// acknowledged only after that transaction committed, so a redelivery (a
// lost acknowledgement, a crash between commit and ack) is acknowledged
// without running the handler again.
package natsin

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/internal/backoff"
	"github.com/atomicphase/atomicphase/internal/service"
)

// The defaults of Config's fields, used for the fields left zero.
const (
	ConcurrencyDefault  = 4
	FetchWaitDefault    = 5 * time.Second
	NakBaseDelayDefault = time.Second
	NakMaxDelayDefault  = time.Minute
)

// FetchWaitMin bounds Config.FetchWait from below.
const FetchWaitMin = 10 * time.Millisecond

// Config configures a Consumer. Stream and Consumer are required; every
// other field has a default.
type Config struct {
	// Stream names the JetStream stream. Required.
	Stream string

	// Consumer names the durable pull consumer on Stream to consume. Create
	// it with explicit acknowledgements (AckExplicitPolicy) and a bounded
	// MaxDeliver; its AckWait (or BackOff) and MaxDeliver decide when a
	// message is delivered again and when it is dead-lettered. Required.
	Consumer string

	// Logger receives handler failures (WARN), dead letters and rejected
	// messages (ERROR). Default: the inbox's logger.
	Logger *slog.Logger

	// MessageID returns a message's id, the inbox's deduplication key.
	// Default: the Nats-Msg-Id header, which the outbox's NATS publisher
	// (package natspub) sets to the outbox message's id. A message whose id
	// is empty or invalid (see inbox.ValidateMessageID) is terminated
	// without any SQL and logged.
	MessageID func(msg jetstream.Msg) string

	// Concurrency is how many messages are handled at once. Messages are
	// then handled in no particular order; use 1 (and a consumer with
	// MaxAckPending 1) where order matters.
	// Default: ConcurrencyDefault (4).
	Concurrency int

	// BatchSize is how many messages one pull asks for. Default: four
	// times Concurrency.
	BatchSize int

	// FetchWait is how long a pull waits for messages before RunOnce
	// returns with what it got (possibly nothing); at least FetchWaitMin.
	// Default: FetchWaitDefault (5 seconds).
	FetchWait time.Duration

	// NakBaseDelay is the delay before a message whose handler failed is
	// delivered again; it doubles with each delivery, up to NakMaxDelay,
	// with equal jitter. Default: NakBaseDelayDefault (1 second).
	NakBaseDelay time.Duration

	// NakMaxDelay caps the redelivery delay after a handler failure. It
	// counts in the redelivery horizon that the inbox's Retention must
	// outlast. Default: NakMaxDelayDefault (1 minute).
	NakMaxDelay time.Duration
}

// withDefaults returns c with each zero field set to its default; the
// logger defaults to the inbox's.
func (c Config) withDefaults(in *inbox.Inbox) Config {
	c.Logger = cmp.Or(c.Logger, in.Config().Logger)
	if c.MessageID == nil {
		c.MessageID = func(m jetstream.Msg) string { return m.Headers().Get(jetstream.MsgIDHeader) }
	}
	c.Concurrency = cmp.Or(c.Concurrency, ConcurrencyDefault)
	c.BatchSize = cmp.Or(c.BatchSize, 4*max(c.Concurrency, 1))
	c.FetchWait = cmp.Or(c.FetchWait, FetchWaitDefault)
	c.NakBaseDelay = cmp.Or(c.NakBaseDelay, NakBaseDelayDefault)
	c.NakMaxDelay = cmp.Or(c.NakMaxDelay, NakMaxDelayDefault)
	return c
}

// validate reports a field outside its documented range, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	for name, v := range map[string]string{"Stream": c.Stream, "Consumer": c.Consumer} {
		if v == "" || strings.ContainsAny(v, " \t\r\n.*>") {
			return fmt.Errorf("%w: %s %q is empty or contains whitespace, '.', '*' or '>'", ErrInvalidConfig, name, v)
		}
	}
	switch {
	case c.Concurrency < 0, c.BatchSize < 0, c.FetchWait < 0, c.NakBaseDelay < 0, c.NakMaxDelay < 0:
		return fmt.Errorf("%w: negative durations and counts are not allowed", ErrInvalidConfig)
	case c.FetchWait < FetchWaitMin:
		return fmt.Errorf("%w: FetchWait %v is shorter than %v", ErrInvalidConfig, c.FetchWait, FetchWaitMin)
	case c.NakMaxDelay < c.NakBaseDelay:
		return fmt.Errorf("%w: NakMaxDelay %v is less than NakBaseDelay %v", ErrInvalidConfig, c.NakMaxDelay, c.NakBaseDelay)
	}
	return nil
}

// Message is a delivered message as a Handler sees it.
type Message struct {
	// ID is the message's id (Config.MessageID).
	ID string
	// Subject is the subject the message was published to.
	Subject string
	// Data is the message body.
	Data []byte
	// Header holds the message's headers.
	Header nats.Header
	// Delivery is 1 on the first delivery and grows with each redelivery.
	Delivery int
	// StreamSequence is the message's sequence number in the stream.
	StreamSequence uint64
	// Published is when the stream stored the message.
	Published time.Time
}

// Handler writes a message's effects through tx; see inbox.Func. It may
// run more than once for a message (after a serialization failure, or on a
// redelivery after it failed) until one run commits; it never runs again
// after that.
type Handler func(ctx context.Context, tx pgx.Tx, msg Message) error

// Stats counts what a Consumer did since it was created.
type Stats struct {
	Acked        uint64 // messages acknowledged after their handler committed
	Duplicates   uint64 // of those, redeliveries acknowledged without running the handler
	Failed       uint64 // deliveries whose handler failed, left to be delivered again (NAK)
	DeadLettered uint64 // messages recorded as dead letters after their last delivery failed
	Rejected     uint64 // messages terminated before any SQL: no usable id
	AckErrors    uint64 // acknowledgements the client could not send (the message comes again)
	Unavailable  uint64 // tries that found the database unavailable; the message was held, not NAKed
}

// Consumer handles the messages of a JetStream pull consumer through an
// inbox. It is safe for concurrent use; several Consumers (in one process
// or many) may consume the same JetStream consumer.
type Consumer struct {
	in      *inbox.Inbox
	js      jetstream.JetStream
	handler Handler
	cfg     Config
	log     *slog.Logger

	nak     backoff.Policy // the delay before a failed message is delivered again
	prepMu  sync.Mutex
	prep    *prepared
	running service.Lifecycle

	acked, duplicates, failed, deadLettered, rejected, ackErrors, unavailable atomic.Uint64
	outage                                                                    atomic.Bool // the database was last found unavailable
}

// prepared is what the consumer read from the server before running.
type prepared struct {
	cons       jetstream.Consumer
	ackWait    time.Duration
	backoff    []time.Duration
	maxDeliver int
}

// New returns a Consumer that handles the messages of cfg.Consumer on
// cfg.Stream with h, through in. The JetStream consumer is looked up, and
// its settings checked, by Start or the first RunOnce.
func New(in *inbox.Inbox, js jetstream.JetStream, h Handler, cfg *Config) (*Consumer, error) {
	switch {
	case in == nil:
		return nil, fmt.Errorf("natsin: new: %w: nil inbox", ErrInvalidConfig)
	case js == nil:
		return nil, fmt.Errorf("natsin: new: %w: nil JetStream", ErrInvalidConfig)
	case h == nil:
		return nil, fmt.Errorf("natsin: new: %w: nil handler", ErrInvalidConfig)
	case cfg == nil:
		return nil, fmt.Errorf("natsin: new: %w: Stream and Consumer are required", ErrInvalidConfig)
	}
	c := cfg.withDefaults(in)
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("natsin: new: %w", err)
	}
	return &Consumer{in: in, js: js, handler: h, cfg: c, log: c.Logger,
		nak: backoff.Policy{Base: c.NakBaseDelay, Max: c.NakMaxDelay, Jitter: backoff.Equal}}, nil
}

// Stats returns the consumer's counters.
func (c *Consumer) Stats() Stats {
	return Stats{
		Acked: c.acked.Load(), Duplicates: c.duplicates.Load(), Failed: c.failed.Load(),
		DeadLettered: c.deadLettered.Load(), Rejected: c.rejected.Load(), AckErrors: c.ackErrors.Load(),
		Unavailable: c.unavailable.Load(),
	}
}

// prepare looks up the stream and the consumer, once, and checks that the
// consumer acknowledges explicitly and that the inbox's Retention outlasts
// its redelivery horizon.
func (c *Consumer) prepare(ctx context.Context) (*prepared, error) {
	c.prepMu.Lock()
	defer c.prepMu.Unlock()
	if c.prep != nil {
		return c.prep, nil
	}
	stream, err := c.js.Stream(ctx, c.cfg.Stream)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", c.cfg.Stream, err)
	}
	cons, err := stream.Consumer(ctx, c.cfg.Consumer)
	if err != nil {
		return nil, fmt.Errorf("consumer %s on stream %s: %w", c.cfg.Consumer, c.cfg.Stream, err)
	}
	cc := cons.CachedInfo().Config
	switch {
	case cc.DeliverSubject != "":
		return nil, fmt.Errorf("%w: consumer %s is a push consumer; create a pull consumer (no DeliverSubject)", ErrConsumerSettings, c.cfg.Consumer)
	case cc.AckPolicy != jetstream.AckExplicitPolicy:
		return nil, fmt.Errorf("%w: consumer %s acknowledges with %s; messages must be acknowledged one by one after their commit (AckExplicitPolicy)",
			ErrConsumerSettings, c.cfg.Consumer, cc.AckPolicy)
	}
	p := &prepared{cons: cons, ackWait: cmp.Or(cc.AckWait, 30*time.Second), backoff: cc.BackOff, maxDeliver: cc.MaxDeliver}
	maxAge := stream.CachedInfo().Config.MaxAge
	horizon, how := p.horizon(c.cfg.NakMaxDelay, maxAge)
	if horizon == forever {
		return nil, fmt.Errorf("%w: JetStream consumer %s delivers a failing message again without limit (MaxDeliver %d) and stream %s keeps messages forever (MaxAge 0), so no Retention covers its redeliveries; set the consumer's MaxDeliver or the stream's MaxAge",
			inbox.ErrRetentionTooShort, c.cfg.Consumer, cc.MaxDeliver, c.cfg.Stream)
	}
	if err := c.in.CheckHorizon(horizon, fmt.Sprintf("JetStream consumer %s on stream %s (%s)", c.cfg.Consumer, c.cfg.Stream, how)); err != nil {
		return nil, err
	}
	c.prep = p
	return p, nil
}

const forever = time.Duration(math.MaxInt64)

// horizon returns how long after a message was handled the broker may still
// deliver it again, and how that was computed: each of at most MaxDeliver
// deliveries comes at most the longest of AckWait, BackOff and the NAK
// delay after the previous one, and nothing is delivered once the stream
// dropped the message (MaxAge).
func (p *prepared) horizon(nakMax, maxAge time.Duration) (time.Duration, string) {
	h, how := forever, "MaxDeliver unlimited"
	if p.maxDeliver > 0 {
		gap := max(p.ackWait, nakMax)
		for _, b := range p.backoff {
			gap = max(gap, b)
		}
		h = forever
		if gap < forever/time.Duration(p.maxDeliver) {
			h = time.Duration(p.maxDeliver) * gap
		}
		how = fmt.Sprintf("MaxDeliver %d x %v, the longest of AckWait %v, BackOff and the NAK delay %v", p.maxDeliver, gap, p.ackWait, nakMax)
	}
	if maxAge > 0 && maxAge < h {
		h, how = maxAge, fmt.Sprintf("the stream's MaxAge %v", maxAge)
	}
	return h, how
}

// ackWaitFor returns how long the server waits for the acknowledgement of a
// message's delivery number n before delivering it again.
func (p *prepared) ackWaitFor(n int) time.Duration {
	if len(p.backoff) > 0 {
		return p.backoff[min(max(n-1, 0), len(p.backoff)-1)]
	}
	return p.ackWait
}

// RunOnce pulls one batch (waiting up to FetchWait for messages), handles
// each message through the inbox and acknowledges it after its commit,
// and returns how many messages it received. A message whose handler
// fails is NAKed with a delay, or, on its last delivery (MaxDeliver),
// dead-lettered in the inbox and terminated. A message without a usable id
// is terminated without any SQL.
//
// Each handler gets until its message's acknowledgement deadline (AckWait,
// or the consumer's BackOff for that delivery), after which the server
// delivers it again anyway. Cancelling ctx ends the pull; messages already
// received are still handled and acknowledged, so a stop delivers nothing
// twice. The first call checks the consumer's settings (see Start).
func (c *Consumer) RunOnce(ctx context.Context) (int, error) {
	p, err := c.prepare(ctx)
	if err != nil {
		return 0, fmt.Errorf("natsin: run once: %w", err)
	}
	fctx, cancel := context.WithTimeout(ctx, c.cfg.FetchWait)
	defer cancel()
	batch, err := p.cons.Fetch(c.cfg.BatchSize, jetstream.FetchContext(fctx))
	if err != nil {
		return 0, fmt.Errorf("natsin: fetch: %w", err)
	}
	sem := make(chan struct{}, c.cfg.Concurrency)
	var wg sync.WaitGroup
	n := 0
	for m := range batch.Messages() {
		n++
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			c.handle(ctx, p, m)
		})
	}
	wg.Wait()
	if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) &&
		!errors.Is(err, nats.ErrTimeout) {
		return n, fmt.Errorf("natsin: fetch: %w", err)
	}
	return n, nil
}

// handle handles one delivery and settles it with the server.
func (c *Consumer) handle(ctx context.Context, p *prepared, m jetstream.Msg) {
	meta, err := m.Metadata()
	if err != nil {
		c.log.ErrorContext(ctx, "natsin: message without JetStream metadata; left to be delivered again", "error", err)
		return
	}
	delivery := int(min(meta.NumDelivered, math.MaxInt32))
	id := c.cfg.MessageID(m)
	if err := inbox.ValidateMessageID(id); err != nil {
		c.rejected.Add(1)
		c.log.ErrorContext(ctx, "natsin: message has no usable id and cannot be handled exactly once; terminated",
			"stream", meta.Stream, "consumer", meta.Consumer, "stream_seq", meta.Sequence.Stream,
			"subject", m.Subject(), "error", err)
		c.settle(ctx, m.Term()) // no reason: servers before 2.10 ignore a TERM that carries one
		return
	}
	msg := Message{
		ID: id, Subject: m.Subject(), Data: m.Data(), Header: m.Headers(), Delivery: delivery,
		StreamSequence: meta.Sequence.Stream, Published: meta.Timestamp,
	}
	out, err := c.handleHeld(ctx, p, m, msg)
	if errors.Is(err, inbox.ErrUnavailable) {
		// Stopping during a database outage: the message is left
		// unacknowledged, and the server delivers it again after AckWait.
		return
	}
	if err == nil {
		if out == inbox.Duplicate {
			c.duplicates.Add(1)
		}
		if c.settle(ctx, m.Ack()) {
			c.acked.Add(1)
		}
		return
	}
	attrs := []any{"consumer", meta.Consumer, "message_id", id, "subject", msg.Subject,
		"delivery", delivery, "max_deliver", p.maxDeliver, "error", err}
	if p.maxDeliver > 0 && delivery >= p.maxDeliver {
		c.deadLetter(ctx, p, m, msg, err, attrs)
		return
	}
	c.failed.Add(1)
	delay := c.nak.Delay(delivery - 1)
	c.log.WarnContext(ctx, "natsin: handler failed; the message will be delivered again", append(attrs, "delay", delay)...)
	c.settle(ctx, m.NakWithDelay(delay))
}

// handleHeld handles one delivery through the inbox. The handler runs until
// the server would deliver the message again, not until the caller stops:
// a stop finishes what it received. While the database is unavailable
// (inbox.ErrUnavailable) the message is held, not NAKed: the consumer
// tells the server it is still working on it (which restarts its
// AckWait), waits, and tries again, so an outage of any length spends no
// delivery towards MaxDeliver. Only a stop ends the wait, returning the
// ErrUnavailable error.
func (c *Consumer) handleHeld(ctx context.Context, p *prepared, m jetstream.Msg, msg Message) (inbox.Outcome, error) {
	fn := func(ctx context.Context, tx pgx.Tx) error { return c.handler(ctx, tx, msg) }
	return holdThroughOutage(ctx, c, p, m, msg, func() (inbox.Outcome, error) {
		hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.ackWaitFor(msg.Delivery))
		defer cancel()
		return c.in.Handle(hctx, msg.ID, fn)
	})
}

// holdThroughOutage calls try until it returns anything but an error
// wrapping inbox.ErrUnavailable, or ctx ends. Between tries it marks m in
// progress, at least three times per AckWait, so the server does not
// deliver it again meanwhile.
func holdThroughOutage[T any](ctx context.Context, c *Consumer, p *prepared, m jetstream.Msg, msg Message, try func() (T, error)) (T, error) {
	wait := backoff.Policy{Base: outageRetryBase, Max: max(min(outageRetryMax, p.ackWaitFor(msg.Delivery)/3), time.Millisecond)}
	for n := 0; ; n++ {
		v, err := try()
		if !errors.Is(err, inbox.ErrUnavailable) {
			if err == nil && c.outage.CompareAndSwap(true, false) {
				c.log.InfoContext(ctx, "natsin: the database is available again; handling resumes",
					"stream", c.cfg.Stream, "consumer", c.cfg.Consumer)
			}
			return v, err
		}
		c.unavailable.Add(1)
		if c.outage.CompareAndSwap(false, true) {
			c.log.WarnContext(ctx, "natsin: the database is unavailable; holding the messages received, without spending their deliveries, until it answers",
				"stream", c.cfg.Stream, "consumer", c.cfg.Consumer, "message_id", msg.ID, "error", err)
		}
		if ctx.Err() != nil {
			return v, err
		}
		c.settle(ctx, m.InProgress())
		if backoff.Sleep(ctx, wait.Delay(n)) != nil {
			return v, err
		}
	}
}

// The wait between tries while the database is unavailable: 100 ms,
// doubling up to 2 s (and to a third of the message's AckWait).
const (
	outageRetryBase = 100 * time.Millisecond
	outageRetryMax  = 2 * time.Second
)

// deadLetter records a message whose last delivery failed, and terminates
// it; if it was handled meanwhile (a concurrent delivery committed), it is
// acknowledged instead. A message is never terminated without its dead
// letter: while the database is unavailable the message is held (see
// handleHeld), and if the dead letter cannot be recorded for another reason,
// or the consumer stops, the message is left unacknowledged in the stream.
func (c *Consumer) deadLetter(ctx context.Context, p *prepared, m jetstream.Msg, msg Message, cause error, attrs []any) {
	recorded, err := holdThroughOutage(ctx, c, p, m, msg, func() (bool, error) {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), deadLetterTimeout)
		defer cancel()
		return c.in.DeadLetter(dctx, inbox.Message{
			ID: msg.ID, Topic: msg.Subject, Payload: msg.Data, Headers: msg.Header, Deliveries: msg.Delivery,
		}, cause)
	})
	switch {
	case err != nil:
		c.log.ErrorContext(ctx, "natsin: last delivery failed and the dead letter could not be recorded; the message is left unacknowledged in the stream, not terminated",
			append(attrs, "dead_letter_error", err, "stream_seq", msg.StreamSequence)...)
	case recorded:
		c.deadLettered.Add(1)
		c.settle(ctx, m.Term())
	default:
		c.settle(ctx, m.Ack()) // handled meanwhile by a concurrent delivery
	}
}

// deadLetterTimeout bounds recording a dead letter.
const deadLetterTimeout = 10 * time.Second

// settle notes an acknowledgement (ack, NAK or term) the client could not
// send: the server then delivers the message again after AckWait, and the
// inbox acknowledges it if it was handled.
func (c *Consumer) settle(ctx context.Context, err error) bool {
	if err == nil {
		return true
	}
	c.ackErrors.Add(1)
	c.log.WarnContext(ctx, "natsin: could not acknowledge a message; it will be delivered again", "error", err)
	return false
}

// Start checks the JetStream consumer (it must be a pull consumer with
// explicit acknowledgements, and Retention must outlast its redelivery
// horizon: see package inbox), then pulls and handles messages in the
// background until ctx ends or Stop is called. It returns
// ErrAlreadyStarted if the consumer is running.
func (c *Consumer) Start(ctx context.Context) error {
	err := c.running.Start(ctx, func(ctx context.Context) error {
		_, err := c.prepare(ctx)
		return err
	}, c.loop)
	if err != nil {
		return fmt.Errorf("natsin: start: %w", err)
	}
	c.log.Info("natsin: consumer started", "stream", c.cfg.Stream, "consumer", c.cfg.Consumer,
		"inbox_consumer", c.in.Config().Consumer, "concurrency", c.cfg.Concurrency)
	return nil
}

// Stop stops a consumer started with Start and returns when it has ended:
// the pull in flight is cancelled, and the messages already received are
// handled and acknowledged first. It does nothing if the consumer is not
// running, and is safe to call more than once.
func (c *Consumer) Stop() { c.running.Stop() }

// loop pulls batch after batch until ctx ends; after a failed pull it waits
// (100 ms, doubling up to 10 s) before the next.
func (c *Consumer) loop(ctx context.Context) {
	defer c.log.Info("natsin: consumer stopped", "stream", c.cfg.Stream, "consumer", c.cfg.Consumer)
	wait := backoff.Policy{Base: 100 * time.Millisecond, Max: 10 * time.Second}
	failures := 0
	for ctx.Err() == nil {
		_, err := c.RunOnce(ctx)
		if err == nil || ctx.Err() != nil {
			failures = 0
			continue
		}
		d := wait.Delay(failures)
		failures++
		c.log.Error("natsin: pull failed", "stream", c.cfg.Stream, "consumer", c.cfg.Consumer, "error", err, "retry_in", d)
		if backoff.Sleep(ctx, d) != nil {
			return
		}
	}
}
