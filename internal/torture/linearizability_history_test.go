package torture

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// Recording TestLinearizability's history, counting its outcomes, and
// showing a history that failed.

// historyRecorder collects the operations of a history, safe for
// concurrent use.
type historyRecorder struct {
	start time.Time
	mu    sync.Mutex
	ops   []porcupine.Operation
	seen  map[string]linKey
}

func newHistoryRecorder() *historyRecorder {
	return &historyRecorder{start: time.Now(), seen: map[string]linKey{}}
}

// record runs call and appends it to the history; an indeterminate one
// stays pending forever.
func (r *historyRecorder) record(client int, key linKey, c keyedCall, call func() keyedResult) keyedResult {
	called := time.Since(r.start).Nanoseconds()
	res := call()
	returned := time.Since(r.start).Nanoseconds()
	if res.Outcome == outIndeterminate {
		returned = pendingForever
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops = append(r.ops, porcupine.Operation{ClientId: client, Input: c, Call: called, Output: res, Return: returned})
	if claimed, ok := claimOf(res); ok && c.Kind == callWorkflow {
		claim := keyedCall{Key: c.Key, Kind: callClaim, Variant: c.Variant}
		r.ops = append(r.ops, porcupine.Operation{ClientId: client, Input: claim, Call: called, Output: claimed, Return: returned})
	}
	r.seen[key.name] = key
	return res
}

// claimOf is the outcome of the first commit (callClaim) of a workflow call
// that returned res, if it may have made one.
func claimOf(res keyedResult) (keyedResult, bool) {
	switch {
	case res.Outcome == outAnswered && !res.Replayed:
		return keyedResult{Outcome: outClaimed}, true
	case res.Outcome == outIndeterminate:
		return res, true
	}
	return keyedResult{}, false
}

func (r *historyRecorder) history() []porcupine.Operation {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.ops)
}

// keys are the keys called so far, by name.
func (r *historyRecorder) keys() []linKey {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.SortedFunc(maps.Values(r.seen), func(a, b linKey) int { return strings.Compare(a.name, b.name) })
}

// counter counts outcomes and faults by label, safe for concurrent use.
type counter struct {
	mu      sync.Mutex
	n       map[string]int
	samples map[string][]string
}

func (c *counter) add(label string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[label]++
}

// sample counts label and keeps the first few errors under it.
func (c *counter) sample(label string, err error) {
	c.add(label)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.samples == nil {
		c.samples = map[string][]string{}
	}
	if len(c.samples[label]) < 3 {
		c.samples[label] = append(c.samples[label], err.Error())
	}
}

func (c *counter) get(label string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[label]
}

func (c *counter) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	for _, label := range slices.Sorted(maps.Keys(c.n)) {
		fmt.Fprintf(&b, "\n  %-45s %6d", label, c.n[label])
		for _, s := range c.samples[label] {
			fmt.Fprintf(&b, "\n      e.g. %s", s)
		}
	}
	return b.String()
}

// describeOps lists one key's operations in the order they were called.
func describeOps(ops []porcupine.Operation) string {
	ops = slices.Clone(ops)
	sort.SliceStable(ops, func(i, j int) bool { return ops[i].Call < ops[j].Call })
	var b strings.Builder
	for _, op := range ops {
		ret := "   pending"
		if op.Return != pendingForever {
			ret = fmt.Sprintf("%8.1fms", float64(op.Return)/1e6)
		}
		fmt.Fprintf(&b, "  client %2d %8.1fms-%s  %s\n", op.ClientId, float64(op.Call)/1e6, ret,
			describeCall(op.Input.(keyedCall), op.Output.(keyedResult)))
	}
	return b.String()
}

// visualize writes porcupine's HTML visualization of ops in a directory
// that outlives the test, and says where.
func visualize(model porcupine.Model, ops []porcupine.Operation) string {
	_, info := porcupine.CheckOperationsVerbose(model, ops, time.Minute)
	dir, err := os.MkdirTemp("", "atomicphase-linearizability-")
	if err != nil {
		return "no visualization: " + err.Error()
	}
	path := filepath.Join(dir, "history.html")
	if err := porcupine.VisualizePath(model, info, path); err != nil {
		return "no visualization: " + err.Error()
	}
	return "porcupine's visualization of these keys (kept for inspection): " + path
}
