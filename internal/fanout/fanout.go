// Package fanout publishes the messages of one outbox Publish call with
// bounded concurrency, for the publishers that deliver them concurrently.
package fanout

import (
	"context"
	"fmt"
	"sync"

	"github.com/atomicphase/atomicphase/outbox"
)

// Publish runs call for every message, at most limit at a time, and reports
// each result in res as soon as its call returns. Once ctx is done or the
// relay is stopping it starts no further call and reports outbox.ErrNotSent
// for the messages left; calls already running finish. A panicking call
// fails its own message. Publish returns when every call it started has
// returned.
func Publish(ctx context.Context, msgs []outbox.Envelope, res *outbox.Results, limit int,
	call func(context.Context, *outbox.Envelope) error) {
	sem := make(chan struct{}, max(limit, 1))
	var wg sync.WaitGroup
	defer wg.Wait()
	for i := range msgs {
		if !acquire(ctx, res, sem) {
			res.Set(i, outbox.ErrNotSent)
			continue
		}
		wg.Go(func() {
			defer func() { <-sem }()
			res.Set(i, safeCall(ctx, &msgs[i], call))
		})
	}
}

// acquire takes a slot in sem, unless ctx ends or the relay stops first.
func acquire(ctx context.Context, res *outbox.Results, sem chan struct{}) bool {
	if halted(ctx, res) {
		return false
	}
	select {
	case sem <- struct{}{}:
	case <-ctx.Done():
		return false
	case <-res.Stopping():
		return false
	}
	if halted(ctx, res) { // both were ready and the select chose the slot
		<-sem
		return false
	}
	return true
}

func halted(ctx context.Context, res *outbox.Results) bool {
	if ctx.Err() != nil {
		return true
	}
	select {
	case <-res.Stopping():
		return true
	default:
		return false
	}
}

func safeCall(ctx context.Context, e *outbox.Envelope, call func(context.Context, *outbox.Envelope) error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("publisher panicked: %v", p)
		}
	}()
	return call(ctx, e)
}
