package harness

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Op is one operation of a closed-loop benchmark. worker is the calling
// goroutine's index (0..concurrency-1); seq is unique across the run.
type Op func(ctx context.Context, worker int, seq int64) error

// Timing is how long a cell warms up and then measures.
type Timing struct {
	Warmup   time.Duration
	Duration time.Duration
	// Stop, if not nil, ends the window early when it is closed.
	Stop <-chan struct{}
	// OnMeasure, if not nil, is called when the window opens.
	OnMeasure func()
}

// Result summarises one measured cell.
type Result struct {
	Ops        int           // operations completed inside the window
	Errors     int           // operations that failed inside the window
	FirstError error         // the first failure seen, warmup included
	Elapsed    time.Duration // the measurement window
	Latencies  []time.Duration
	RoundTrips float64 // round trips per op counted by the pool's tracer, if any
	// CPUPerOp is the whole machine's busy CPU time over the window divided
	// by the operations in it (0 if unknown); on a quiet machine, the cost
	// of an operation in client, database and broker CPU together.
	CPUPerOp time.Duration
	// WindowStart and WindowEnd bound the measurement window.
	WindowStart, WindowEnd time.Time
}

// Throughput is completed operations per second.
func (r Result) Throughput() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Ops) / r.Elapsed.Seconds()
}

// Percentile returns the p-th percentile latency (0 < p <= 100), nearest rank.
func (r Result) Percentile(p float64) time.Duration {
	return Percentile(r.Latencies, p)
}

// Percentile returns the p-th percentile of sorted (nearest rank).
func Percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	rank = min(max(rank, 1), len(sorted))
	return sorted[rank-1]
}

// Drive runs op from concurrency goroutines back to back: for t.Warmup with
// results discarded, then for t.Duration measured. An operation counts in the
// window if it started inside it. Each goroutine stops at the end of the
// window; ctr (may be nil) counts round trips over the window.
func Drive(ctx context.Context, concurrency int, t Timing, ctr *Counter, op Op) Result {
	var seq atomic.Int64
	var firstErr error
	var errOnce sync.Once
	start := time.Now()
	measureFrom := start.Add(t.Warmup)
	var endNanos atomic.Int64 // the window's end, as nanoseconds after start
	endNanos.Store(int64(t.Warmup + t.Duration))
	done := make(chan struct{})
	defer close(done)
	go func() {
		timer := time.NewTimer(time.Until(measureFrom))
		defer timer.Stop()
		select {
		case <-timer.C:
			if t.OnMeasure != nil {
				t.OnMeasure()
			}
		case <-done:
			return
		}
		if t.Stop == nil {
			return
		}
		select {
		case <-t.Stop:
			endNanos.Store(min(endNanos.Load(), int64(time.Since(start))))
		case <-done:
		}
	}()
	type local struct {
		lat  []time.Duration
		errs int
	}
	locals := make([]local, concurrency)
	var rtStart atomic.Int64
	var cpuStart atomic.Int64
	var rtMarked atomic.Bool
	mark := func() {
		if rtMarked.CompareAndSwap(false, true) {
			rtStart.Store(ctr.RoundTrips())
			cpuStart.Store(int64(machineBusy()))
		}
	}
	var wg sync.WaitGroup
	for w := range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := &locals[w]
			l.lat = make([]time.Duration, 0, 4096)
			for ctx.Err() == nil {
				t0 := time.Now()
				if t0.Sub(start) >= time.Duration(endNanos.Load()) {
					return
				}
				measured := !t0.Before(measureFrom)
				if measured {
					mark()
				}
				err := op(ctx, w, seq.Add(1))
				d := time.Since(t0)
				if err != nil {
					errOnce.Do(func() { firstErr = err })
					if measured {
						l.errs++
					}
					continue
				}
				if measured {
					l.lat = append(l.lat, d)
				}
			}
		}()
	}
	wg.Wait()
	cpuEnd := machineBusy()
	end := start.Add(time.Duration(endNanos.Load()))
	res := Result{Elapsed: end.Sub(measureFrom), FirstError: firstErr, WindowStart: measureFrom, WindowEnd: end}
	for _, l := range locals {
		res.Latencies = append(res.Latencies, l.lat...)
		res.Errors += l.errs
	}
	res.Ops = len(res.Latencies)
	slices.Sort(res.Latencies)
	if res.Ops > 0 && cpuEnd > 0 && cpuStart.Load() > 0 {
		res.CPUPerOp = (cpuEnd - time.Duration(cpuStart.Load())) / time.Duration(res.Ops+res.Errors)
	}
	if ctr != nil && res.Ops > 0 {
		res.RoundTrips = float64(ctr.RoundTrips()-rtStart.Load()) / float64(res.Ops+res.Errors)
	}
	return res
}

// FormatMs formats d in milliseconds with a precision that suits it.
func FormatMs(d time.Duration) string {
	ms := float64(d) / float64(time.Millisecond)
	switch {
	case ms == 0:
		return "-"
	case ms < 10:
		return fmt.Sprintf("%.2f", ms)
	case ms < 100:
		return fmt.Sprintf("%.1f", ms)
	default:
		return fmt.Sprintf("%.0f", ms)
	}
}

// FormatRate formats a per-second rate.
func FormatRate(r float64) string {
	switch {
	case r == 0:
		return "-"
	case r < 100:
		return fmt.Sprintf("%.1f", r)
	default:
		return fmt.Sprintf("%.0f", r)
	}
}
