package txntest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/internal/txnhook"
	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

// Env is the world of one run of the workflow under test: a schema of its
// own and a fake provider recorded in it.
type Env struct {
	// Pool is connected to the run's schema: migrated, holding the
	// Provider's tables and what Options.Setup created. In the child
	// process that dies at a boundary it is that process's own pool on the
	// same schema.
	Pool *pgxpool.Pool
	// Provider is the run's fake foreign service. Its record is in the
	// run's schema, so it survives the process that called it. Call it
	// from the functions of Foreign phases only (see CrashEveryBoundary).
	Provider *Provider

	watch *watcher
}

// watcher follows a run's attempts and notes calls to its Provider made
// outside the function of a Foreign phase.
type watcher struct {
	mu      sync.Mutex
	calling bool     // between a BeforeCall and its AfterCall
	outside []string // the keys of calls made outside
	report  func(key string)
}

func (w *watcher) event(e txnhook.Event) {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch e.Point {
	case txnhook.BeforeCall:
		w.calling = true
	case txnhook.AfterCall:
		w.calling = false
	}
}

func (w *watcher) call(key string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.calling {
		return
	}
	w.outside = append(w.outside, key)
	if w.report != nil {
		w.report(key)
	}
}

func (w *watcher) outsideCalls() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.outside)
}

// outsideMessage explains a call to the provider outside a Foreign phase.
func outsideMessage(keys []string) string {
	return fmt.Sprintf("env.Provider was called outside the function of any Foreign phase (under the keys %q): "+
		"such a call runs again on every attempt that passes that point, and one made in an Atomic phase may "+
		"carry values its transaction drew and a crash rolls back; call it in txn.Foreign, with the foreign key "+
		"the function is given", keys)
}

// Options says which workflow CrashEveryBoundary runs, on what request, and
// what must hold once the operation completed. Workflow, Setup and Check
// are called for several runs at once, each with its own Env.
type Options struct {
	// Workflow returns the workflow under test with its dependencies built
	// on env: the workflow your service registers, charging through a
	// client of env.Provider, say, and writing through the transactions its
	// phases are given. It is called for every run, in this process and in
	// the child processes that die (see CrashEveryBoundary). Required.
	Workflow func(t testing.TB, env *Env) *txn.Workflow

	// Setup prepares a fresh run's schema before the workflow runs: creates
	// the service's tables, inserts the rows the operation needs. It runs
	// once per run, in this process. Default: nothing.
	Setup func(t testing.TB, env *Env)

	// Key is the request to run: its scope, idempotency key, method, path
	// and params. Required.
	Key txn.Key

	// Check asserts what must hold once the operation completed, in the
	// clean run and after every recovery: "the order exists once", "the
	// provider charged once". resp is the operation's final response.
	// Default: nothing beyond the kit's own assertions.
	Check func(t testing.TB, env *Env, resp txn.Response)

	// SameResponse reports how a recovered run's final response differs
	// from the clean run's, or nil if it is the same operation's answer.
	// Give it when the response holds values that differ from run to run
	// by design (a random id, a timestamp). Default: the status, the
	// headers and the body must be equal, byte for byte.
	SameResponse func(clean, recovered txn.Response) error

	// IgnoreTables names tables of the run's schema whose row counts may
	// differ from the clean run's after a crash: tables the service writes
	// at least once by design, outside its phases (an attempt log). Every
	// other table must end with the clean run's row count. Default: none
	// (the Provider's call log is never compared: a call repeated after a
	// crash is recorded twice).
	IgnoreTables []string

	// SkipProviderFaults skips the runs in which the Provider fails a call
	// (a 503 before the effect; the effect, then a lost reply) and a retry
	// and the Resumer complete the operation. Set it only for a workflow
	// that answers a failed call with a stored terminal response by
	// design. Default: false, every call the clean run made through
	// env.Provider is failed both ways in turn.
	SkipProviderFaults bool

	// Config is the base of the runners' configuration (Store, MaxRetries,
	// MaxAge...). The kit sets Workflows, LeaseDuration (100ms, so that a
	// dead attempt's lease expires quickly), WaitWhenInUse, WaitPollInterval
	// and Logger (the test log, at Warn). Default: the zero Config.
	Config *txn.Config

	// Parallel is how many runs proceed at once. Default: twice GOMAXPROCS.
	Parallel int
}

