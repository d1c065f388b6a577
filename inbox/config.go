package inbox

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"
)

// The defaults of Config's fields, used for the fields left zero. The retry
// settings are txn's, for the same reason: a handler's transaction is a
// phase of the consumer.
const (
	// RetentionDefault is as long as the outbox keeps relayed and
	// dead-lettered messages (cleanup's default), so a message redriven
	// from the outbox's dead letters is still recognised.
	RetentionDefault      = 7 * 24 * time.Hour
	MaxRetriesDefault     = 8
	RetryBaseDelayDefault = 2 * time.Millisecond
	RetryMaxDelayDefault  = 250 * time.Millisecond
)

// RetentionMin bounds Config.Retention from below.
const RetentionMin = time.Second

// Config configures an Inbox. Every field but Consumer has a default.
type Config struct {
	// Consumer names the consumer: the service, or the part of it, that
	// handles the messages. (Consumer, message id) is the deduplication
	// key, so consumers that share the table never see each other's rows,
	// and two consumers of one stream each handle every message once.
	// 1 to MaxMessageIDBytes bytes of printable ASCII. Required.
	Consumer string

	// Logger receives redeliveries acknowledged without running the
	// handler (at DuplicateLogLevel) and dead letters (WARN), with
	// snake_case attribute keys. Default: slog.Default().
	Logger *slog.Logger

	// DuplicateLogLevel is the level at which a redelivered message,
	// acknowledged without running the handler, is logged. A high rate of
	// them is the first sign of acknowledgements being lost. Default:
	// slog.LevelInfo (the zero value).
	DuplicateLogLevel slog.Level

	// Retention is how long a handled message's row is kept, from when it
	// was handled, before the cleaner may delete it; a redelivery after that
	// would run the handler again. It must be longer than the broker's (or
	// the sender's) redelivery horizon, which the adapters check when they
	// start, and at least RetentionMin. It applies to rows written from then
	// on. Default: RetentionDefault (7 days).
	Retention time.Duration

	// MaxRetries is how many times a handler's transaction is retried
	// after a serialization failure (40001) or a deadlock (40P01) before
	// Handle gives up with ErrConflict. Default: MaxRetriesDefault (8).
	MaxRetries int

	// RetryBaseDelay is the first retry's backoff; each retry doubles it,
	// up to RetryMaxDelay, with equal jitter (drawn uniformly between half
	// the backoff and all of it). Default: RetryBaseDelayDefault (2 ms).
	RetryBaseDelay time.Duration

	// RetryMaxDelay caps the retry backoff.
	// Default: RetryMaxDelayDefault (250 ms).
	RetryMaxDelay time.Duration
}

// withDefaults returns c with each zero field set to its default.
func (c Config) withDefaults() Config {
	c.Logger = cmp.Or(c.Logger, slog.Default())
	c.Retention = cmp.Or(c.Retention, RetentionDefault)
	c.MaxRetries = cmp.Or(c.MaxRetries, MaxRetriesDefault)
	c.RetryBaseDelay = cmp.Or(c.RetryBaseDelay, RetryBaseDelayDefault)
	c.RetryMaxDelay = cmp.Or(c.RetryMaxDelay, RetryMaxDelayDefault)
	return c
}

// validate reports a field outside its documented range, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	if reason := checkText(c.Consumer); reason != "" {
		return fmt.Errorf("%w: Consumer %q: %s", ErrInvalidConfig, c.Consumer, reason)
	}
	switch {
	case c.Retention < 0, c.MaxRetries < 0, c.RetryBaseDelay < 0, c.RetryMaxDelay < 0:
		return fmt.Errorf("%w: negative durations and counts are not allowed", ErrInvalidConfig)
	case c.Retention < RetentionMin:
		return fmt.Errorf("%w: Retention %v is shorter than %v", ErrInvalidConfig, c.Retention, RetentionMin)
	case c.RetryMaxDelay < c.RetryBaseDelay:
		return fmt.Errorf("%w: RetryMaxDelay %v is less than RetryBaseDelay %v", ErrInvalidConfig, c.RetryMaxDelay, c.RetryBaseDelay)
	}
	return nil
}
