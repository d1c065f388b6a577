// Package txnbridge gives the module's packages built on txn (recovery,
// httpidem) what a txn.Runner holds beyond its public API, without widening
// that API: package txn registers an accessor when it is initialised, and
// reports how it settled a key through the call's context.
package txnbridge

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Runner is what a txn.Runner shows the module's other packages, with every
// default filled in.
type Runner struct {
	// Pool is the pool the runner was created with.
	Pool *pgxpool.Pool
	// Logger is the runner's logger.
	Logger *slog.Logger
	// MaxAge is the runner's txn.Config.MaxAge.
	MaxAge time.Duration
	// Registered returns the names of the workflows in the runner's
	// registry, sorted, as they are now.
	Registered func() []string
	// Store is the runner's txn.Config.Store.
	Store func(status int) bool
}

// of is the accessor txn registered: a func(*txn.Runner) Runner.
var of any

// Register records how to describe a runner. Package txn calls it from its
// init with R = *txn.Runner.
func Register[R any](describe func(R) Runner) { of = describe }

// Of describes runner, a *txn.Runner.
func Of[R any](runner R) Runner { return of.(func(R) Runner)(runner) }

// Outcome is what txn found out about a key during one call, beyond what
// the call returns.
type Outcome struct {
	// FailedMaxAge: the key was older than the runner's MaxAge, so the
	// statement that would have taken it over failed it instead.
	FailedMaxAge bool
}

type outcomeKey struct{}

// WithOutcome returns ctx carrying a fresh Outcome for txn to fill in.
func WithOutcome(ctx context.Context) (context.Context, *Outcome) {
	o := &Outcome{}
	return context.WithValue(ctx, outcomeKey{}, o), o
}

// OutcomeFrom returns the Outcome ctx carries, or nil.
func OutcomeFrom(ctx context.Context) *Outcome {
	o, _ := ctx.Value(outcomeKey{}).(*Outcome)
	return o
}
