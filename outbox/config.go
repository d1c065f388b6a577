package outbox

import (
	"log/slog"
	"time"
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
	// of it (the publish deadline); the rest is kept for recording the
	// results and committing. Each message keeps its own outcome: those
	// acknowledged by the deadline are marked published, those still
	// unacknowledged count as failed attempts, and those not yet sent are
	// left for the next batch without an attempt counted. Default: 10
	// seconds.
	PublishTimeout time.Duration

	// MaxAttempts is how many times a message is tried before it is
	// dead-lettered: kept, with dead_at and last_error set, and never
	// published again. Default: 10.
	MaxAttempts int

	// RetryBaseDelay is the backoff before a failed message's second
	// attempt. Each further failure doubles it, up to RetryMaxDelay; the
	// actual wait is drawn uniformly from the upper half of the backoff
	// (equal jitter), so until the backoff reaches RetryMaxDelay no wait is
	// shorter than the one before it. Default: 1 second.
	RetryBaseDelay time.Duration

	// RetryMaxDelay caps the retry wait, a delay a publisher asks for with
	// RetryAfter (a webhook's Retry-After) included. With PublishTimeout
	// and PollInterval it bounds the time between two publish attempts of a
	// message (RelayLimits.RepublishInterval, 10m21s by default), which a
	// broker's deduplication window must cover. Default: 10 minutes.
	RetryMaxDelay time.Duration

	// DisableNotify turns off LISTEN/NOTIFY wake-ups: the relay only polls,
	// every PollInterval. Use it where connections cannot LISTEN, as behind a
	// transaction-pooling PgBouncer. Default: false (listen on a dedicated
	// connection taken from the pool, and poll as a fallback).
	DisableNotify bool
}
