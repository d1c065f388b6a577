// Package fanout runs one call per item with bounded concurrency, for the
// outbox publishers that deliver a batch's messages concurrently.
package fanout

import (
	"context"
	"sync"
)

// Each runs call for every item, at most limit at a time, and returns one
// result per item in item order. Items not started when ctx ends fail with
// ctx's error.
func Each[T any](ctx context.Context, items []T, limit int, call func(context.Context, *T) error) []error {
	errs := make([]error, len(items))
	sem := make(chan struct{}, limit)
	var wg sync.WaitGroup
	for i := range items {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			errs[i] = ctx.Err()
			continue
		}
		wg.Go(func() {
			defer func() { <-sem }()
			errs[i] = call(ctx, &items[i])
		})
	}
	wg.Wait()
	return errs
}
