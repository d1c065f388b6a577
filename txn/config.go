package txn

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Config configures a Runner. The zero value is usable; every field states its default.
type Config struct {
	// Workflows is the registry RunWorkflow and Resume take workflows from.
	// Default: an empty registry, so RunWorkflow fails with ErrUnknownWorkflow.
	Workflows *Registry

	// Logger receives replays, key conflicts and mismatches, and keys released
	// after transient errors. Default: slog.Default().
	Logger *slog.Logger

	// MeterProvider receives the runner's metrics (atomicphase.txn.*: see
	// the README's "Operating" section). Default: otel.GetMeterProvider(),
	// a no-op until the service installs an OpenTelemetry SDK.
	MeterProvider metric.MeterProvider

	// TracerProvider receives a span per Run, RunWorkflow and Resume
	// (atomicphase.run, atomicphase.run_workflow, atomicphase.resume).
	// Default: the global provider at each span, a no-op until the service
	// installs an OpenTelemetry SDK.
	TracerProvider trace.TracerProvider

	// ScopeHashKey keys the HMAC that records a scope on spans as
	// atomicphase.scope.hash (the raw scope, a principal, is never
	// recorded). Give every service whose traces should correlate the same
	// secret. Default: a fixed public key, which hides the scope from a
	// casual reader but not from someone able to guess it.
	ScopeHashKey []byte

	// ExpiredKeyPolicy says what a request gets when its key belonged to an
	// operation that finished and was deleted after its TTL (the cleaner
	// leaves a tombstone for cleanup.Config.TombstoneRetention).
	// Default: ExpiredKeyReject: ErrKeyExpired (422), nothing runs.
	ExpiredKeyPolicy ExpiredKeyPolicy

	// HitLogLevel is the level at which replays, in-use conflicts and key
	// reuse are logged. Default: slog.LevelInfo (the zero value).
	HitLogLevel slog.Level

	// LeaseDuration is how long an attempt holds a workflow key before
	// another attempt may take it over; each commit of the attempt extends
	// it, and so does a Foreign phase once half of it has passed since.
	// Make it longer than the slowest Atomic phase, and more than twice the
	// slowest foreign call (a call may start half a lease after the commit
	// that set it).
	// Default: LeaseDurationDefault (90 seconds).
	LeaseDuration time.Duration

	// FailoverKeepsCommits declares that no failover of the database loses
	// a commit the primary acknowledged: every server that can be promoted
	// receives each commit before it is acknowledged (synchronous
	// replication with synchronous_commit on or remote_apply, or storage
	// replicated synchronously), or there is no standby at all. A quorum
	// (ANY n) setup qualifies only if no standby outside the quorum that
	// acknowledged a commit can be promoted. A
	// workflow's first attempt then calls out right after the commit that
	// set its lease. Left false, it first reads the key (one round trip per
	// such Foreign phase) to make sure that commit is still there: after a
	// failover to an asynchronous standby that lost it, the retry runs the
	// lost phase again, possibly with another result, and a call built on
	// the lost one would have sent the provider the same foreign key with
	// other parameters. The attempt's next commit finds a lost commit
	// either way, and commits nothing over it. Default: false.
	FailoverKeepsCommits bool

	// MaxRetries is how many times a phase is retried after a serialization
	// failure (40001) or a deadlock (40P01) before ErrConflict.
	// Default: MaxRetriesDefault (8).
	MaxRetries int

	// RetryBaseDelay is the first retry's backoff; each retry doubles it, up
	// to RetryMaxDelay, with equal jitter: the wait is drawn uniformly
	// between half the backoff and all of it.
	// Default: RetryBaseDelayDefault (2 milliseconds).
	RetryBaseDelay time.Duration

	// RetryMaxDelay caps the retry backoff.
	// Default: RetryMaxDelayDefault (250 milliseconds).
	RetryMaxDelay time.Duration

	// MaxParamsBytes is the largest Key.Params accepted.
	// Default: MaxParamsBytesDefault (1 MiB).
	MaxParamsBytes int

	// WaitWhenInUse makes a call that finds the key held by another live
	// attempt wait for it (bounded by ctx) instead of failing at once with
	// ErrKeyInUse; it then replays the stored response, or takes the key over
	// if the holder's lease expires. Default: false.
	WaitWhenInUse bool

	// WaitPollInterval is how often a waiting call looks at the key again.
	// Default: WaitPollIntervalDefault (50 milliseconds).
	WaitPollInterval time.Duration

	// ReleaseTimeout bounds releasing a key after a transient error, or
	// removing one whose insert may have committed unseen. The release runs
	// on a context detached from the caller's, so a cancelled request still
	// releases its key. Default: ReleaseTimeoutDefault (5 seconds).
	ReleaseTimeout time.Duration

	// MaxAge bounds how long after a key was created (by the database
	// clock) its operation may still be resumed. No attempt takes over a
	// key older than this, whether a client retry, a WaitWhenInUse takeover
	// or a Resume (the recovery Resumer's too), and no Foreign phase calls
	// out for one (a first attempt asks only once it has run for half of
	// MaxAge: its key is younger than itself): the statement that would
	// have taken the key over, or extended its lease before the call,
	// fails it instead, storing a 500
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

// The defaults of Config's fields, used for the fields left zero.
const (
	LeaseDurationDefault    = 90 * time.Second
	MaxRetriesDefault       = 8
	RetryBaseDelayDefault   = 2 * time.Millisecond
	RetryMaxDelayDefault    = 250 * time.Millisecond
	MaxParamsBytesDefault   = 1 << 20
	WaitPollIntervalDefault = 50 * time.Millisecond
	ReleaseTimeoutDefault   = 5 * time.Second
	MaxAgeDefault           = 12 * time.Hour
)

// leaseDurationMin is the shortest Config.LeaseDuration accepted.
const leaseDurationMin = 10 * time.Millisecond

// MaxAgeLimit bounds Config.MaxAge: payment providers keep idempotency keys
// for about 24 hours (Stripe: at least 24), so an operation must never call
// one again after that.
const MaxAgeLimit = 24 * time.Hour

// ExpiredKeyPolicy is what a Runner does with a request whose key has a
// tombstone: it was used for an operation that finished and was cleaned up.
type ExpiredKeyPolicy int

const (
	// ExpiredKeyReject answers ErrKeyExpired (HTTP 422) and runs nothing:
	// a retry that comes after the key's TTL is not taken for a new
	// operation (a second charge). The default.
	ExpiredKeyReject ExpiredKeyPolicy = iota
	// ExpiredKeyNewOperation runs the request as a new operation, with new
	// foreign keys, and logs and counts it (Stats.ExpiredReused): the
	// behaviour of a store without tombstones, as Stripe's.
	ExpiredKeyNewOperation
)

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

// withDefaults returns c with each zero field set to its default.
func (c Config) withDefaults() Config {
	if c.Workflows == nil {
		c.Workflows = NewRegistry()
	}
	c.Logger = cmp.Or(c.Logger, slog.Default())
	c.LeaseDuration = cmp.Or(c.LeaseDuration, LeaseDurationDefault)
	c.MaxRetries = cmp.Or(c.MaxRetries, MaxRetriesDefault)
	c.RetryBaseDelay = cmp.Or(c.RetryBaseDelay, RetryBaseDelayDefault)
	c.RetryMaxDelay = cmp.Or(c.RetryMaxDelay, RetryMaxDelayDefault)
	c.MaxParamsBytes = cmp.Or(c.MaxParamsBytes, MaxParamsBytesDefault)
	c.WaitPollInterval = cmp.Or(c.WaitPollInterval, WaitPollIntervalDefault)
	c.ReleaseTimeout = cmp.Or(c.ReleaseTimeout, ReleaseTimeoutDefault)
	c.MaxAge = cmp.Or(c.MaxAge, MaxAgeDefault)
	if c.Store == nil {
		c.Store = DefaultStore
	}
	return c
}

// validate reports a field outside its documented range, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	switch {
	case c.LeaseDuration < 0 || c.MaxRetries < 0 || c.RetryBaseDelay < 0 || c.RetryMaxDelay < 0 ||
		c.MaxParamsBytes < 0 || c.WaitPollInterval < 0 || c.ReleaseTimeout < 0 || c.MaxAge < 0:
		return fmt.Errorf("%w: negative durations and counts are not allowed", ErrInvalidConfig)
	case c.LeaseDuration < leaseDurationMin:
		return fmt.Errorf("%w: LeaseDuration %v is shorter than %v", ErrInvalidConfig, c.LeaseDuration, leaseDurationMin)
	case c.ExpiredKeyPolicy != ExpiredKeyReject && c.ExpiredKeyPolicy != ExpiredKeyNewOperation:
		return fmt.Errorf("%w: unknown ExpiredKeyPolicy %d", ErrInvalidConfig, c.ExpiredKeyPolicy)
	case c.MaxAge >= MaxAgeLimit:
		return fmt.Errorf("%w: MaxAge %v must be shorter than %v, the payment providers' idempotency window",
			ErrInvalidConfig, c.MaxAge, MaxAgeLimit)
	}
	return nil
}
