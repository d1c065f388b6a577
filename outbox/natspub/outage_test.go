package natspub_test

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/outboxtest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/natspub"
)

// restartableNATS is an in-process JetStream server on a fixed port and
// store, so that it can be stopped (an outage) and started again.
type restartableNATS struct {
	t    *testing.T
	opts server.Options
	s    *server.Server
}

func newRestartableNATS(t *testing.T) *restartableNATS {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	n := &restartableNATS{t: t, opts: server.Options{
		Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true,
	}}
	n.start()
	t.Cleanup(n.stop)
	return n
}

func (n *restartableNATS) start() {
	n.t.Helper()
	opts := n.opts
	s, err := server.NewServer(&opts)
	require.NoError(n.t, err)
	s.Start()
	require.True(n.t, s.ReadyForConnections(10*time.Second), "in-process NATS server did not start")
	n.s = s
}

func (n *restartableNATS) stop() {
	if n.s != nil {
		n.s.Shutdown()
		n.s.WaitForShutdown()
		n.s = nil
	}
}

// A broker outage is not the messages' failure: while NATS is down the
// relay's publishes meet a reconnecting connection, which the publisher
// reports as outbox.Unavailable, so no attempt is counted and, with
// MaxAttempts 1, nothing is dead-lettered. When NATS is back every message
// is stored in the stream once.
func TestBrokerOutageDeadLettersNothing(t *testing.T) {
	t.Parallel()
	n := newRestartableNATS(t)
	nc, err := nats.Connect("nats://"+net.JoinHostPort(n.opts.Host, strconv.Itoa(n.opts.Port)),
		nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: "OUTAGE", Subjects: []string{"outage.>"}, Storage: jetstream.FileStorage, Duplicates: time.Hour,
	})
	require.NoError(t, err)

	d := pgtest.New(t)
	pub, err := natspub.New(js, &natspub.Config{SubjectPrefix: "outage.", Streams: []string{"OUTAGE"}})
	require.NoError(t, err)
	r := outboxtest.NewRelay(t, d.Pool, pub, outbox.Config{
		MaxAttempts: 1, PublishTimeout: time.Second, RetryBaseDelay: time.Millisecond, RetryMaxDelay: time.Millisecond,
	})

	n0, err := r.RunOnce(ctx) // checks the stream's duplicate window once, while NATS is up
	require.NoError(t, err)
	require.Zero(t, n0)
	outboxtest.Enqueue(t, d.Pool,
		outbox.Message{Topic: "a", OrderingKey: "k", Payload: []byte("k1")},
		outbox.Message{Topic: "a", OrderingKey: "k", Payload: []byte("k2")},
		outbox.Message{Topic: "b", Payload: []byte("u")})

	n.stop()
	outboxtest.Eventually(t, func() bool {
		_, err := r.RunOnce(ctx)
		require.NoError(t, err)
		stats, err := r.Stats(ctx)
		require.NoError(t, err)
		return stats.Unavailable >= 4
	})
	require.Zero(t, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL OR attempts > 0`),
		"the outage dead-lettered a message or counted an attempt")

	n.start()
	outboxtest.Eventually(t, func() bool {
		_, err := r.RunOnce(ctx)
		require.NoError(t, err)
		return d.Count(t, `SELECT count(*) FROM outbox_messages WHERE published_at IS NULL`) == 0
	})
	require.Zero(t, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL`))
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(3), info.State.Msgs, "each message stored once")
}
