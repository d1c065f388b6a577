package txn

import (
	"log/slog"
	"time"
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
