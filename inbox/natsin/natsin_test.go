package natsin_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// env is one test's database, stream and JetStream consumer.
type env struct {
	d        *pgtest.DB
	url      string
	js       jetstream.JetStream
	stream   *outboxtest.Stream
	consumer string
}

func newEnv(t *testing.T, cc jetstream.ConsumerConfig) *env {
	t.Helper()
	d := pgtest.New(t)
	inboxtest.CreateEffects(t, d)
	url := outboxtest.NATSURL(t)
	js := outboxtest.Conn(t, url)
	st := outboxtest.NewStream(t, js, 2*time.Minute)
	e := &env{d: d, url: url, js: js, stream: st, consumer: "C" + strings.ToUpper(outboxtest.UniqueName())}
	e.createConsumer(t, cc)
	return e
}

// createConsumer creates the test's durable pull consumer with explicit
// acks and the given settings (MaxDeliver 5 and AckWait 30 s unless set).
func (e *env) createConsumer(t *testing.T, cc jetstream.ConsumerConfig) {
	t.Helper()
	cc.Durable = e.consumer // AckPolicy's zero value is AckExplicitPolicy
	if cc.MaxDeliver == 0 {
		cc.MaxDeliver = 5
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := e.js.CreateOrUpdateConsumer(ctx, e.stream.Name, cc)
	require.NoError(t, err)
}

func (e *env) publish(t *testing.T, id string, data []byte, extra ...string) {
	t.Helper()
	m := nats.NewMsg(e.stream.Prefix + "receipts")
	m.Data = data
	if id != "" {
		m.Header.Set(jetstream.MsgIDHeader, id)
	}
	for i := 0; i+1 < len(extra); i += 2 {
		m.Header.Set(extra[i], extra[i+1])
	}
	_, err := e.js.PublishMsg(context.Background(), m)
	require.NoError(t, err)
}

func (e *env) inbox(t *testing.T, pool *pgxpool.Pool, mod ...func(*inbox.Config)) *inbox.Inbox {
	t.Helper()
	if pool == nil {
		pool = e.d.Pool
	}
	cfg := inbox.Config{Consumer: "receipts", Logger: inboxtest.Logger(t)}
	for _, m := range mod {
		m(&cfg)
	}
	in, err := inbox.New(pool, &cfg)
	require.NoError(t, err)
	return in
}

func (e *env) newConsumer(t *testing.T, in *inbox.Inbox, js jetstream.JetStream, h natsin.Handler, mod ...func(*natsin.Config)) *natsin.Consumer {
	t.Helper()
	if js == nil {
		js = e.js
	}
	cfg := natsin.Config{Stream: e.stream.Name, Consumer: e.consumer, FetchWait: 200 * time.Millisecond,
		NakBaseDelay: 10 * time.Millisecond, NakMaxDelay: 50 * time.Millisecond}
	for _, m := range mod {
		m(&cfg)
	}
	c, err := natsin.New(in, js, h, &cfg)
	require.NoError(t, err)
	return c
}

func (e *env) consumerInfo(t *testing.T) *jetstream.ConsumerInfo {
	t.Helper()
	cons, err := e.js.Consumer(context.Background(), e.stream.Name, e.consumer)
	require.NoError(t, err)
	info, err := cons.Info(context.Background())
	require.NoError(t, err)
	return info
}

// settled reports that the JetStream consumer has nothing left to deliver
// and nothing awaiting an acknowledgement.
func (e *env) settled(t *testing.T) bool {
	info := e.consumerInfo(t)
	return info.NumPending == 0 && info.NumAckPending == 0 && info.NumRedelivered == 0
}

// writeEffect is a handler that writes one effect row per message.
func writeEffect(runs *atomic.Int64) natsin.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg natsin.Message) error {
		runs.Add(1)
		return inboxtest.WriteEffect(ctx, tx, "receipts", msg.ID, msg.Data)
	}
}

// runUntil calls RunOnce until cond holds.
func runUntil(t *testing.T, c *natsin.Consumer, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		require.True(t, time.Now().Before(deadline), "condition not reached in time")
		_, err := c.RunOnce(context.Background())
		require.NoError(t, err)
	}
}

