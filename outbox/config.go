package outbox

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// The defaults of Config's fields, used for the fields left zero.
const (
	BatchSizeDefault      = 100
	PollIntervalDefault   = time.Second
	PublishTimeoutDefault = 10 * time.Second
	MaxAttemptsDefault    = 10
	RetryBaseDelayDefault = time.Second
	RetryMaxDelayDefault  = 10 * time.Minute
)

// BatchSizeMax bounds Config.BatchSize.
const BatchSizeMax = 10000

// Config configures a Relay. The zero value is usable; every field states
// its default.
type Config struct {
	// Logger receives failed publishes, dead letters and relay errors, with
	// snake_case attribute keys. Default: slog.Default().
	Logger *slog.Logger

	// MeterProvider receives the relay's metrics (atomicphase.outbox.*: see
	// the README's "Operating" section). Default: otel.GetMeterProvider(),
	// a no-op until the service installs an OpenTelemetry SDK.
	MeterProvider metric.MeterProvider

	// TracerProvider receives a span per batch (atomicphase.outbox.relay_batch)
	// and one per publish ("publish <topic>", linked to the trace that
	// staged the message). Default: the global provider at each batch, a
	// no-op until the service installs an OpenTelemetry SDK.
	TracerProvider trace.TracerProvider

	// BatchSize is the most messages one claim transaction takes, at most
	// BatchSizeMax. Default: BatchSizeDefault (100).
	BatchSize int

	// PollInterval is how often an idle relay looks for messages when no
	// notification wakes it (and always, with DisableNotify). An idle relay
	// also wakes when the earliest retry or delayed message falls due.
	// Default: PollIntervalDefault (1 second).
	PollInterval time.Duration

	// PublishTimeout is the longest a claim transaction stays open, and so
	// the longest a batch's rows stay locked. Publishing gets three quarters
	// of it (the publish deadline); the rest is kept for recording the
	// results and committing. Each message keeps its own outcome: those
	// acknowledged by the deadline are marked published, those still
	// unacknowledged count as failed attempts, and those not yet sent are
	// left for the next batch without an attempt counted.
	// Default: PublishTimeoutDefault (10 seconds).
	PublishTimeout time.Duration

	// MaxAttempts is how many times a message is tried before it is
	// dead-lettered: kept, with dead_at and last_error set, and never
	// published again. Default: MaxAttemptsDefault (10).
	MaxAttempts int

	// RetryBaseDelay is the backoff before a failed message's second
	// attempt. Each further failure doubles it, up to RetryMaxDelay; the
	// actual wait is drawn uniformly from the upper half of the backoff
	// (equal jitter), so until the backoff reaches RetryMaxDelay no wait is
	// shorter than the one before it.
	// Default: RetryBaseDelayDefault (1 second).
	RetryBaseDelay time.Duration

	// RetryMaxDelay caps the retry wait, a delay a publisher asks for with
	// RetryAfter (a webhook's Retry-After) included. With PublishTimeout
	// and PollInterval it bounds the time between two publish attempts of a
	// message (RelayLimits.RepublishInterval, 10m21s by default), which a
	// broker's deduplication window must cover.
	// Default: RetryMaxDelayDefault (10 minutes).
	RetryMaxDelay time.Duration

	// DisableNotify turns off LISTEN/NOTIFY wake-ups: the relay only polls,
	// every PollInterval (and wakes on Wake). Use it where connections
	// cannot LISTEN or hold a session lock, as behind a transaction-pooling
	// PgBouncer. Default: false (listen on a dedicated connection taken from
	// the pool, hold the idle lock on a second one while idle, so that
	// producers notify only then, and poll as a fallback).
	DisableNotify bool
}

// withDefaults returns c with each zero field set to its default.
func (c Config) withDefaults() Config {
	c.Logger = cmp.Or(c.Logger, slog.Default())
	c.BatchSize = cmp.Or(c.BatchSize, BatchSizeDefault)
	c.PollInterval = cmp.Or(c.PollInterval, PollIntervalDefault)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, PublishTimeoutDefault)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, MaxAttemptsDefault)
	c.RetryBaseDelay = cmp.Or(c.RetryBaseDelay, RetryBaseDelayDefault)
	c.RetryMaxDelay = cmp.Or(c.RetryMaxDelay, RetryMaxDelayDefault)
	return c
}

// validate reports a field outside its documented range, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	switch {
	case c.BatchSize < 0, c.BatchSize > BatchSizeMax:
		return fmt.Errorf("%w: BatchSize %d is not between 1 and %d", ErrInvalidConfig, c.BatchSize, BatchSizeMax)
	case c.PollInterval < 0:
		return fmt.Errorf("%w: negative PollInterval", ErrInvalidConfig)
	case c.PublishTimeout < 0:
		return fmt.Errorf("%w: negative PublishTimeout", ErrInvalidConfig)
	case c.MaxAttempts < 0:
		return fmt.Errorf("%w: negative MaxAttempts", ErrInvalidConfig)
	case c.RetryBaseDelay < 0, c.RetryMaxDelay < 0:
		return fmt.Errorf("%w: negative retry delay", ErrInvalidConfig)
	case c.RetryMaxDelay < c.RetryBaseDelay:
		return fmt.Errorf("%w: RetryMaxDelay %v is less than RetryBaseDelay %v",
			ErrInvalidConfig, c.RetryMaxDelay, c.RetryBaseDelay)
	}
	return nil
}
