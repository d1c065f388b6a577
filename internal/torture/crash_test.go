package torture

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/natspub"
	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

const envChild = "TORTURE_CHILD"

// crashPoints are where the child process kills itself with SIGKILL.
var crashPoints = []string{
	"before_commit_order_created", // phase 1's COMMIT never sent
	"after_commit_order_created",  // COMMIT done, the caller never learns it
	"between_phases",
	"inside_foreign",              // the provider charged, the call has not returned
	"after_foreign_before_record", // the result is in hand, not yet recorded
	"before_commit_finish",
	"after_commit_finish",
	"relay_publish_before_mark", // JetStream acknowledged, the row not marked
}

func kill() {
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

// crashTracer kills the process at COMMIT boundaries of the named phase.
type crashTracer struct {
	point string
	flow  *flow
}

type sqlKey struct{}

func (c *crashTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	phase, _ := c.flow.phase.Load().(string)
	if data.SQL == "commit" && c.point == "before_commit_"+phase {
		kill()
	}
	if phase == "finish" && c.point == "after_foreign_before_record" {
		// The first statement after the foreign call: its result is
		// recorded by the final phase's transaction, which this opens.
		kill()
	}
	return context.WithValue(ctx, sqlKey{}, data.SQL)
}

func (c *crashTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	phase, _ := c.flow.phase.Load().(string)
	if ctx.Value(sqlKey{}) == "commit" && data.Err == nil && c.point == "after_commit_"+phase {
		kill()
	}
}

// A phase's last statement goes out with COMMIT in one batch: the batch is
// the commit.
type commitBatchKey struct{}

func (c *crashTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	commits := false
	for _, q := range data.Batch.QueuedQueries {
		commits = commits || strings.EqualFold(q.SQL, "commit")
	}
	phase, _ := c.flow.phase.Load().(string)
	if commits && c.point == "before_commit_"+phase {
		kill()
	}
	if phase == "finish" && c.point == "after_foreign_before_record" {
		kill()
	}
	return context.WithValue(ctx, commitBatchKey{}, commits)
}

func (c *crashTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *crashTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchEndData) {
	phase, _ := c.flow.phase.Load().(string)
	if commits, _ := ctx.Value(commitBatchKey{}).(bool); commits && data.Err == nil && c.point == "after_commit_"+phase {
		kill()
	}
}

// killingPublisher publishes for real, then dies before the relay marks the row.
type killingPublisher struct{ next outbox.Publisher }

func (k killingPublisher) Publish(ctx context.Context, msgs []outbox.Envelope, res *outbox.Results) {
	k.next.Publish(ctx, msgs, res)
	for i := range msgs {
		if !res.Reported(i) || res.Err(i) != nil {
			return
		}
	}
	kill()
}

// TestCrashChild is the body of the crash-matrix child process; run
// directly it does nothing.
func TestCrashChild(t *testing.T) {
	if os.Getenv(envChild) == "" {
		return
	}
	ctx := context.Background()
	point := os.Getenv("CRASH_AT")
	cfg, err := pgxpool.ParseConfig(os.Getenv("TORTURE_DB_URL"))
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv("TORTURE_SCHEMA")
	tracer := &crashTracer{point: point}
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	reg := txn.NewRegistry()
	f := newFlow(t, pool, reg, os.Getenv("TORTURE_TOPIC"))
	tracer.flow = f
	f.hook = func(p string) {
		if p == point {
			kill()
		}
	}
	runner, err := txn.New(pool, &txn.Config{Workflows: reg, LeaseDuration: time.Second, Logger: quietLogger(t)})
	require.NoError(t, err)
	_, err = runner.RunWorkflow(ctx, orderKey(1), f.wf)
	require.NoError(t, err)
	if point == "relay_publish_before_mark" {
		nc, err := nats.Connect(os.Getenv("TORTURE_NATS_URL"))
		require.NoError(t, err)
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		stream, _, _ := strings.Cut(os.Getenv("TORTURE_TOPIC"), ".")
		pub, err := natspub.New(js, &natspub.Config{Streams: []string{stream}})
		require.NoError(t, err)
		relay, err := outbox.New(pool, killingPublisher{pub}, &outbox.Config{Logger: quietLogger(t)})
		require.NoError(t, err)
		_, _ = relay.RunOnce(ctx)
	}
	t.Fatalf("crash point %q was never reached", point)
}

// relayAll publishes every pending outbox row to JetStream. It relays until
// no row is pending rather than until a batch comes back empty: a row that a
// killed process's claim transaction still holds is skipped (SKIP LOCKED)
// until the server notices the process is gone and ends its backend, which
// takes a moment under load.
func relayAll(t *testing.T, pool *pgxpool.Pool, js jetstream.JetStream, stream string) {
	t.Helper()
	pub, err := natspub.New(js, &natspub.Config{Streams: []string{stream}})
	require.NoError(t, err)
	relay, err := outbox.New(pool, pub, &outbox.Config{Logger: quietLogger(t)})
	require.NoError(t, err)
	deadline := time.Now().Add(30 * time.Second)
	for {
		n, err := relay.RunOnce(context.Background())
		require.NoError(t, err)
		if n > 0 {
			continue
		}
		var pending int
		require.NoError(t, pool.QueryRow(context.Background(),
			`SELECT count(*) FROM outbox_messages WHERE published_at IS NULL AND dead_at IS NULL`).Scan(&pending))
		if pending == 0 {
			return
		}
		require.True(t, time.Now().Before(deadline), "relay did not drain: %d rows still pending", pending)
		time.Sleep(20 * time.Millisecond)
	}
}

func newStream(t *testing.T, name string) (jetstream.JetStream, jetstream.Stream) {
	t.Helper()
	nc, err := nats.Connect(natsURL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	st, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Duplicates: time.Hour})
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), name) })
	return js, st
}