const (
	// leaseDuration is the runners' lease: a retry waits this long at most
	// for a dead attempt's lease to expire.
	leaseDuration = 100 * time.Millisecond
	// pollInterval is how often a waiting retry or the Resumer looks again.
	pollInterval = 10 * time.Millisecond
	// recoverTimeout bounds a recovery; childTimeout a child process.
	recoverTimeout = 2 * time.Minute
	childTimeout   = 2 * time.Minute
)

// CrashEveryBoundary proves that a workflow completes exactly once wherever
// the process running it dies. It runs the workflow on opts.Key once,
// cleanly, to learn its boundaries: before and after each commit (the key's
// creation, each phase, the response) and before and after each foreign
// call. Then, for each boundary, in a fresh schema, it starts this test
// binary again in a child process running only the calling test, which
// runs the workflow and kills itself with SIGKILL at that boundary: the
// attempt is abandoned with its lease held, its transaction open, and no
// deferred code run, as when a server dies. The operation is then
// recovered in two runs of their own: by a client retry once the dead
// attempt's lease expired, and by the Resumer (recovery.New on the same
// runner) followed by a client retry. Each run must end as the clean run
// did:
//
//   - the final response equals the clean run's (see Options.SameResponse),
//     and a further retry replays it byte for byte;
//   - the key is finished, and no attempt ended in txn.ErrConflict;
//   - every foreign function got the same derived key on every attempt, and
//     env.Provider was called from Foreign functions only, saw the keys the
//     clean run used and performed as many effects, with no call refused
//     for a reused key;
//   - every table of the schema holds as many rows as after the clean run
//     (see Options.IgnoreTables);
//   - opts.Check holds.
//
// Unless opts.SkipProviderFaults is set, each call the clean run made
// through env.Provider is also failed in a run of its own, once with a 503
// before the effect and once with the effect and a lost reply, and
// recovered both ways with the same assertions.
//
// Each broken run is a subtest named after its boundary and recovery (for
// example "after_call_charged/resumer", so that go test -run can pick one),
// and its failures say what the process did before it died, which recovery
// followed, and what broke. The runs proceed in parallel
// (Options.Parallel); CrashEveryBoundary returns when all are done. The
// clean runs are part of the calling test itself.
//
// The workflow must take the same path for the same request: the clean run
// is run twice to check it, and to check that the response, the provider's
// keys and the row counts are the same from run to run. After a death
// before a commit, the schema's identity and serial sequences are set back
// to the highest value in use before the recovery: the transaction the
// death rolled back drew values from them, as any rolled-back insert does,
// and the recovered response could not be compared with the clean run's
// otherwise. A retry in production draws new values instead, so a foreign
// call keyed by such a value (an order id drawn in an Atomic phase) would
// repeat under a new key there but not here: make foreign calls through
// env.Provider, which fails a run whose calls are made anywhere but in a
// Foreign phase's function.
//
// The child process runs the calling test function from its start up to
// its call of CrashEveryBoundary, which takes over there (calls are matched
// by the test's name and their order in it). So do nothing before the call
// that must not happen twice. Schemas that DB creates in the child are
// dropped by the parent.
func CrashEveryBoundary(t *testing.T, opts Options) {
	t.Helper()
	call := nextCall(t)
	if spec := childFromEnv(); spec != nil {
		if spec.Test == t.Name() && spec.Call == call {
			runChild(t, opts, spec)
		}
		return
	}
	if err := opts.validate(); err != nil {
		t.Fatalf("txntest: crash every boundary: %v", err)
	}
	k := &kit{t: t, opts: opts, call: call}
	k.runClean()
	k.runCases()
}

func (o Options) validate() error {
	switch {
	case o.Workflow == nil:
		return errors.New("invalid options: Workflow is nil")
	case o.Parallel < 0:
		return errors.New("invalid options: Parallel is negative")
	}
	return nil
}

var (
	callsMu sync.Mutex
	calls   = map[*testing.T]int{}
)

