package service

import (
	"context"
	"fmt"
	"time"
)

// BatchGrace is how long a batch in flight when a round's context ends may
// take to finish before it is cancelled (and rolled back).
const BatchGrace = 5 * time.Second

// InBatch runs one batch on a context that outlives ctx by up to
// BatchGrace, so that a stop lets the batch in flight finish and the round's
// report counts exactly what was committed; a cancelled statement would race
// its own commit acknowledgement.
func InBatch(ctx context.Context, fn func(context.Context) error) error {
	bctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	stop := context.AfterFunc(ctx, func() {
		t := time.NewTimer(BatchGrace)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-bctx.Done():
		}
	})
	defer stop()
	return fn(bctx)
}

// Wrap names the package and op in err ("pkg: op: err"), and reports ctx's
// error instead when ctx ended, so that callers can tell a stop from a
// failure with errors.Is.
func Wrap(ctx context.Context, pkg, op string, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%s: %s: %w", pkg, op, cerr)
	}
	return fmt.Errorf("%s: %s: %w", pkg, op, err)
}
