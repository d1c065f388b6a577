package txn

import "github.com/atomicphase/atomicphase/internal/backoff"

// RetryPolicy exposes the backoff of a runner's phase retries to tests.
func RetryPolicy(r *Runner) backoff.Policy { return r.retry }

// ConfigOf exposes a runner's configuration, defaults filled in, to tests.
func ConfigOf(r *Runner) Config { return r.cfg }