// nextCall numbers the calls of CrashEveryBoundary made by one test, so
// that a child process acts on the call its parent made.
func nextCall(t *testing.T) int {
	callsMu.Lock()
	defer callsMu.Unlock()
	if calls[t] == 0 {
		t.Cleanup(func() {
			callsMu.Lock()
			defer callsMu.Unlock()
			delete(calls, t)
		})
	}
	calls[t]++
	return calls[t]
}

// boundary identifies where a child process dies: the nth event of its kind.
type boundary struct {
	Point  txnhook.Point  `json:"point"`
	Commit txnhook.Commit `json:"commit,omitempty"`
	Phase  string         `json:"phase,omitempty"`
	Nth    int            `json:"nth"`
}

func kindOf(e txnhook.Event) boundary {
	return boundary{Point: e.Point, Commit: e.Commit, Phase: e.Phase}
}

// boundariesOf lists the boundaries a clean run crossed. The key's own
// commit, when it comes first, is not a boundary before it: nothing ran
// yet, so a death there is no run at all.
func boundariesOf(events []txnhook.Event) []boundary {
	seen := map[boundary]int{}
	var bs []boundary
	for i, e := range events {
		b := kindOf(e)
		seen[b]++
		b.Nth = seen[b]
		if i == 0 && e.Point == txnhook.BeforeCommit && e.Commit == txnhook.CommitKey {
			continue
		}
		bs = append(bs, b)
	}
	return bs
}

// what names what the boundary is about: a phase, the key, the response.
func (b boundary) what() (name, words string) {
	switch {
	case b.Point == txnhook.BeforeCall || b.Point == txnhook.AfterCall:
		return b.Phase, fmt.Sprintf("the foreign call of phase %q", b.Phase)
	case b.Commit == txnhook.CommitKey:
		return "key", "the commit that creates the key"
	case b.Commit == txnhook.CommitResponse && b.Phase == "":
		return "finish", "the commit of the final phase (Finish) with the response"
	case b.Commit == txnhook.CommitResponse:
		return "response", fmt.Sprintf("the commit of the response returned after phase %q", b.Phase)
	}
	return b.Phase, fmt.Sprintf("the commit of phase %q", b.Phase)
}

// name is the boundary's subtest name, e.g. "after_call_charged".
func (b boundary) name() string {
	what, _ := b.what()
	var s string
	switch b.Point {
	case txnhook.BeforeCommit:
		s = "before_commit_" + what
	case txnhook.AfterCommit:
		s = "after_commit_" + what
	case txnhook.BeforeCall:
		s = "before_call_" + what
	default:
		s = "after_call_" + what
	}
	if b.Nth > 1 {
		s += fmt.Sprintf("_%d", b.Nth)
	}
	return s
}

// describe says what a death at the boundary leaves behind.
func (b boundary) describe() string {
	_, what := b.what()
	nth := ""
	if b.Nth > 1 {
		nth = fmt.Sprintf(" (its %d. time)", b.Nth)
	}
	switch b.Point {
	case txnhook.BeforeCommit:
		return "the process died just before " + what + nth + " (its COMMIT never sent: rolled back)"
	case txnhook.AfterCommit:
		return "the process died just after " + what + nth + " (committed; the attempt never acted on it)"
	case txnhook.BeforeCall:
		return "the process died just before " + what + nth + " (the function not called)"
	}
	return "the process died just after " + what + nth + " returned (the result in hand, not recorded)"
}

// recoveryKind is how an operation is completed after its attempt died.
type recoveryKind string

const (
	byRetry   recoveryKind = "retry"
	byResumer recoveryKind = "resumer"
)

// describe says how the operation was recovered; held says whether a dead
// attempt's lease had to expire first.
func (r recoveryKind) describe(held bool) string {
	switch {
	case r == byResumer:
		return "recovered by the Resumer (then a client retry replayed its answer)"
	case held:
		return "recovered by a client retry that took the key over once the lease expired"
	}
	return "recovered by a client retry"
}

// result is what a finished run left: its answer, its boundaries, the
// provider's record and the schema's row counts.
type result struct {
	env     *Env
	resp    txn.Response
	events  []txnhook.Event
	calls   []Call
	effects []Effect
	counts  map[string]int64
}

// providerKeys returns the distinct keys of the calls, sorted.
func providerKeys(calls []Call) []string {
	set := map[string]bool{}
	for _, c := range calls {
		set[c.Key] = true
	}
	return slices.Sorted(maps.Keys(set))
}