// 10,000 messages, each in the stream twice, in random order, consumed by
// eight Consumers at once (each with its own NATS connection, as separate
// processes would be): every handler effect is written exactly once, and
// every second copy is acknowledged without running the handler. The
// copies are published with the id in a header JetStream does not
// deduplicate on, so that the stream really holds both.
func TestTenThousandMessagesDeliveredTwiceTakeEffectOnce(t *testing.T) {
	t.Parallel()
	const total, consumers = 10_000, 8
	e := newEnv(t, jetstream.ConsumerConfig{MaxAckPending: 4 * total})
	order := make([]int, 0, 2*total)
	for i := range total {
		order = append(order, i, i)
	}
	rand.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	for chunk := range slices.Chunk(order, 1000) { // within the client's limit of pending async publishes
		futures := make([]jetstream.PubAckFuture, 0, len(chunk))
		for _, i := range chunk {
			m := nats.NewMsg(e.stream.Prefix + "receipts")
			m.Header.Set("Test-Id", fmt.Sprintf("msg-%05d", i))
			m.Data = []byte(strconv.Itoa(i))
			f, err := e.js.PublishMsgAsync(m)
			require.NoError(t, err)
			futures = append(futures, f)
		}
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Fatal("publish not acknowledged")
			}
		}
	}
	require.Len(t, e.stream.Messages(t), 2*total, "the stream holds both copies of every message")

	var runs atomic.Int64
	all := make([]*natsin.Consumer, consumers)
	ins := make([]*inbox.Inbox, consumers)
	for i := range all {
		ins[i] = e.inbox(t, nil)
		all[i] = e.newConsumer(t, ins[i], outboxtest.Conn(t, e.url), writeEffect(&runs), func(c *natsin.Config) {
			c.MessageID = func(m jetstream.Msg) string { return m.Headers().Get("Test-Id") }
			c.Concurrency = 2
		})
		require.NoError(t, all[i].Start(context.Background()))
		t.Cleanup(all[i].Stop)
	}
	began := time.Now()
	deadline := began.Add(5 * time.Minute) // the race detector slows an in-process NATS server a lot
	for {
		var acked uint64
		for _, c := range all {
			acked += c.Stats().Acked
		}
		if acked == 2*total {
			break
		}
		require.True(t, time.Now().Before(deadline), "%d of %d deliveries acknowledged", acked, 2*total)
		time.Sleep(10 * time.Millisecond)
	}
	elapsed := time.Since(began)
	for _, c := range all {
		c.Stop()
	}

	var st natsin.Stats
	var is inbox.Stats
	for i, c := range all {
		s := c.Stats()
		st.Acked += s.Acked
		st.Duplicates += s.Duplicates
		st.Failed += s.Failed
		x := ins[i].Stats()
		is.Handled += x.Handled
		is.Duplicates += x.Duplicates
		is.Retries += x.Retries
	}
	t.Logf("%d deliveries by %d consumers in %v (%.0f/s); %d transaction retries", 2*total, consumers,
		elapsed.Round(time.Millisecond), 2*total/elapsed.Seconds(), is.Retries)
	require.Equal(t, natsin.Stats{Acked: 2 * total, Duplicates: total}, st)
	require.EqualValues(t, total, is.Handled)
	require.EqualValues(t, total, is.Duplicates)
	require.Equal(t, total, e.d.Count(t, `SELECT count(*) FROM effects`), "each effect once")
	require.Equal(t, total, e.d.Count(t, `SELECT count(DISTINCT message_id) FROM effects`))
	require.Zero(t, e.d.Count(t, `SELECT count(*) FROM effects WHERE message_id <> 'msg-' || lpad(convert_from(body, 'UTF8'), 5, '0')`))
	require.Equal(t, total, e.d.Count(t, `SELECT count(*) FROM inbox_messages WHERE consumer = 'receipts'`))
	require.True(t, e.settled(t), "every delivery acknowledged")
}

