// Package outboxtest holds test helpers shared by the outbox publishers'
// tests: a JetStream server and streams, and staging and draining messages.
package outboxtest

import (
	"context"
	"crypto/rand"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/outbox"
)

// EnvNATSURL names the environment variable holding a NATS server with
// JetStream for the tests; without it each test starts its own in-process.
const EnvNATSURL = "TEST_NATS_URL"

// UniqueName returns a short random name, unique per call, for streams,
// subjects and application names.
func UniqueName() string { return strings.ToLower(rand.Text()[:12]) }

// NATSURL returns the URL of a JetStream-enabled NATS server for t.
func NATSURL(t *testing.T) string {
	t.Helper()
	if url := os.Getenv(EnvNATSURL); url != "" {
		return url
	}
	s, err := server.NewServer(&server.Options{
		Host:      "127.0.0.1",
		Port:      server.RANDOM_PORT,
		JetStream: true,
		StoreDir:  t.TempDir(),
		NoLog:     true,
		NoSigs:    true,
	})
	require.NoError(t, err)
	s.Start()
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	require.True(t, s.ReadyForConnections(10*time.Second), "in-process NATS server did not start")
	return s.ClientURL()
}

// ExampleNATS starts an in-process JetStream server for a runnable Example,
// which has no testing.T, and returns its URL and a function that shuts it
// down and removes its files. It ignores TEST_NATS_URL, so that the example
// owns every stream name. A failure panics, which fails the example.
func ExampleNATS() (url string, stop func()) {
	dir, err := os.MkdirTemp("", "outboxtest-nats")
	if err != nil {
		panic(err)
	}
	s, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true,
	})
	if err != nil {
		panic(err)
	}
	s.Start()
	stop = func() {
		s.Shutdown()
		s.WaitForShutdown()
		_ = os.RemoveAll(dir)
	}
	if !s.ReadyForConnections(10 * time.Second) {
		stop()
		panic("in-process NATS server did not start")
	}
	return s.ClientURL(), stop
}

// Conn connects to url; the connection is closed at cleanup.
func Conn(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url, nats.Name("outbox-test"))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return js
}

// Stream is a JetStream stream of one test, deleted at cleanup.
type Stream struct {
	JS     jetstream.JetStream
	Stream jetstream.Stream
	Name   string
	Prefix string // subject prefix: the stream holds Prefix + ">"
}

// NewStream creates a memory stream on subjects prefix + ">" for a fresh
// prefix, with a duplicate window of window.
func NewStream(t *testing.T, js jetstream.JetStream, window time.Duration) *Stream {
	t.Helper()
	name := UniqueName()
	prefix := "t" + name + "."
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	streamName := "OUTBOX_" + strings.ToUpper(name)
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:       streamName,
		Subjects:   []string{prefix + ">"},
		Storage:    jetstream.MemoryStorage,
		Duplicates: window,
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, streamName)
	})
	return &Stream{JS: js, Stream: stream, Name: streamName, Prefix: prefix}
}

// StoredMsg is a message read back from a stream.
type StoredMsg struct {
	Subject string
	MsgID   string
	Data    string
	Headers nats.Header
}

// Messages reads every message in the stream, in stream order.
func (s *Stream) Messages(t *testing.T) []StoredMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	info, err := s.Stream.Info(ctx)
	require.NoError(t, err)
	total := int(info.State.Msgs)
	cons, err := s.Stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	require.NoError(t, err)
	out := make([]StoredMsg, 0, total)
	for len(out) < total {
		batch, err := cons.Fetch(min(total-len(out), 1000), jetstream.FetchMaxWait(5*time.Second))
		require.NoError(t, err)
		n := 0
		for m := range batch.Messages() {
			n++
			out = append(out, StoredMsg{
				Subject: m.Subject(),
				MsgID:   m.Headers().Get(jetstream.MsgIDHeader),
				Data:    string(m.Data()),
				Headers: m.Headers(),
			})
		}
		require.NoError(t, batch.Error())
		require.NotZero(t, n, "stream stopped yielding messages after %d of %d", len(out), total)
	}
	return out
}

// Logger returns a logger that writes warnings and errors to the test's
// output.
func Logger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// Enqueue stages msgs in a transaction of its own and commits it.
func Enqueue(t *testing.T, pool *pgxpool.Pool, msgs ...outbox.Message) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.NoError(t, outbox.Enqueue(ctx, tx, msgs...))
	require.NoError(t, tx.Commit(ctx))
}

// NewRelay returns a relay with a test logger and fast retries, unless cfg
// says otherwise.
func NewRelay(t *testing.T, pool *pgxpool.Pool, pub outbox.Publisher, cfg outbox.Config) *outbox.Relay {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = Logger(t)
	}
	if cfg.RetryBaseDelay == 0 {
		cfg.RetryBaseDelay = 5 * time.Millisecond
	}
	if cfg.RetryMaxDelay == 0 {
		cfg.RetryMaxDelay = 20 * time.Millisecond
	}
	r, err := outbox.New(pool, pub, &cfg)
	require.NoError(t, err)
	return r
}

// Start starts r and stops it at cleanup.
func Start(t *testing.T, r *outbox.Relay) {
	t.Helper()
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(r.Stop)
}

// Drain runs r until a batch publishes nothing and returns the total.
func Drain(t *testing.T, r *outbox.Relay) int {
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

// Eventually polls cond, on the test's goroutine (so cond may use require),
// until it holds, failing the test after a generous bound.
func Eventually(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(45 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in time")
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// Publish calls pub outside a relay and returns each message's outcome;
// a message without one fails the test.
func Publish(t *testing.T, pub outbox.Publisher, msgs ...outbox.Envelope) []error {
	t.Helper()
	res := outbox.NewResults(len(msgs))
	pub.Publish(context.Background(), msgs, res)
	errs := make([]error, len(msgs))
	for i := range msgs {
		require.True(t, res.Reported(i), "message %d has no outcome", i)
		errs[i] = res.Err(i)
	}
	return errs
}
