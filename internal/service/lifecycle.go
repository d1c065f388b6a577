// Package service is the base of atomicphase's background services
// (outbox.Relay, recovery.Resumer, cleanup.Cleaner): one Start/Stop
// lifecycle, the loop that runs a round at once and then every interval,
// and the helpers their rounds share.
package service

import (
	"context"
	"errors"
	"runtime/pprof"
	"sync"
	"time"
)

// RunLabel is the pprof label set on a service's goroutine for as long as
// its run function runs (value "run"): goroutine and CPU profiles show which
// goroutines are service loops, and a goroutine that has returned from its
// run but not yet exited no longer carries it.
const RunLabel = "atomicphase_service"

// ErrAlreadyStarted: Start was called on a service that is running. Each
// service package exports it under the same name, so errors.Is matches it
// whichever package's name a caller uses.
var ErrAlreadyStarted = errors.New("already started")

// Lifecycle starts a service's background work and stops it. The zero value
// is ready to use; it is safe for concurrent use.
type Lifecycle struct {
	mu     sync.Mutex
	cancel context.CancelFunc
	done   chan struct{} // closed when the running run returns
}

// Start runs run in a goroutine, on a context that ends when ctx ends or
// Stop is called. It returns ErrAlreadyStarted, and starts nothing, while an
// earlier run has not returned; a run that ended with its context may be
// started again. prepare, when not nil, runs first with ctx (and with
// concurrent Starts held back), and an error from it is returned with
// nothing started.
func (l *Lifecycle) Start(ctx context.Context, prepare func(context.Context) error, run func(context.Context)) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done != nil {
		select {
		case <-l.done:
		default:
			return ErrAlreadyStarted
		}
	}
	if prepare != nil {
		if err := prepare(ctx); err != nil {
			return err
		}
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	l.cancel, l.done = cancel, done
	go func() {
		defer close(done)
		defer cancel()
		pprof.Do(runCtx, pprof.Labels(RunLabel, "run"), run)
	}()
	return nil
}

// Stop cancels the running run's context and returns when run has returned.
// It does nothing if no run was started, and is safe to call more than once.
func (l *Lifecycle) Stop() {
	l.mu.Lock()
	cancel, done := l.cancel, l.done
	l.mu.Unlock()
	if cancel == nil {
		return
	}
	cancel()
	<-done
}

// Every returns a run function for Start that calls round at once and then
// every interval (between the starts of two rounds, or at once after a
// round that took longer), until its context ends.
func Every(interval time.Duration, round func(context.Context)) func(context.Context) {
	return func(ctx context.Context) {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			round(ctx)
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}
}