type kit struct {
	t     *testing.T
	opts  Options
	call  int
	clean *result
	// What the two clean runs showed to be the same from run to run.
	sameResponse, sameKeys, sameCounts bool
}

// runClean runs the workflow cleanly twice, in schemas of their own, and
// checks that both runs took the same path and ended the same way. The
// runs are no subtests, so that a -run pattern naming a few boundaries
// still gets them.
func (k *kit) runClean() {
	t := k.t
	a := k.cleanRun(t, "clean run")
	b := k.cleanRun(t, "second clean run")
	if !slices.EqualFunc(a.events, b.events, func(x, y txnhook.Event) bool { return kindOf(x) == kindOf(y) }) {
		t.Fatalf("txntest: two clean runs of the same request crossed different boundaries, so there is no fixed "+
			"place to crash: the workflow must take the same path for the same request.\n  first: %s\n  second: %s",
			eventList(a.events), eventList(b.events))
	}
	k.clean = a
	k.sameResponse = true
	if err := k.compare(a.resp, b.resp); err != nil {
		k.sameResponse = false
		t.Errorf("txntest: two clean runs of the same request answered differently, so a recovered answer "+
			"cannot be compared with the clean one: %v\n(give Options.SameResponse to compare what must match)", err)
	}
	k.sameKeys = slices.Equal(providerKeys(a.calls), providerKeys(b.calls))
	if !k.sameKeys {
		t.Errorf("txntest: two clean runs of the same request called the provider under different idempotency "+
			"keys (%v, then %v): a key built from anything but the foreign key the Foreign phase receives "+
			"(the time, a random value, a counter) is new on every attempt, so the provider cannot recognise a "+
			"call repeated after a crash and performs it again. The foreign keys were %v.",
			providerKeys(a.calls), providerKeys(b.calls), foreignKeys(a.events))
	}
	k.sameCounts = maps.Equal(a.counts, b.counts)
	if !k.sameCounts {
		t.Errorf("txntest: two clean runs of the same request left different row counts (%v, then %v): "+
			"row counts are not compared after crashes", a.counts, b.counts)
	}
	t.Logf("txntest: clean run: %s; boundaries: %s", show(a.resp), eventList(a.events))
	if k.opts.Check != nil {
		t.Logf("txntest: Check on the clean run")
		k.opts.Check(t, a.env, a.resp)
	}
}

// cleanRun runs the workflow once without faults in a schema of its own.
func (k *kit) cleanRun(t *testing.T, which string) *result {
	t.Helper()
	env := k.newEnv(t)
	r := k.newRunner(t, env)
	ctx, cancel := context.WithTimeout(context.Background(), recoverTimeout)
	defer cancel()
	resp, err := r.runner.RunWorkflow(ctx, k.opts.Key, r.wf)
	if err != nil {
		t.Fatalf("txntest: the workflow failed on a %s, without any crash: %v", which, err)
	}
	if keys := env.watch.outsideCalls(); len(keys) > 0 {
		t.Errorf("txntest: %s: %s", which, outsideMessage(keys))
	}
	res := k.collect(t, env, resp, r.events())
	if len(res.events) == 0 {
		t.Fatalf("txntest: the %s crossed no boundary: is the workflow the one registered under %q?", which, r.wf.Name())
	}
	return res
}

func (k *kit) collect(t testing.TB, env *Env, resp txn.Response, events []txnhook.Event) *result {
	t.Helper()
	ctx := context.Background()
	calls, err := env.Provider.calls(ctx)
	if err != nil {
		t.Fatalf("%v", err)
	}
	effects, err := env.Provider.effects(ctx)
	if err != nil {
		t.Fatalf("%v", err)
	}
	counts, err := rowCounts(ctx, env.Pool, k.opts.IgnoreTables)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return &result{env: env, resp: resp, events: events, calls: calls, effects: effects, counts: counts}
}

// compare applies Options.SameResponse, or byte-for-byte equality.
func (k *kit) compare(clean, got txn.Response) error {
	if k.opts.SameResponse != nil {
		return k.opts.SameResponse(clean, got)
	}
	return sameResponse(clean, got)
}

