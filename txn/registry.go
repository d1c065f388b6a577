package txn

import (
	"context"
	"fmt"
	"sort"
	"sync"
)

// WorkflowFunc is a multi-phase operation. It calls Atomic and Foreign phases
// in order and returns the terminal response, usually from Attempt.Finish.
// The same function runs on the first attempt, on a client retry and on a
// recovery resume: phases already committed are skipped and their stored
// results returned, so it reads linearly. Returning an error (not a
// Response) leaves the key resumable at its last committed phase.
type WorkflowFunc func(ctx context.Context, a *Attempt) (Response, error)

// Workflow is a named multi-phase operation. Register it in a Registry so
// that recovery can resume it by name.
type Workflow struct {
	name string
	fn   WorkflowFunc
}

// NewWorkflow names fn. The name is stored with every key the workflow runs
// under, so keep it stable across deploys. Registry.Register validates it.
func NewWorkflow(name string, fn WorkflowFunc) *Workflow {
	return &Workflow{name: name, fn: fn}
}

// Name returns the workflow's name.
func (w *Workflow) Name() string { return w.name }

// Registry maps workflow names to workflows. It is safe for concurrent use.
type Registry struct {
	mu sync.RWMutex
	m  map[string]*Workflow
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{m: make(map[string]*Workflow)} }

// Register adds workflows. A nil workflow or function, an empty or
// over-long name, or a name already registered is an error wrapping
// ErrInvalidUse, and nothing is added.
func (r *Registry) Register(workflows ...*Workflow) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := make(map[string]bool)
	for _, w := range workflows {
		switch {
		case w == nil || w.fn == nil:
			return fmt.Errorf("txn: register: %w: nil workflow or function", ErrInvalidUse)
		case w.name == "" || len(w.name) > 200:
			return fmt.Errorf("txn: register: %w: workflow name must be 1-200 bytes", ErrInvalidUse)
		case r.m[w.name] != nil || seen[w.name]:
			return fmt.Errorf("txn: register: %w: workflow %q already registered", ErrInvalidUse, w.name)
		}
		seen[w.name] = true
	}
	for _, w := range workflows {
		r.m[w.name] = w
	}
	return nil
}

// Lookup returns the workflow registered under name.
func (r *Registry) Lookup(name string) (*Workflow, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	w, ok := r.m[name]
	return w, ok
}

// Names returns the registered names, sorted.
func (r *Registry) Names() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	names := make([]string, 0, len(r.m))
	for n := range r.m {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
