package recovery

import (
	"cmp"
	"fmt"
	"log/slog"
	"math"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// The defaults of Config's fields, used for the fields left zero.
const (
	ResumeDelayDefault          = time.Minute
	MaxAttemptsDefault          = 10
	UnknownWorkflowDelayDefault = time.Hour
	BatchSizeDefault            = 100
	ConcurrencyDefault          = 4
	IntervalDefault             = 30 * time.Second
)

// BatchSizeMax bounds Config.BatchSize.
const BatchSizeMax = 10000

// Config configures a Resumer. The zero value is usable; every field states
// its default. The lease a resume holds, the maximum age of a key and the
// workflows are the runner's (txn.Config): one setting for the request path
// and for recovery.
type Config struct {
	// Logger receives failed keys (with snake_case attributes) and round
	// summaries of Start. Default: the runner's logger.
	Logger *slog.Logger

	// TracerProvider receives a span per round (atomicphase.recovery.round,
	// with atomicphase.resumed and atomicphase.failed), the parent of the
	// runner's atomicphase.resume spans. Default: the global provider at
	// each round, a no-op until the service installs an OpenTelemetry SDK.
	TracerProvider trace.TracerProvider

	// ResumeDelay is how long after its last run a running key with a free
	// or expired lease counts as stalled. Keep it longer than a client's
	// retry window, so that clients get the first chance to retry.
	// Default: ResumeDelayDefault (1 minute).
	ResumeDelay time.Duration

	// MaxAttempts is how many attempts (first run, retries and resumes) a
	// key gets; a stalled key that has had that many is failed with
	// ReasonMaxAttempts. Default: MaxAttemptsDefault (10).
	MaxAttempts int

	// UnknownWorkflowDelay fails stalled keys whose workflow is not in the
	// runner's registry (and running single-phase keys, which cannot be
	// resumed) once they were created longer ago than this, with
	// ReasonUnknownWorkflow. Younger ones are left for a resumer that has
	// the workflow. Default: UnknownWorkflowDelayDefault (1 hour).
	UnknownWorkflowDelay time.Duration

	// BatchSize is how many keys one statement fails or claims, at most
	// BatchSizeMax (10,000). Default: BatchSizeDefault (100).
	BatchSize int

	// Concurrency is how many keys are resumed in parallel.
	// Default: ConcurrencyDefault (4).
	Concurrency int

	// Interval is the time between the starts of two rounds run by Start.
	// Default: IntervalDefault (30 seconds).
	Interval time.Duration
}

// withDefaults returns c with each zero field set to its default; logger is
// the runner's.
func (c Config) withDefaults(logger *slog.Logger) Config {
	c.Logger = cmp.Or(c.Logger, logger)
	c.ResumeDelay = cmp.Or(c.ResumeDelay, ResumeDelayDefault)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, MaxAttemptsDefault)
	c.UnknownWorkflowDelay = cmp.Or(c.UnknownWorkflowDelay, UnknownWorkflowDelayDefault)
	c.BatchSize = cmp.Or(c.BatchSize, BatchSizeDefault)
	c.Concurrency = cmp.Or(c.Concurrency, ConcurrencyDefault)
	c.Interval = cmp.Or(c.Interval, IntervalDefault)
	return c
}

// validate reports a field outside its documented range, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	switch {
	case c.ResumeDelay < 0 || c.MaxAttempts < 0 || c.UnknownWorkflowDelay < 0 ||
		c.BatchSize < 0 || c.Concurrency < 0 || c.Interval < 0:
		return fmt.Errorf("%w: negative durations and counts are not allowed", ErrInvalidConfig)
	case c.MaxAttempts > math.MaxInt32:
		return fmt.Errorf("%w: MaxAttempts %d is too large", ErrInvalidConfig, c.MaxAttempts)
	case c.BatchSize > BatchSizeMax:
		return fmt.Errorf("%w: BatchSize %d is larger than %d", ErrInvalidConfig, c.BatchSize, BatchSizeMax)
	}
	return nil
}