// A handler failure rolls back and NAKs the message with a delay; the
// next delivery runs the handler again and commits. The message is
// acknowledged once.
func TestHandlerFailureIsNakedAndHandledOnRedelivery(t *testing.T) {
	t.Parallel()
	e := newEnv(t, jetstream.ConsumerConfig{})
	e.publish(t, "0193b1c2-7d3e-7a10-8b2c-1f2e3d4c5b6a", []byte("ride 1"))
	var deliveries []int
	var mu sync.Mutex
	var runs atomic.Int64
	c := e.newConsumer(t, e.inbox(t, nil), nil, func(ctx context.Context, tx pgx.Tx, msg natsin.Message) error {
		mu.Lock()
		deliveries = append(deliveries, msg.Delivery)
		mu.Unlock()
		if err := writeEffect(&runs)(ctx, tx, msg); err != nil {
			return err
		}
		if msg.Delivery == 1 {
			return errors.New("downstream unavailable")
		}
		return nil
	})
	runUntil(t, c, func() bool { return c.Stats().Acked == 1 })
	require.Equal(t, []int{1, 2}, deliveries)
	require.Equal(t, natsin.Stats{Acked: 1, Failed: 1}, c.Stats())
	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM effects`), "the failed delivery's write rolled back")
	outboxtest.Eventually(t, func() bool { return e.settled(t) })
}

// A poison message (its handler fails on every delivery) is dead-lettered
// in the inbox after MaxDeliver deliveries, with its error, subject,
// payload and headers, and terminated: the server stops delivering it. A
// good message beside it is handled.
func TestPoisonMessageIsDeadLetteredAfterMaxDeliverWithItsError(t *testing.T) {
	t.Parallel()
	e := newEnv(t, jetstream.ConsumerConfig{MaxDeliver: 3})
	e.publish(t, "poison-1", []byte("{not json"), "Content-Type", "application/json")
	e.publish(t, "good-1", []byte(`{"ride":1}`))
	var poisonRuns, runs atomic.Int64
	in := e.inbox(t, nil)
	c := e.newConsumer(t, in, nil, func(ctx context.Context, tx pgx.Tx, msg natsin.Message) error {
		if msg.ID == "poison-1" {
			poisonRuns.Add(1)
			return fmt.Errorf("decode receipt: invalid character 'n' (delivery %d)", msg.Delivery)
		}
		return writeEffect(&runs)(ctx, tx, msg)
	})
	runUntil(t, c, func() bool { return c.Stats().DeadLettered == 1 && c.Stats().Acked == 1 })
	require.EqualValues(t, 3, poisonRuns.Load(), "one run per delivery, MaxDeliver of them")
	require.Equal(t, natsin.Stats{Acked: 1, Failed: 2, DeadLettered: 1}, c.Stats())

	var (
		lastError, topic, headers string
		payload                   []byte
		deliveries                int
	)
	require.NoError(t, e.d.Pool.QueryRow(context.Background(), `SELECT last_error, topic, payload, headers::text, deliveries
		FROM inbox_messages WHERE consumer = 'receipts' AND message_id = 'poison-1' AND dead_at IS NOT NULL`).
		Scan(&lastError, &topic, &payload, &headers, &deliveries))
	require.Equal(t, "inbox: handle: decode receipt: invalid character 'n' (delivery 3)", lastError)
	require.Equal(t, e.stream.Prefix+"receipts", topic)
	require.Equal(t, "{not json", string(payload))
	require.Contains(t, headers, `"Content-Type": ["application/json"]`)
	require.Equal(t, 3, deliveries)
	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM effects WHERE message_id = 'good-1'`))
	require.Zero(t, e.d.Count(t, `SELECT count(*) FROM effects WHERE message_id = 'poison-1'`))
	outboxtest.Eventually(t, func() bool { return e.settled(t) })
	require.EqualValues(t, 1, in.Stats().DeadLettered)
}

// Messages without a usable id cannot be handled exactly once: they are
// terminated (the server stops delivering them) without a single
// statement reaching the database, and logged.
func TestMessagesWithoutAUsableIDAreTerminatedBeforeAnySQL(t *testing.T) {
	t.Parallel()
	e := newEnv(t, jetstream.ConsumerConfig{})
	pool, counter := inboxtest.CountingPool(t, e.d)
	e.publish(t, "", []byte("no id"))
	e.publish(t, strings.Repeat("x", inbox.MaxMessageIDBytes+1), []byte("oversized id"))
	e.publish(t, "caf\u00e9-\x7f", []byte("non-printable id"))
	var runs atomic.Int64
	c := e.newConsumer(t, e.inbox(t, pool), nil, writeEffect(&runs))
	runUntil(t, c, func() bool { return c.Stats().Rejected == 3 })
	require.Zero(t, runs.Load())
	require.Zero(t, counter.N(), "no statement reached the server")
	require.Equal(t, natsin.Stats{Rejected: 3}, c.Stats())
	outboxtest.Eventually(t, func() bool { return e.settled(t) })
}

