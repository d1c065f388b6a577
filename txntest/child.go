package txntest

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/txnhook"
)

// envChild carries a childSpec (JSON) to the child process that dies.
const envChild = "TXNTEST_CHILD"

// childSpec tells a child process which call of which test to take over,
// where to die, and the run's schema.
type childSpec struct {
	Test     string   `json:"test"`
	Call     int      `json:"call"`
	Boundary boundary `json:"boundary"`
	Conn     string   `json:"conn"` // the run's schema, as a connection string with its search_path
}

// record is a line the child writes to its parent on file descriptor 3.
type record struct {
	Event       *txnhook.Event `json:"event,omitempty"`
	OutsideCall string         `json:"outside_call,omitempty"` // a provider call outside Foreign functions
	Dying       bool           `json:"dying,omitempty"`
	End         *childEnd      `json:"end,omitempty"`
	DropSchema  string         `json:"drop_schema,omitempty"`
}

// childEnd is how the workflow ended in a child that never reached its
// boundary.
type childEnd struct {
	Status int    `json:"status,omitempty"`
	Err    string `json:"err,omitempty"`
}

func (e *childEnd) describe() string {
	if e.Err != "" {
		return "error: " + e.Err
	}
	return fmt.Sprintf("status %d", e.Status)
}

var (
	childOnce sync.Once
	child     *childSpec
	childErr  error
	childOut  *os.File
	childMu   sync.Mutex
)

// childFromEnv returns the spec of this child process, or nil in a process
// that is no child of CrashEveryBoundary.
func childFromEnv() *childSpec {
	childOnce.Do(func() {
		raw := os.Getenv(envChild)
		if raw == "" {
			return
		}
		var s childSpec
		if childErr = json.Unmarshal([]byte(raw), &s); childErr != nil {
			child = &s // a broken spec matches no test: the parent reports the child's end
			return
		}
		child = &s
		// The parent passes the write end of a pipe as descriptor 3; keep
		// it from processes the test may start, which would hold it open.
		syscall.CloseOnExec(3)
		childOut = os.NewFile(3, "txntest-parent")
	})
	return child
}

// emit writes a record to the parent. Writes to a pipe are not buffered:
// the record is the parent's before the next statement runs.
func emit(rec record) {
	childMu.Lock()
	defer childMu.Unlock()
	if childOut == nil {
		return
	}
	b, _ := json.Marshal(rec)
	_, _ = childOut.Write(append(b, '\n'))
}

// noteSchema tells the parent, in a child process, to drop a schema the
// child created: the child dies before its cleanups run.
func noteSchema(schema string) {
	if childFromEnv() != nil {
		emit(record{DropSchema: schema})
	}
}

// die ends the process at once, as SIGKILL does: no deferred function, no
// cleanup, no lease released, connections closed by the kernel.
func die() {
	p, err := os.FindProcess(os.Getpid())
	if err == nil {
		err = p.Kill()
	}
	if err != nil {
		panic(fmt.Sprintf("txntest: kill the child process: %v", err))
	}
	select {} // the signal is on its way
}

// runChild runs the workflow until the boundary the parent chose, and dies
// there. If the workflow ends first, the test fails.
func runChild(t *testing.T, opts Options, spec *childSpec) {
	if childErr != nil {
		t.Fatalf("txntest: child process: bad %s: %v", envChild, childErr)
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, spec.Conn)
	if err != nil {
		t.Fatalf("txntest: child process: connect: %v", err)
	}
	defer pool.Close()
	env := &Env{Pool: pool, Provider: &Provider{pool: pool},
		watch: &watcher{report: func(key string) { emit(record{OutsideCall: key}) }}}
	env.Provider.onCall = env.watch.call
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	runner, wf := newRunner(t, opts, env, log)
	var mu sync.Mutex
	seen := map[boundary]int{}
	txnhook.Install(runner, func(e txnhook.Event) {
		env.watch.event(e)
		mu.Lock()
		defer mu.Unlock()
		emit(record{Event: &e})
		b := kindOf(e)
		seen[b]++
		b.Nth = seen[b]
		if b == spec.Boundary {
			emit(record{Dying: true})
			die()
		}
	})
	resp, err := runner.RunWorkflow(ctx, opts.Key, wf)
	end := &childEnd{Status: resp.Status}
	if err != nil {
		end.Err = err.Error()
	}
	emit(record{End: end})
	t.Fatalf("txntest: child process: the workflow ended (%s) without crossing %s", end.describe(), spec.Boundary.name())
}
