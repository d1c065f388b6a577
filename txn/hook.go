package txn

import "github.com/atomicphase/atomicphase/internal/txnhook"

// The test kit (txntest) installs a hook on its runners to learn a
// workflow's boundaries and to end a process at one of them.
func init() { txnhook.Register(func(r *Runner, f txnhook.Func) { r.hook = f }) }

// at reports a boundary to the runner's hook, if one is installed.
func (r *Runner) at(p txnhook.Point, c txnhook.Commit, phase string, attempt int, foreignKey string) {
	if r.hook != nil {
		r.hook(txnhook.Event{Point: p, Commit: c, Phase: phase, Attempt: attempt, ForeignKey: foreignKey})
	}
}

// at reports a boundary of the attempt to the runner's hook, if one is installed.
func (a *Attempt) at(p txnhook.Point, c txnhook.Commit, phase, foreignKey string) {
	a.r.at(p, c, phase, a.number, foreignKey)
}
