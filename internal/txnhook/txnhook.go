// Package txnhook lets the module's test kit (package txntest) watch a
// txn.Runner at the boundaries of a workflow attempt, where a process death
// leaves the operation in a distinct state: before and after each commit
// that writes the key row, and before and after each foreign call. The kit
// learns a workflow's boundaries from a clean run, then kills a child
// process at each one in turn.
//
// A runner has no hook unless one is installed; then each boundary costs a
// nil check. Package txn registers the installer when it is initialised,
// so that this package need not import txn.
package txnhook

// Point is a boundary of an attempt.
type Point uint8

// The boundaries. A commit is any statement or transaction of the attempt
// that durably writes the key row with something a later attempt builds
// on; lease extensions alone are not boundaries.
const (
	// BeforeCommit: the commit's statements are sent, its COMMIT is not:
	// a death here rolls it back.
	BeforeCommit Point = iota + 1
	// AfterCommit: the commit succeeded and the attempt has not acted on it.
	AfterCommit
	// BeforeCall: a Foreign phase is about to call its function; the lease
	// was checked.
	BeforeCall
	// AfterCall: the foreign function returned (with an error, or with a
	// result not recorded yet).
	AfterCall
)

// Commit says what a commit writes.
type Commit uint8

// What commits.
const (
	// CommitKey: the key's row alone, created holding a lease, before a
	// Foreign phase that comes first. (Otherwise a first attempt inserts
	// its key in the transaction of its first commit, a CommitPhase or a
	// CommitResponse.)
	CommitKey Commit = iota + 1
	// CommitPhase: an Atomic phase's writes and result as the key's
	// recovery point, with the results of foreign calls made since the
	// last commit (which have no commit of their own).
	CommitPhase
	// CommitResponse: the terminal response, with the final phase's writes
	// (Attempt.Finish) or on its own (a response the workflow returned
	// without Finish).
	CommitResponse
)

// Event is one boundary crossed by an attempt.
type Event struct {
	Point Point
	// Commit says what commits, at BeforeCommit and AfterCommit.
	Commit Commit
	// Phase is the phase that commits or calls out: "" for CommitKey and
	// for a CommitResponse made by Finish.
	Phase string
	// Attempt is the attempt's number (1 for the first).
	Attempt int
	// ForeignKey is the key handed to the foreign function, at BeforeCall
	// and AfterCall.
	ForeignKey string
}

// Func receives the events of the runner it is installed on, in the
// goroutine that crosses the boundary. It may end the process.
type Func func(Event)

var install any // a func(R, Func) registered by package txn

// Register records how to install a hook on a runner. Package txn calls it
// from its init with R = *txn.Runner.
func Register[R any](set func(R, Func)) { install = set }

// Install sets runner's hook (nil removes it). Call it before the runner
// is used.
func Install[R any](runner R, f Func) { install.(func(R, Func))(runner, f) }
