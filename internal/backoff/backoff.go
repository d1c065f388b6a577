// Package backoff computes how long a retry loop waits: exponential backoff
// from a base, doubled per retry and capped, with or without jitter. It
// serves every retry loop of the module: txn's phase retries after
// serialization failures, and the outbox relay's message retries, its loop
// after failed batches and its listener's reconnects.
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Jitter says how a wait is drawn from the backoff.
type Jitter int

const (
	// None waits exactly the backoff.
	None Jitter = iota
	// Equal waits a duration drawn uniformly from half the backoff to all
	// of it, so waits are spread out, yet until the backoff reaches Max no
	// wait is shorter than the one before it (each is at least the
	// previous backoff).
	Equal
)

// Policy is exponential backoff. The zero value waits nothing.
type Policy struct {
	// Base is the backoff before the first retry.
	Base time.Duration
	// Max caps the backoff.
	Max time.Duration
	// Jitter says how the wait is drawn from the backoff.
	Jitter Jitter
}

// Backoff returns the backoff before retry n (0 for the first retry): Base
// doubled n times, capped at Max. It never overflows.
func (p Policy) Backoff(n int) time.Duration {
	d := p.Max
	n = max(n, 0)
	if n < 62 {
		if b := p.Base << n; b >= 0 && b>>n == p.Base && b < d {
			d = b
		}
	}
	return max(d, 0)
}

// Delay returns the wait before retry n (0 for the first retry): Backoff(n),
// jittered as the policy says.
func (p Policy) Delay(n int) time.Duration {
	d := p.Backoff(n)
	if p.Jitter == Equal {
		half := d / 2
		return half + rand.N(d-half+1)
	}
	return d
}

// Sleep waits d, or until ctx ends and then returns ctx's error: the wait
// of a retry loop that a caller's cancellation must cut short.
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
