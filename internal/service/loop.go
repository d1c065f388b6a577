// Package service runs the background rounds of atomicphase's services
// (recovery.Resumer, cleanup.Cleaner): a round at once, then one every
// interval, in a goroutine, until stopped.
package service

import (
	"context"
	"sync"
	"time"
)

// Loop is a restartable background loop. The zero value is ready to use.
type Loop struct {
	mu     sync.Mutex
	cancel context.CancelFunc
	done   chan struct{}
}

// Start runs round at once and then every interval, until ctx ends or Stop
// is called. It returns false, and starts nothing, if the loop is running.
func (l *Loop) Start(ctx context.Context, interval time.Duration, round func(ctx context.Context)) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cancel != nil {
		return false
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	l.cancel, l.done = cancel, done
	go func() {
		defer close(done)
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
	}()
	return true
}

// Stop cancels the running round's context and returns when the loop has
// ended. It does nothing if the loop is not running.
func (l *Loop) Stop() {
	l.mu.Lock()
	cancel, done := l.cancel, l.done
	l.cancel, l.done = nil, nil
	l.mu.Unlock()
	if cancel == nil {
		return
	}
	cancel()
	<-done
}