func sameResponse(want, got txn.Response) error {
	if want.Status != got.Status || !bytes.Equal(want.Body, got.Body) || !sameHeader(want.Header, got.Header) {
		return fmt.Errorf("got %s\n  the clean run's: %s", show(got), show(want))
	}
	return nil
}

func sameHeader(a, b http.Header) bool {
	if len(a) == 0 && len(b) == 0 {
		return true
	}
	return maps.EqualFunc(a, b, slices.Equal)
}

func show(r txn.Response) string {
	h := ""
	if len(r.Header) > 0 {
		hb, _ := json.Marshal(r.Header)
		h = " " + string(hb)
	}
	return fmt.Sprintf("%d%s %s", r.Status, h, clip(r.Body))
}

func clip(b []byte) string {
	const shown = 400
	if len(b) > shown {
		return fmt.Sprintf("%q… (%d bytes)", b[:shown], len(b))
	}
	return fmt.Sprintf("%q", b)
}

func eventList(events []txnhook.Event) string {
	seen := map[boundary]int{}
	names := make([]string, 0, len(events))
	for _, e := range events {
		b := kindOf(e)
		seen[b]++
		b.Nth = seen[b]
		names = append(names, b.name())
	}
	return strings.Join(names, ", ")
}

// foreignKeys returns the distinct keys the foreign functions got, sorted.
func foreignKeys(events []txnhook.Event) []string {
	set := map[string]bool{}
	for _, e := range events {
		if e.Point == txnhook.BeforeCall {
			set[e.ForeignKey] = true
		}
	}
	return slices.Sorted(maps.Keys(set))
}

// testCase is one run that is broken and then recovered.
type testCase struct {
	name string
	run  func(t *testing.T)
}

func (k *kit) runCases() {
	var cases []testCase
	for _, b := range boundariesOf(k.clean.events) {
		for _, rec := range []recoveryKind{byRetry, byResumer} {
			cases = append(cases, testCase{name: b.name() + "/" + string(rec), run: func(t *testing.T) { k.crashCase(t, b, rec) }})
		}
	}
	if !k.opts.SkipProviderFaults {
		for i := range k.clean.calls {
			for _, f := range []Fault{Unavailable, ReplyLost} {
				for _, rec := range []recoveryKind{byRetry, byResumer} {
					name := fmt.Sprintf("provider_%s_call_%d/%s", map[Fault]string{Unavailable: "503", ReplyLost: "reply_lost"}[f], i+1, rec)
					cases = append(cases, testCase{name: name, run: func(t *testing.T) { k.faultCase(t, i+1, f, rec) }})
				}
			}
		}
	}
	parallel := k.opts.Parallel
	if parallel == 0 {
		parallel = 2 * runtime.GOMAXPROCS(0)
	}
	sem := make(chan struct{}, parallel)
	var wg sync.WaitGroup
	for _, c := range cases {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			k.t.Run(c.name, c.run)
		})
	}
	wg.Wait()
}

