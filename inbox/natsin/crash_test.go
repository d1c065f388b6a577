package natsin_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/inbox/natsin"
	"github.com/atomicphase/atomicphase/internal/inboxtest"
	"github.com/atomicphase/atomicphase/internal/outboxtest"
)

const envCrashChild = "NATSIN_CRASH_CHILD"

// killAfterCommit ends the process with SIGKILL as soon as a COMMIT
// succeeds: after the inbox's transaction committed, before the consumer
// acknowledged the message.
type killAfterCommit struct{}

type sqlKey struct{}

func (killAfterCommit) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, sqlKey{}, data.SQL)
}

func (killAfterCommit) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	if ctx.Value(sqlKey{}) == "commit" && data.Err == nil {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}

// TestCrashChild is the body of the crashing consumer process; run
// directly it does nothing.
func TestCrashChild(t *testing.T) {
	if os.Getenv(envCrashChild) == "" {
		return
	}
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv("CRASH_DB_URL"))
	require.NoError(t, err)
	cfg.ConnConfig.Tracer = killAfterCommit{}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	nc, err := nats.Connect(os.Getenv("CRASH_NATS_URL"))
	require.NoError(t, err)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	in, err := inbox.New(pool, &inbox.Config{Consumer: "receipts", Logger: inboxtest.Logger(t)})
	require.NoError(t, err)
	c, err := natsin.New(in, js, func(ctx context.Context, tx pgx.Tx, msg natsin.Message) error {
		return inboxtest.WriteEffect(ctx, tx, "receipts", msg.ID, msg.Data)
	}, &natsin.Config{Stream: os.Getenv("CRASH_STREAM"), Consumer: os.Getenv("CRASH_CONSUMER"), FetchWait: 10 * time.Second})
	require.NoError(t, err)
	_, err = c.RunOnce(ctx)
	t.Fatalf("the process was not killed after the commit (RunOnce: %v)", err)
}

// A consumer process is killed with SIGKILL after the inbox's transaction
// committed and before it acknowledged the message. JetStream delivers the
// message again after AckWait, to another process: the inbox finds its row
// and the message is acknowledged without running the handler. The effect
// is written once.
func TestSIGKILLBetweenCommitAndAckIsAcknowledgedWithoutRunningTheHandler(t *testing.T) {
	t.Parallel()
	e := newEnv(t, jetstream.ConsumerConfig{AckWait: time.Second, MaxDeliver: 5})
	id := "0193b1c2-7d3e-7a10-8b2c-1f2e3d4c5b6a"
	e.publish(t, id, []byte("ride 1"))

	dbURL := e.d.ConnString(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), envCrashChild+"=1", "CRASH_DB_URL="+dbURL, "CRASH_NATS_URL="+e.url,
		"CRASH_STREAM="+e.stream.Name, "CRASH_CONSUMER="+e.consumer)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "child: %v\n%s", err, out)
	status, ok := exit.Sys().(syscall.WaitStatus)
	require.True(t, ok && status.Signaled() && status.Signal() == syscall.SIGKILL, "child was not SIGKILLed: %v\n%s", err, out)

	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM effects`), "the handler committed before the kill")
	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM inbox_messages WHERE message_id = $1 AND dead_at IS NULL`, id))
	info := e.consumerInfo(t)
	require.EqualValues(t, 1, info.NumAckPending, "never acknowledged")

	var runs atomic.Int64
	in := e.inbox(t, nil)
	c := e.newConsumer(t, in, nil, writeEffect(&runs))
	runUntil(t, c, func() bool { return c.Stats().Acked == 1 })
	require.Zero(t, runs.Load(), "the redelivery did not run the handler")
	require.Equal(t, natsin.Stats{Acked: 1, Duplicates: 1}, c.Stats())
	require.Equal(t, inbox.Stats{Duplicates: 1}, in.Stats())
	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM effects`), "the effect once")
	outboxtest.Eventually(t, func() bool { return e.settled(t) })
}
