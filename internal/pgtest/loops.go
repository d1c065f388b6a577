package pgtest

import (
	"bytes"
	"context"
	"runtime/pprof"
	"strings"
	"testing"

	"github.com/atomicphase/atomicphase/internal/service"
)

// loopLabel is the pprof label key WithLoopLabel sets.
const loopLabel = "pgtest_loop"

// WithLoopLabel returns ctx, and calls start with a context, in a goroutine
// labelled with tb's name: a background service started inside start (its
// Start(ctx) call) runs its loop in a goroutine that inherits the label, so
// that LoopsRunning can find it.
func WithLoopLabel(tb testing.TB, ctx context.Context, start func(context.Context)) {
	tb.Helper()
	pprof.Do(ctx, pprof.Labels(loopLabel, tb.Name()), start)
}

// LoopsRunning counts the goroutines labelled by WithLoopLabel for tb that
// still run a background service's loop (internal/service.Lifecycle labels
// its goroutine with service.RunLabel while the run runs). A service's Stop
// returns once its loop has returned, so after Stop this is 0 at once: a
// test asserts "no round after Stop" without waiting. (A goroutine that has
// closed its done channel but not yet exited carries the test's label and
// the Lifecycle frame, but no longer the run label; goroutines a round
// starts, such as the pool's connection dials, inherit both labels but not
// the Lifecycle frame. Only a block with all three is a loop.)
func LoopsRunning(tb testing.TB) int {
	tb.Helper()
	var buf bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&buf, 1); err != nil {
		tb.Fatalf("pgtest: goroutine profile: %v", err)
	}
	label := `"` + loopLabel + `":"` + tb.Name() + `"`
	running := `"` + service.RunLabel + `":"run"`
	n := 0
	// debug=1 groups identical goroutines into blocks separated by blank
	// lines: "N @ pcs", "# labels: {...}", then one "#\tpc\tfunc\tfile" per
	// frame.
	for block := range strings.SplitSeq(buf.String(), "\n\n") {
		if strings.Contains(block, label) && strings.Contains(block, running) &&
			strings.Contains(block, "internal/service.(*Lifecycle).Start") {
			n++
		}
	}
	return n
}
