package cleanup

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// The expiry window of idempotency keys: Config.TTL must lie within it.
const (
	// MinTTL is the shortest TTL: a client retrying for a day still gets
	// the stored response.
	MinTTL = 24 * time.Hour
	// MaxTTL is the longest TTL.
	MaxTTL = 7 * 24 * time.Hour
)

// The defaults of Config's fields, used for the fields left zero.
const (
	TTLDefault             = MinTTL
	OutboxRetentionDefault = 7 * 24 * time.Hour
	// TombstoneRetentionDefault is how long a deleted key's tombstone is
	// kept: 30 days, well past any client's retry schedule.
	TombstoneRetentionDefault = 30 * 24 * time.Hour
	BatchSizeDefault          = 1000
	IntervalDefault           = 5 * time.Minute
)

// BatchSizeMax bounds Config.BatchSize.
const BatchSizeMax = 100000

// BatchPauseDefault is Config.BatchPause's default: none, each batch follows
// the previous one at once.
const BatchPauseDefault time.Duration = 0

// BatchPauseMax bounds Config.BatchPause.
const BatchPauseMax = time.Minute

// Config configures a Cleaner. The zero value is usable; every field states
// its default.
type Config struct {
	// Logger receives round summaries, and a warning for each round skipped
	// because another cleaner held the cleanup lock, with snake_case
	// attributes. Default: slog.Default().
	Logger *slog.Logger

	// TracerProvider receives a span per round (atomicphase.cleanup.round,
	// with the rows deleted and whether the round was skipped). Default:
	// the global provider at each round, a no-op until the service installs
	// an OpenTelemetry SDK.
	TracerProvider trace.TracerProvider

	// TTL is how long after it finished a key is kept (and replayed to
	// retries) before it may be deleted. It must be from MinTTL (24 hours)
	// to MaxTTL (7 days): the published expiry policy.
	// Default: TTLDefault (24 hours).
	TTL time.Duration

	// OutboxRetention is how long after it was published or dead-lettered
	// an outbox message is kept before it may be deleted.
	// Default: OutboxRetentionDefault (7 days).
	OutboxRetention time.Duration

	// TombstoneRetention is how long a tombstone is kept for each deleted
	// key, written in the same statement as the deletion: until then a
	// request reusing the key is answered per txn.Config.ExpiredKeyPolicy
	// (by default txn.ErrKeyExpired, 422) instead of running as a new
	// operation; after it, the cleaner deletes the tombstone and the key is
	// free. Default: TombstoneRetentionDefault (30 days).
	TombstoneRetention time.Duration

	// BatchSize is the most rows one delete transaction removes, at most
	// BatchSizeMax (100,000). Default: BatchSizeDefault (1000).
	BatchSize int

	// Interval is the time between the starts of two rounds run by Start.
	// Default: IntervalDefault (5 minutes).
	Interval time.Duration

	// BatchPause is how long a round waits before each delete transaction
	// after its first, so that a large backlog is deleted at a bounded pace
	// rather than back to back on one server connection; a round stopped
	// during a pause stops at once. At most BatchPauseMax (1 minute).
	// Default: BatchPauseDefault (no pause).
	BatchPause time.Duration
}

// withDefaults returns c with each zero field set to its default.
func (c Config) withDefaults() Config {
	c.Logger = cmp.Or(c.Logger, slog.Default())
	c.TTL = cmp.Or(c.TTL, TTLDefault)
	c.OutboxRetention = cmp.Or(c.OutboxRetention, OutboxRetentionDefault)
	c.TombstoneRetention = cmp.Or(c.TombstoneRetention, TombstoneRetentionDefault)
	c.BatchSize = cmp.Or(c.BatchSize, BatchSizeDefault)
	c.Interval = cmp.Or(c.Interval, IntervalDefault)
	c.BatchPause = cmp.Or(c.BatchPause, BatchPauseDefault)
	return c
}

// validate reports a field outside its documented range, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	switch {
	case c.TTL < 0 || c.OutboxRetention < 0 || c.TombstoneRetention < 0 || c.BatchSize < 0 || c.Interval < 0 || c.BatchPause < 0:
		return fmt.Errorf("%w: negative durations and counts are not allowed", ErrInvalidConfig)
	case c.TTL < MinTTL || c.TTL > MaxTTL:
		return fmt.Errorf("%w: TTL %v is outside the expiry window of %v to %v", ErrInvalidConfig, c.TTL, MinTTL, MaxTTL)
	case c.BatchSize > BatchSizeMax:
		return fmt.Errorf("%w: BatchSize %d is larger than %d", ErrInvalidConfig, c.BatchSize, BatchSizeMax)
	case c.BatchPause > BatchPauseMax:
		return fmt.Errorf("%w: BatchPause %v is longer than %v", ErrInvalidConfig, c.BatchPause, BatchPauseMax)
	}
	return nil
}