// crashCase kills a child process at b, recovers the operation by rec and
// checks the outcome.
func (k *kit) crashCase(t *testing.T, b boundary, rec recoveryKind) {
	desc := b.describe() + ", then it was " + rec.describe(true)
	t.Logf("txntest: %s", desc)
	env := k.newEnv(t)
	child := k.spawn(t, env, b)
	if slices.ContainsFunc(child.events, func(e txnhook.Event) bool { return e.Point == txnhook.BeforeCall }) {
		// Sequences may be rewound below: a call bound to a key row that
		// a crash rolled back would get the same key again and go unseen.
		var keys int
		if err := env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND key = $2`,
			k.opts.Key.Scope, k.opts.Key.Value).Scan(&keys); err != nil {
			t.Fatalf("txntest: read the key: %v", err)
		}
		if keys == 0 {
			t.Errorf("txntest: %s: the dead process called a foreign function, but no key is committed: the call's "+
				"foreign key was derived from a key row that the crash rolled back", desc)
		}
	}
	if b.Point == txnhook.BeforeCommit {
		// The death rolled back a transaction that may have drawn ids.
		if err := rewindSequences(context.Background(), env.Pool); err != nil {
			t.Fatalf("%v", err)
		}
	}
	r := k.newRunner(t, env)
	resp, err := k.recover(t, env, r, rec)
	if err != nil {
		t.Fatalf("txntest: %s: the recovery failed: %v", desc, err)
	}
	k.verify(t, desc, env, r, resp, append(child.events, r.events()...), child.outside)
}

// faultCase fails the nth provider call with f, recovers the operation by
// rec and checks the outcome.
func (k *kit) faultCase(t *testing.T, nth int, f Fault, rec recoveryKind) {
	desc := fmt.Sprintf("the provider's call %d failed with %v", nth, f)
	t.Logf("txntest: %s, then the operation was %s", desc, rec.describe(false))
	env := k.newEnv(t)
	faults := make([]Fault, nth)
	faults[nth-1] = f
	env.Provider.FailNext(faults...)
	r := k.newRunner(t, env)
	ctx, cancel := context.WithTimeout(context.Background(), recoverTimeout)
	defer cancel()
	resp, err := r.runner.RunWorkflow(ctx, k.opts.Key, r.wf)
	if err == nil {
		desc += ", and the attempt answered at once (it did not leave the operation to a retry)"
	} else {
		desc += ", then the operation was " + rec.describe(false)
		if resp, err = k.recover(t, env, r, rec); err != nil {
			t.Fatalf("txntest: %s: the recovery failed: %v", desc, err)
		}
	}
	k.verify(t, desc, env, r, resp, r.events(), nil)
}

// newEnv creates a run's schema, the provider's tables and the service's
// (Options.Setup).
func (k *kit) newEnv(t testing.TB) *Env {
	t.Helper()
	d := pgtest.New(t)
	env := &Env{Pool: d.Pool, Provider: NewProvider(t, d.Pool), watch: &watcher{}}
	env.Provider.onCall = env.watch.call
	envDB.Store(env, d)
	t.Cleanup(func() { envDB.Delete(env) })
	if k.opts.Setup != nil {
		k.opts.Setup(t, env)
	}
	return env
}

// envDB maps an Env to its pgtest.DB, for the child's connection string.
var envDB sync.Map

// runner is a run's runner with its workflow and the boundaries it crossed.
type runner struct {
	runner *txn.Runner
	wf     *txn.Workflow
	log    *slog.Logger

	mu  sync.Mutex
	evs []txnhook.Event
}

func (r *runner) events() []txnhook.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.evs)
}

// newRunner builds the workflow on env and a runner for it, logging to the
// test log, recording the boundaries it crosses.
func (k *kit) newRunner(t testing.TB, env *Env) *runner {
	t.Helper()
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	r := &runner{log: log}
	r.runner, r.wf = newRunner(t, k.opts, env, log)
	txnhook.Install(r.runner, func(e txnhook.Event) {
		env.watch.event(e)
		r.mu.Lock()
		defer r.mu.Unlock()
		r.evs = append(r.evs, e)
	})
	return r
}

// newRunner builds the workflow on env and a runner whose registry holds it.
func newRunner(t testing.TB, opts Options, env *Env, log *slog.Logger) (*txn.Runner, *txn.Workflow) {
	t.Helper()
	wf := opts.Workflow(t, env)
	if wf == nil {
		t.Fatalf("txntest: Options.Workflow returned nil")
	}
	reg := txn.NewRegistry()
	if err := reg.Register(wf); err != nil {
		t.Fatalf("txntest: register the workflow: %v", err)
	}
	var cfg txn.Config
	if opts.Config != nil {
		cfg = *opts.Config
	}
	cfg.Workflows = reg
	cfg.LeaseDuration = leaseDuration
	cfg.WaitWhenInUse = true
	cfg.WaitPollInterval = pollInterval
	cfg.Logger = log
	runner, err := txn.New(env.Pool, &cfg)
	if err != nil {
		t.Fatalf("txntest: new runner: %v", err)
	}
	return runner, wf
}

// recover completes the operation whose attempt was abandoned: by a client
// retry, which waits for the dead attempt's lease to expire; or by the
// Resumer, polled until no key is running, then a client retry that
// replays its answer.
func (k *kit) recover(t testing.TB, env *Env, r *runner, rec recoveryKind) (txn.Response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), recoverTimeout)
	defer cancel()
	if rec == byResumer {
		res, err := recovery.New(r.runner, &recovery.Config{ResumeDelay: time.Millisecond, Logger: r.log})
		if err != nil {
			return txn.Response{}, err
		}
		for {
			rep, err := res.RunOnce(ctx)
			switch {
			case err != nil:
				return txn.Response{}, fmt.Errorf("the Resumer's round failed: %w", err)
			case rep.Errors > 0:
				return txn.Response{}, errors.New("the Resumer's resume ended in an error (logged above), leaving the key to a later round")
			case rep.Failed() > 0:
				return txn.Response{}, fmt.Errorf("the Resumer failed the key instead of resuming it (%+v)", rep)
			}
			var running int
			if err := env.Pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE status = 'running'`).Scan(&running); err != nil {
				return txn.Response{}, err
			}
			if running == 0 {
				break
			}
			select {
			case <-ctx.Done():
				return txn.Response{}, fmt.Errorf("the Resumer did not complete the operation in %v", recoverTimeout)
			case <-time.After(pollInterval):
			}
		}
	}
	return r.runner.RunWorkflow(ctx, k.opts.Key, r.wf)
}

