package outbox

import (
	"context"
	"crypto/rand"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// uniqueName returns a short random name, unique per call.
func uniqueName() string { return strings.ToLower(rand.Text()[:12]) }

// testLogger writes warnings and errors to the test's output, and keeps
// every record for assertions.
type testLogger struct {
	mu      sync.Mutex
	records []slog.Record
	out     slog.Handler
}

func newTestLogger(t *testing.T) (*slog.Logger, *testLogger) {
	h := &testLogger{out: slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn})}
	return slog.New(h), h
}

func (h *testLogger) Enabled(context.Context, slog.Level) bool { return true }

func (h *testLogger) Handle(ctx context.Context, r slog.Record) error {
	h.mu.Lock()
	h.records = append(h.records, r.Clone())
	h.mu.Unlock()
	if h.out.Enabled(ctx, r.Level) {
		return h.out.Handle(ctx, r)
	}
	return nil
}

func (h *testLogger) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *testLogger) WithGroup(string) slog.Handler      { return h }

// attrs returns the given attribute of every record with message msg.
func (h *testLogger) attrs(msg, key string) []slog.Value {
	h.mu.Lock()
	defer h.mu.Unlock()
	var vals []slog.Value
	for _, r := range h.records {
		if r.Message != msg {
			continue
		}
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == key {
				vals = append(vals, a.Value)
			}
			return true
		})
	}
	return vals
}

// newTestRelay returns a relay with a test logger and fast retries, unless
// cfg says otherwise.
func newTestRelay(t *testing.T, pool *pgxpool.Pool, pub Publisher, cfg Config) *Relay {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger, _ = newTestLogger(t)
	}
	if cfg.RetryBaseDelay == 0 {
		cfg.RetryBaseDelay = 5 * time.Millisecond
	}
	if cfg.RetryMaxDelay == 0 {
		cfg.RetryMaxDelay = 20 * time.Millisecond
	}
	r, err := New(pool, pub, &cfg)
	require.NoError(t, err)
	return r
}

// start starts r and stops it at cleanup.
func start(t *testing.T, r *Relay) {
	t.Helper()
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(r.Stop)
}

// idleSignal installs a hook reporting, each time r's loop goes idle,
// whether it is idle with its listener up and no wake-up pending: from then
// on only a notification (or its poll timer) can wake it. Call before Start.
func idleSignal(r *Relay) <-chan bool {
	ch := make(chan bool, 64)
	r.testHookIdle = func() {
		ready := r.listening.Load() && len(r.wake) == 0
		select {
		case ch <- ready:
		default:
		}
	}
	return ch
}

// waitIdle waits until the idle hook reports the wanted state.
func waitIdle(t *testing.T, ch <-chan bool, wantListening bool) {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case ready := <-ch:
			if ready || !wantListening {
				return
			}
		case <-deadline:
			t.Fatal("relay never went idle")
		}
	}
}

// eventually polls cond, on the test's goroutine (so cond may use require),
// until it holds, failing the test after a generous bound.
func eventually(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(45 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in time")
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// enqueue stages msgs in a transaction of its own and commits it.
func enqueue(t *testing.T, pool *pgxpool.Pool, msgs ...Message) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.NoError(t, Enqueue(ctx, tx, msgs...))
	require.NoError(t, tx.Commit(ctx))
}

// drain runs r until a batch publishes nothing and returns the total.
func drain(t *testing.T, r *Relay) int {
	t.Helper()
	total := 0
	for {
		n, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		if n == 0 {
			return total
		}
		total += n
	}
}

// recorder is an in-process publisher that records what it published.
type recorder struct {
	mu   sync.Mutex
	msgs []Envelope
	// fail, when set, decides per message whether to fail it.
	fail func(Envelope) error
}

func (rec *recorder) publish(_ context.Context, e Envelope) error {
	if rec.fail != nil {
		if err := rec.fail(e); err != nil {
			return err
		}
	}
	rec.mu.Lock()
	rec.msgs = append(rec.msgs, e)
	rec.mu.Unlock()
	return nil
}

func (rec *recorder) published() []Envelope {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]Envelope(nil), rec.msgs...)
}

func (rec *recorder) payloads() []string {
	var out []string
	for _, e := range rec.published() {
		out = append(out, string(e.Payload))
	}
	return out
}