// Start refuses settings under which a message could come back after the
// inbox forgot it, or could not be acknowledged one by one after its
// commit; it names what to change. A stream MaxAge inside the retention
// bounds an unlimited MaxDeliver.
func TestStartRefusesARedeliveryHorizonTheRetentionDoesNotCover(t *testing.T) {
	t.Parallel()
	e := newEnv(t, jetstream.ConsumerConfig{MaxDeliver: -1})
	var runs atomic.Int64
	hour := func(c *inbox.Config) { c.Retention = time.Hour }
	start := func(in *inbox.Inbox) error {
		c := e.newConsumer(t, in, nil, writeEffect(&runs))
		err := c.Start(context.Background())
		c.Stop()
		return err
	}

	err := start(e.inbox(t, nil))
	require.ErrorIs(t, err, inbox.ErrRetentionTooShort)
	require.ErrorContains(t, err, "MaxDeliver -1")
	require.ErrorContains(t, err, "MaxAge 0")

	e.createConsumer(t, jetstream.ConsumerConfig{MaxDeliver: 10, AckWait: 10 * time.Minute})
	err = start(e.inbox(t, nil, hour))
	require.ErrorIs(t, err, inbox.ErrRetentionTooShort)
	require.ErrorContains(t, err, "MaxDeliver 10 x 10m0s")
	require.ErrorContains(t, err, "1h40m0s")
	_, err = e.newConsumer(t, e.inbox(t, nil, hour), nil, writeEffect(&runs)).RunOnce(context.Background())
	require.ErrorIs(t, err, inbox.ErrRetentionTooShort, "RunOnce checks too")
	require.NoError(t, start(e.inbox(t, nil)), "7 days cover 100 minutes")

	// A stream that drops messages after 30 minutes bounds any MaxDeliver.
	ctx := context.Background()
	cfg := e.stream.Stream.CachedInfo().Config
	cfg.MaxAge = 30 * time.Minute
	_, err = e.js.UpdateStream(ctx, cfg)
	require.NoError(t, err)
	e.createConsumer(t, jetstream.ConsumerConfig{MaxDeliver: -1})
	require.NoError(t, start(e.inbox(t, nil, hour)))

	// Acknowledgements must be explicit, one message at a time.
	_, err = e.js.CreateOrUpdateConsumer(ctx, e.stream.Name, jetstream.ConsumerConfig{
		Durable: "ACKALL" + e.consumer, AckPolicy: jetstream.AckAllPolicy, MaxDeliver: 3})
	require.NoError(t, err)
	c, err := natsin.New(e.inbox(t, nil), e.js, writeEffect(&runs), &natsin.Config{Stream: e.stream.Name, Consumer: "ACKALL" + e.consumer})
	require.NoError(t, err)
	require.ErrorIs(t, c.Start(ctx), natsin.ErrConsumerSettings)

	missing, err := natsin.New(e.inbox(t, nil), e.js, writeEffect(&runs), &natsin.Config{Stream: e.stream.Name, Consumer: "NOSUCH"})
	require.NoError(t, err)
	require.ErrorIs(t, missing.Start(ctx), jetstream.ErrConsumerNotFound)
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	in, err := inbox.New(d.Pool, &inbox.Config{Consumer: "c"})
	require.NoError(t, err)
	js := outboxtest.Conn(t, outboxtest.NATSURL(t))
	h := func(context.Context, pgx.Tx, natsin.Message) error { return nil }
	for name, cfg := range map[string]*natsin.Config{
		"nil":             nil,
		"no stream":       {Consumer: "C"},
		"no consumer":     {Stream: "S"},
		"dotted consumer": {Stream: "S", Consumer: "a.b"},
		"negative":        {Stream: "S", Consumer: "C", Concurrency: -1},
		"tiny fetch wait": {Stream: "S", Consumer: "C", FetchWait: time.Millisecond},
		"base above max":  {Stream: "S", Consumer: "C", NakBaseDelay: time.Minute, NakMaxDelay: time.Second},
	} {
		_, err := natsin.New(in, js, h, cfg)
		require.ErrorIs(t, err, natsin.ErrInvalidConfig, name)
		require.ErrorIs(t, err, inbox.ErrInvalidConfig, name)
	}
	_, err = natsin.New(nil, js, h, &natsin.Config{Stream: "S", Consumer: "C"})
	require.ErrorIs(t, err, natsin.ErrInvalidConfig)
	_, err = natsin.New(in, js, nil, &natsin.Config{Stream: "S", Consumer: "C"})
	require.ErrorIs(t, err, natsin.ErrInvalidConfig)
}

// Stop lets the messages already received finish: a handler in flight
// when Stop is called commits and its message is acknowledged.
func TestStopFinishesTheMessagesInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t, jetstream.ConsumerConfig{})
	e.publish(t, "m1", []byte("1"))
	entered := make(chan struct{})
	release := make(chan struct{})
	var runs atomic.Int64
	c := e.newConsumer(t, e.inbox(t, nil), nil, func(ctx context.Context, tx pgx.Tx, msg natsin.Message) error {
		close(entered)
		<-release
		return writeEffect(&runs)(ctx, tx, msg)
	})
	require.NoError(t, c.Start(context.Background()))
	require.ErrorIs(t, c.Start(context.Background()), natsin.ErrAlreadyStarted)
	<-entered
	stopped := make(chan struct{})
	go func() { c.Stop(); close(stopped) }()
	select {
	case <-stopped:
		t.Fatal("Stop returned while a handler was in flight")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-stopped
	require.Equal(t, natsin.Stats{Acked: 1}, c.Stats())
	require.Equal(t, 1, e.d.Count(t, `SELECT count(*) FROM effects`))
	c.Stop() // idempotent
}