// verify checks a recovered run against the clean run.
func (k *kit) verify(t *testing.T, desc string, env *Env, r *runner, resp txn.Response, events []txnhook.Event, outside []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), recoverTimeout)
	defer cancel()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Errorf("txntest: %s: "+format, append([]any{desc}, args...)...)
	}
	if k.sameResponse {
		if err := k.compare(k.clean.resp, resp); err != nil {
			fail("the final response is not the clean run's: %v", err)
		}
	}
	again, err := r.runner.RunWorkflow(ctx, k.opts.Key, r.wf)
	switch {
	case err != nil:
		fail("a retry after the operation completed failed: %v", err)
	case !again.Replayed:
		fail("a retry after the operation completed ran it again instead of replaying its answer")
	case sameResponse(resp, again) != nil:
		fail("a retry after the operation completed replayed another answer: %v", sameResponse(resp, again))
	}
	var status, reason string
	err = env.Pool.QueryRow(ctx, `SELECT status, coalesce(failure_reason, '') FROM idempotency_keys WHERE scope = $1 AND key = $2`,
		k.opts.Key.Scope, k.opts.Key.Value).Scan(&status, &reason)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		fail("no key is stored: the answer (%d) was not stored (txn.Config.Store), so there is nothing to recover", resp.Status)
	case err != nil:
		fail("read the key: %v", err)
	case status != string(txn.KeyFinished):
		fail("the key is %s (%s), not finished", status, reason)
	}
	if n := r.runner.Stats().Conflicts; n > 0 {
		fail("%d phase(s) of the recovering attempts ended in txn.ErrConflict", n)
	}
	byPhase := map[string][]string{}
	for _, e := range events {
		if e.Point == txnhook.BeforeCall && !slices.Contains(byPhase[e.Phase], e.ForeignKey) {
			byPhase[e.Phase] = append(byPhase[e.Phase], e.ForeignKey)
		}
	}
	for phase, keys := range byPhase {
		if len(keys) > 1 {
			fail("the foreign function of phase %q got different keys on different attempts: %v", phase, keys)
		}
	}
	if outside = append(outside, env.watch.outsideCalls()...); len(outside) > 0 {
		fail("%s", outsideMessage(outside))
	}
	got := k.collect(t, env, resp, nil)
	k.verifyProvider(fail, got)
	if k.sameCounts {
		for _, table := range slices.Sorted(maps.Keys(k.clean.counts)) {
			if got.counts[table] != k.clean.counts[table] {
				fail("table %q holds %d rows, the clean run left %d: a write was repeated, made outside its phase's "+
					"transaction (through a pool or connection rather than the tx the phase is given) or by code between "+
					"phases, which runs again on every attempt (list deliberate ones in Options.IgnoreTables)",
					table, got.counts[table], k.clean.counts[table])
			}
		}
	}
	if k.opts.Check != nil {
		k.opts.Check(t, env, resp)
	}
}

