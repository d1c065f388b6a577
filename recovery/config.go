package recovery

import (
	"log/slog"
	"time"
)

// Config configures a Resumer. The zero value is usable; every field states
// its default. The lease a resume holds, the maximum age of a key and the
// workflows are the runner's (txn.Config): one setting for the request path
// and for recovery.
type Config struct {
	// Logger receives failed keys (with snake_case attributes) and round
	// summaries of Start. Default: the runner's logger.
	Logger *slog.Logger

	// ResumeDelay is how long after its last run a running key with a free
	// or expired lease counts as stalled. Keep it longer than a client's
	// retry window, so that clients get the first chance to retry.
	// Default: 1 minute.
	ResumeDelay time.Duration

	// MaxAttempts is how many attempts (first run, retries and resumes) a
	// key gets; a stalled key that has had that many is failed with
	// ReasonMaxAttempts. Default: 10.
	MaxAttempts int

	// UnknownWorkflowDelay fails stalled keys whose workflow is not in the
	// runner's registry (and running single-phase keys, which cannot be
	// resumed) once they were created longer ago than this, with
	// ReasonUnknownWorkflow. Younger ones are left for a resumer that has
	// the workflow. Default: 1 hour.
	UnknownWorkflowDelay time.Duration

	// BatchSize is how many keys one statement fails or claims, at most
	// 10,000. Default: 100.
	BatchSize int

	// Concurrency is how many keys are resumed in parallel. Default: 4.
	Concurrency int

	// Interval is the time between the starts of two rounds run by Start.
	// Default: 30 seconds.
	Interval time.Duration
}
