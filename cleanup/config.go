package cleanup

import (
	"log/slog"
	"time"
)

// The expiry window of idempotency keys: Config.TTL must lie within it.
const (
	// MinTTL is the shortest TTL: a client retrying for a day still gets
	// the stored response.
	MinTTL = 24 * time.Hour
	// MaxTTL is the longest TTL.
	MaxTTL = 7 * 24 * time.Hour
)

// Config configures a Cleaner. The zero value is usable; every field states
// its default.
type Config struct {
	// Logger receives round summaries, and a warning for each round skipped
	// because another cleaner held the cleanup lock, with snake_case
	// attributes. Default: slog.Default().
	Logger *slog.Logger

	// TTL is how long after it finished a key is kept (and replayed to
	// retries) before it may be deleted. It must be from MinTTL (24 hours)
	// to MaxTTL (7 days): the published expiry policy. Default: 24 hours.
	TTL time.Duration

	// OutboxRetention is how long after it was published or dead-lettered
	// an outbox message is kept before it may be deleted. Default: 7 days.
	OutboxRetention time.Duration

	// BatchSize is the most rows one delete transaction removes, at most
	// 100,000. Default: 1000.
	BatchSize int

	// Interval is the time between the starts of two rounds run by Start.
	// Default: 5 minutes.
	Interval time.Duration
}