func (k *kit) verifyProvider(fail func(string, ...any), got *result) {
	keys, cleanKeys := providerKeys(got.calls), providerKeys(k.clean.calls)
	switch {
	case k.sameKeys && !slices.Equal(keys, cleanKeys):
		fail("the provider was called under the keys %v, the clean run under %v: a call repeated on a later "+
			"attempt must carry the same key, the foreign key its Foreign phase receives (or one derived only from it), "+
			"or the provider cannot recognise it and acts again", keys, cleanKeys)
	case len(keys) != len(cleanKeys):
		fail("the provider was called under %d different keys, the clean run under %d: a call repeated on a later "+
			"attempt carried a new key, so the provider acted again", len(keys), len(cleanKeys))
	}
	if len(got.effects) != len(k.clean.effects) {
		var keys []string
		for _, e := range got.effects {
			keys = append(keys, e.Key)
		}
		fail("the provider performed %d effect(s), the clean run %d (under the keys %v)", len(got.effects), len(k.clean.effects), keys)
	}
	for _, c := range got.calls {
		if c.Outcome == OutcomeRejected {
			fail("the provider refused a call under key %q: the key was first used with another request (%s, then %s): "+
				"build the request from the operation's params and committed results only", c.Key, firstRequest(got.calls, c.Key), c.Request)
		}
	}
}

func firstRequest(calls []Call, key string) string {
	for _, c := range calls {
		if c.Key == key {
			return string(c.Request)
		}
	}
	return ""
}

// childRun is what a child process reported before it died.
type childRun struct {
	events  []txnhook.Event // the boundaries it crossed
	outside []string        // the keys of provider calls outside Foreign functions
}

// spawn runs the calling test in a child process that dies at b.
func (k *kit) spawn(t *testing.T, env *Env, b boundary) childRun {
	t.Helper()
	d, _ := envDB.Load(env)
	db := d.(*pgtest.DB)
	spec := childSpec{Test: k.t.Name(), Call: k.call, Boundary: b, Conn: db.ConnString(t)}
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatalf("txntest: %v", err)
	}
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	ctx, cancel := context.WithTimeout(context.Background(), childTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, "-test.run="+runPattern(k.t.Name()), "-test.count=1")
	cmd.Env = append(os.Environ(), envChild+"="+string(raw), EnvDatabaseURL+"="+db.URL)
	var out lockedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatalf("txntest: pipe: %v", err)
	}
	defer pr.Close()
	cmd.ExtraFiles = []*os.File{pw}
	if err := cmd.Start(); err != nil {
		pw.Close()
		t.Fatalf("txntest: start the child process: %v", err)
	}
	pw.Close()
	recs, readErr := readRecords(pr)
	waitErr := cmd.Wait()

	var run childRun
	died, end := false, (*childEnd)(nil)
	for _, rec := range recs {
		switch {
		case rec.Event != nil:
			run.events = append(run.events, *rec.Event)
		case rec.OutsideCall != "":
			run.outside = append(run.outside, rec.OutsideCall)
		case rec.Dying:
			died = true
		case rec.End != nil:
			end = rec.End
		case rec.DropSchema != "":
			dropSchema(t, db.URL, rec.DropSchema)
		}
	}
	switch {
	case died && waitErr != nil && !cmd.ProcessState.Success():
		return run
	case end != nil:
		t.Fatalf("txntest: the child process ran the workflow to its end (%s) without crossing %s: it took another "+
			"path than the clean run (it crossed: %s)\n%s", end.describe(), b.name(), eventList(run.events), out.String())
	case readErr != nil:
		t.Fatalf("txntest: read the child process's boundaries: %v\n%s", readErr, out.String())
	}
	t.Fatalf("txntest: the child process that was to die at %s ended otherwise (%v) after crossing: %s\n%s",
		b.name(), waitErr, eventList(run.events), out.String())
	return run
}

// runPattern is the -test.run pattern that selects exactly the test name.
func runPattern(name string) string {
	parts := strings.Split(name, "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	return strings.Join(parts, "/")
}

func readRecords(r io.Reader) ([]record, error) {
	var recs []record
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		var rec record
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			return recs, fmt.Errorf("decode %q: %w", sc.Bytes(), err)
		}
		recs = append(recs, rec)
	}
	return recs, sc.Err()
}

func dropSchema(t testing.TB, url, schema string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Errorf("txntest: drop the child's schema %s: %v", schema, err)
		return
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		t.Errorf("txntest: drop the child's schema %s: %v", schema, err)
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