// uninterruptedResponse runs the flow once without faults, in its own schema.
func uninterruptedResponse(t *testing.T) txn.Response {
	t.Helper()
	d := newDB(t)
	reg := txn.NewRegistry()
	f := newFlow(t, d.Pool, reg, "unused.topic")
	r, err := txn.New(d.Pool, &txn.Config{Workflows: reg, Logger: quietLogger(t)})
	require.NoError(t, err)
	resp, err := r.RunWorkflow(context.Background(), orderKey(1), f.wf)
	require.NoError(t, err)
	return resp
}

// TestCrashMatrix kills a process running the 3-phase flow with SIGKILL at
// each boundary in turn; a retry or the Resumer then completes the
// operation: each effect exactly once, one charge, the message published
// once, and the response identical to an uninterrupted run's.
func TestCrashMatrix(t *testing.T) {
	t.Parallel()
	want := uninterruptedResponse(t)
	for i, point := range crashPoints {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			d := newDB(t)
			name := "CRASH" + strings.ToUpper(strings.ReplaceAll(point, "_", ""))[:12] + pgtestSuffix(d)
			js, stream := newStream(t, name)
			topic := name + ".orders"

			cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
			cmd.Env = append(os.Environ(), envChild+"=1", "CRASH_AT="+point, "TORTURE_DB_URL="+d.URL,
				"TORTURE_SCHEMA="+d.Schema, "TORTURE_TOPIC="+topic, "TORTURE_NATS_URL="+natsURL)
			out, err := cmd.CombinedOutput()
			var exitErr *exec.ExitError
			require.True(t, errors.As(err, &exitErr), "child must die: %v\n%s", err, out)
			ws := exitErr.Sys().(syscall.WaitStatus)
			require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "child was not killed at %s: %v\n%s", point, err, out)

			reg := txn.NewRegistry()
			f := newFlow(t, d.Pool, reg, topic)
			runner, err := txn.New(d.Pool, &txn.Config{Workflows: reg, Logger: quietLogger(t), WaitWhenInUse: true})
			require.NoError(t, err)
			if i%2 == 1 {
				// The Resumer finishes it once the dead child's lease expires.
				res, err := recovery.New(runner, &recovery.Config{ResumeDelay: time.Millisecond, Logger: quietLogger(t)})
				require.NoError(t, err)
				require.Eventually(t, func() bool {
					_, err := res.RunOnce(ctx)
					require.NoError(t, err)
					return d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'finished'`) == 1
				}, 30*time.Second, 100*time.Millisecond)
			}
			// The client's retry (waiting out the dead child's lease) gets
			// the operation's one answer.
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			resp, err := runner.RunWorkflow(wctx, orderKey(1), f.wf)
			require.NoError(t, err)
			require.Equal(t, want.Status, resp.Status)
			require.Equal(t, want.Header, resp.Header)
			// Same answer as an uninterrupted run, except that a phase rolled
			// back by the crash consumed an order id from the sequence (as
			// any rolled-back insert does): the answer names the committed order.
			var got, exp struct {
				OrderID  int64  `json:"order_id"`
				ChargeID string `json:"charge_id"`
			}
			require.NoError(t, json.Unmarshal(resp.Body, &got))
			require.NoError(t, json.Unmarshal(want.Body, &exp))
			require.Equal(t, exp.ChargeID, got.ChargeID, "the same charge")
			require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM orders WHERE id = $1`, got.OrderID), "the answer names the one committed order")
			if point != "before_commit_order_created" {
				require.Equal(t, string(want.Body), string(resp.Body), "byte for byte")
			}

			relayAll(t, d.Pool, js, name)
			exactlyOnce(t, d, 1)
			info, err := stream.Info(ctx)
			require.NoError(t, err)
			require.Equal(t, uint64(1), info.State.Msgs, "published once")
			require.Equal(t, 0, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE published_at IS NULL`))
		})
	}
}

func pgtestSuffix(d *pgtest.DB) string { return strings.ToUpper(strings.TrimPrefix(d.Schema, "apt_")) }
