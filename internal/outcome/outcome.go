// Package outcome lets code inside this module learn how txn settled a key
// beyond what Runner's results say: the recovery Resumer counts the keys
// that a Resume failed for their age instead of resuming them.
package outcome

import "context"

// Outcome is filled in by txn during one call.
type Outcome struct {
	// FailedMaxAge: the key was older than the Runner's MaxAge, so the
	// statement that would have taken it over failed it instead.
	FailedMaxAge bool
}

type key struct{}

// With returns ctx carrying a fresh Outcome for txn to fill in.
func With(ctx context.Context) (context.Context, *Outcome) {
	o := &Outcome{}
	return context.WithValue(ctx, key{}, o), o
}

// From returns the Outcome ctx carries, or nil.
func From(ctx context.Context) *Outcome {
	o, _ := ctx.Value(key{}).(*Outcome)
	return o
}
