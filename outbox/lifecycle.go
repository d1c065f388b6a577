package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/atomicphase/atomicphase/internal/pgerr"
)

// RunOnce claims one batch of publishable messages, publishes it, records
// the outcome and commits, and returns how many messages it published.
// It returns 0 and no error when nothing is due.
//
// Cancelling ctx stops the batch gracefully: no further message is sent,
// the messages in flight keep until the publish deadline to be
// acknowledged, every acknowledgement is recorded, and the messages not
// sent are left as they were, without counting an attempt. The database
// work runs to completion, bounded by PublishTimeout. If ctx is done
// already, RunOnce returns its error at once.
func (r *Relay) RunOnce(ctx context.Context) (int, error) {
	if err := r.prepare(ctx, false); err != nil {
		return 0, fmt.Errorf("outbox: prepare publisher: %w", err)
	}
	b, err := r.runBatch(ctx)
	return b.published, err
}

// Start runs the relay in the background until ctx is done or Stop is
// called: it relays batches back to back while there is work, then waits for
// a notification, the earliest retry falling due, or PollInterval. It
// returns ErrAlreadyStarted if the relay is running; one whose ctx ended may
// be started again. A publisher that implements Preparer is checked first;
// Start fails with its error.
func (r *Relay) Start(ctx context.Context) error {
	err := r.life.Start(ctx, func(ctx context.Context) error {
		if err := r.prepare(ctx, true); err != nil {
			return fmt.Errorf("prepare publisher: %w", err)
		}
		return nil
	}, r.run)
	if err != nil {
		return fmt.Errorf("outbox: start: %w", err)
	}
	r.log.Info("outbox: relay started",
		"batch_size", r.cfg.BatchSize,
		"poll_interval", r.cfg.PollInterval,
		"notify", !r.cfg.DisableNotify)
	return nil
}

// Stop stops a relay started with Start and waits for it, at most about
// PublishTimeout: a batch in flight sends no further message, waits for the
// acknowledgements of those in flight (until its publish deadline), records
// them and commits, so a graceful stop publishes nothing twice. Stop is safe
// to call more than once, and on a relay that was never started.
func (r *Relay) Stop() { r.life.Stop() }

// run is the background service: the loop, and the listener that wakes it.
func (r *Relay) run(ctx context.Context) {
	var wg sync.WaitGroup
	if !r.cfg.DisableNotify {
		wg.Go(func() { r.listen(ctx) })
	}
	wg.Go(func() { r.loop(ctx) })
	wg.Wait()
}

// loop is the background service. A full batch is followed at once by the
// next one, any other non-empty batch after wakeCooldown. After an empty one
// the relay announces itself idle (takes the idle lock, so that producers
// notify from then on, once the producers that did not have committed), runs
// one more batch to find what they committed, and if that is empty waits,
// still announced, for a wake-up (a notification, Wake, or the listener's
// start), the next retry or delayed message falling due, or PollInterval; it
// leaves the idle state before its next batch. Wake-ups are taken at most
// once per wakeCooldown, so that a stream of committing transactions, each
// notifying every idle relay, costs each relay a bounded number of claims
// rather than one per commit.
func (r *Relay) loop(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	defer r.log.Info("outbox: relay stopped")
	defer r.closeIdleConn()
	failures := 0      // consecutive failed batches
	announced := false // this relay holds the idle lock
	for {
		started := time.Now()
		b, err := r.runBatch(ctx)
		if ctx.Err() != nil {
			return
		}
		if announced && (err != nil || b.claimed > 0) {
			r.leaveIdle(ctx)
			announced = false
		}
		var wait time.Duration
		switch {
		case err != nil:
			r.logBatchError(err)
			wait = loopErrorBackoff.Delay(failures)
			failures++
		case b.claimed >= r.cfg.BatchSize:
			failures = 0
			continue // a backlog: keep going
		case b.claimed > 0:
			// Look again shortly: the batch may have released held-back
			// messages, and a short retry may already be due.
			failures = 0
			wait = wakeCooldown
		default:
			failures = 0
			if !announced {
				switch r.announceIdle(ctx) {
				case idleAnnounced:
					announced = true
					continue // find what producers that did not notify committed
				case idleBusy:
					wait = wakeCooldown
				}
				if ctx.Err() != nil {
					return
				}
			}
			if wait == 0 {
				wait = r.cfg.PollInterval
			}
			if b.nextDue >= 0 {
				// A millisecond late, so the database clock has passed it.
				wait = min(wait, max(b.nextDue-time.Since(started), 0)+time.Millisecond)
			}
		}
		if r.testHookIdle != nil {
			r.testHookIdle()
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		case <-r.wake:
			if rest := wakeCooldown - time.Since(started); rest > 0 {
				timer.Reset(rest)
				select {
				case <-ctx.Done():
					return
				case <-timer.C:
				}
			}
		}
		if announced {
			r.leaveIdle(ctx)
			announced = false
		}
	}
}

func (r *Relay) logBatchError(err error) {
	switch {
	case errors.Is(err, context.Canceled):
	case pgerr.IsUndefinedTable(err):
		r.log.Error("outbox: relay: outbox table missing; apply the migrations", "error", err)
	case pgerr.IsConnection(err):
		r.log.Warn("outbox: relay: database unavailable", "error", err)
	default:
		r.log.Error("outbox: relay: batch failed", "error", err)
	}
}
