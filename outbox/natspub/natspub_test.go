package natspub_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/outboxtest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/natspub"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The NATS publisher publishes to prefix+topic with the message's headers
// and Nats-Msg-Id = the message's UUID, waits for the acknowledgement, and a republish of
// the same id is dropped by the stream (and still counts as success). Bad
// subjects fail permanently; a subject without a stream is retried.
func TestNATSPublisherMsgIDAndDedup(t *testing.T) {
	t.Parallel()
	js := outboxtest.Conn(t, outboxtest.NATSURL(t))
	ts := outboxtest.NewStream(t, js, 2*time.Minute)

	pub, err := natspub.New(js, &natspub.Config{SubjectPrefix: ts.Prefix})
	require.NoError(t, err)
	id := uuid.Must(uuid.NewV7())
	e := outbox.Envelope{ID: id, Topic: "orders.created", Payload: []byte(`{"id":1}`), Headers: map[string]string{"X-Trace": "abc", "Nats-Msg-Id": "forged"}, Attempt: 1}
	require.Equal(t, []error{nil}, outboxtest.Publish(t, pub, e))
	e.Attempt = 2
	require.Equal(t, []error{nil}, outboxtest.Publish(t, pub, e), "a duplicate is a success")

	msgs := ts.Messages(t)
	require.Len(t, msgs, 1)
	require.Equal(t, ts.Prefix+"orders.created", msgs[0].Subject)
	require.Equal(t, id.String(), msgs[0].MsgID)
	require.Equal(t, `{"id":1}`, msgs[0].Data)
	require.Equal(t, "abc", msgs[0].Headers.Get("X-Trace"))

	errs := outboxtest.Publish(t, pub,
		outbox.Envelope{ID: uuid.Must(uuid.NewV7()), Topic: "has space"},
		outbox.Envelope{ID: uuid.Must(uuid.NewV7()), Topic: "wild.*"},
		outbox.Envelope{ID: uuid.Must(uuid.NewV7()), Topic: "trailing."})
	for _, err := range errs {
		require.ErrorIs(t, err, outbox.ErrPermanent)
	}
	noStream, err := natspub.New(js, &natspub.Config{SubjectPrefix: "nostream" + outboxtest.UniqueName() + "."})
	require.NoError(t, err)
	err = outboxtest.Publish(t, noStream, outbox.Envelope{ID: uuid.Must(uuid.NewV7()), Topic: "t"})[0]
	require.Error(t, err)
	require.NotErrorIs(t, err, outbox.ErrPermanent)

	_, err = natspub.New(nil, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = natspub.New(js, &natspub.Config{SubjectPrefix: "a.>"})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

// New refuses an unusable configuration with an error matching this
// package's ErrInvalidConfig and outbox's, and fills the defaults.
func TestNewValidatesConfigAndFillsDefaults(t *testing.T) {
	t.Parallel()
	js := outboxtest.Conn(t, outboxtest.NATSURL(t))
	_, err := natspub.New(nil, nil)
	require.ErrorIs(t, err, natspub.ErrInvalidConfig)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	for _, cfg := range []natspub.Config{
		{MaxInFlight: -1},
		{Streams: []string{""}},
		{Streams: []string{"ORDERS", "a.b"}},
		{SubjectPrefix: "a.>"},
		{SubjectPrefix: "a b."},
	} {
		_, err := natspub.New(js, &cfg)
		require.ErrorIs(t, err, natspub.ErrInvalidConfig, "%+v", cfg)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%+v", cfg)
	}
	streams := []string{"ORDERS"}
	p, err := natspub.New(js, &natspub.Config{Streams: streams})
	require.NoError(t, err)
	c := natspub.ConfigOf(p)
	require.Equal(t, 64, c.MaxInFlight)
	require.Equal(t, natspub.MaxInFlightDefault, c.MaxInFlight)
	streams[0] = "CHANGED"
	require.Equal(t, []string{"ORDERS"}, natspub.ConfigOf(p).Streams, "New keeps its own copy")
}

// The relay crashes after JetStream acknowledged the batch but before the
// rows were marked: its database connection is killed right after
// publishing, so the claim transaction never commits. After a new relay
// runs, the stream holds each message exactly once (the republish is
// dropped as a duplicate of its Nats-Msg-Id) and every row is published.
// A lost acknowledgement (published, but reported failed) ends the same way.
func TestRelayCrashAfterAckBeforeMark(t *testing.T) {
	t.Parallel()
	url := outboxtest.NATSURL(t)

	stage := func(t *testing.T, pool *pgxpool.Pool) []string {
		for i := range 4 {
			outboxtest.Enqueue(t, pool,
				outbox.Message{Topic: "evt", OrderingKey: "k" + strconv.Itoa(i), Payload: fmt.Appendf(nil, "k%d-1", i)},
				outbox.Message{Topic: "evt", OrderingKey: "k" + strconv.Itoa(i), Payload: fmt.Appendf(nil, "k%d-2", i)},
				outbox.Message{Topic: "evt", Payload: fmt.Appendf(nil, "u%d", i)})
		}
		var ids []string
		rows, err := pool.Query(context.Background(), "SELECT message_id::text FROM outbox_messages ORDER BY message_id")
		require.NoError(t, err)
		for rows.Next() {
			var id string
			require.NoError(t, rows.Scan(&id))
			ids = append(ids, id)
		}
		require.NoError(t, rows.Err())
		return ids
	}
	verify := func(t *testing.T, d *pgtest.DB, ts *outboxtest.Stream, ids []string, attempts int) {
		msgs := ts.Messages(t)
		var got []string
		for _, m := range msgs {
			got = append(got, m.MsgID)
		}
		slices.Sort(got)
		require.Equal(t, ids, got, "each message exactly once in the stream")
		require.Equal(t, len(ids), d.Count(t,
			"SELECT count(*) FROM outbox_messages WHERE published_at IS NOT NULL AND attempts = $1", attempts))
	}

	t.Run("process killed", func(t *testing.T) {
		t.Parallel()
		d := pgtest.New(t)
		js := outboxtest.Conn(t, url)
		ts := outboxtest.NewStream(t, js, 2*time.Minute)
		ids := stage(t, d.Pool)
		nats, err := natspub.New(js, &natspub.Config{SubjectPrefix: ts.Prefix})
		require.NoError(t, err)

		app := "crashing_" + outboxtest.UniqueName()
		crashPool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
		crashing := publisherFunc(func(ctx context.Context, msgs []outbox.Envelope, res *outbox.Results) {
			nats.Publish(ctx, msgs, res)
			// The process dies: its connection, and the claim transaction
			// with it, are gone before anything is marked.
			_, err := d.Pool.Exec(context.Background(),
				"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", app)
			require.NoError(t, err)
		})
		r := outboxtest.NewRelay(t, crashPool, crashing, outbox.Config{})
		_, err = r.RunOnce(context.Background())
		require.Error(t, err)
		require.Zero(t, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NOT NULL OR attempts > 0"))
		require.Len(t, ts.Messages(t), len(ids), "JetStream has the whole batch")
		// pg_terminate_backend only signals: the dead session's row locks
		// last until its backend has exited, and SKIP LOCKED would skip them.
		require.Eventually(t, func() bool {
			return d.Count(t, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app) == 0
		}, 30*time.Second, 10*time.Millisecond)

		restarted := outboxtest.NewRelay(t, d.Pool, nats, outbox.Config{})
		require.Equal(t, len(ids), outboxtest.Drain(t, restarted))
		verify(t, d, ts, ids, 1)
	})

	t.Run("acknowledgement lost", func(t *testing.T) {
		t.Parallel()
		d := pgtest.New(t)
		js := outboxtest.Conn(t, url)
		ts := outboxtest.NewStream(t, js, 2*time.Minute)
		ids := stage(t, d.Pool)
		nats, err := natspub.New(js, &natspub.Config{SubjectPrefix: ts.Prefix})
		require.NoError(t, err)
		var lost atomic.Bool
		lossy := publisherFunc(func(ctx context.Context, msgs []outbox.Envelope, res *outbox.Results) {
			if !lost.CompareAndSwap(false, true) {
				nats.Publish(ctx, msgs, res)
				return
			}
			// Published, but every acknowledgement is lost on the way back.
			nats.Publish(ctx, msgs, outbox.NewResults(len(msgs)))
			for i := range msgs {
				res.Set(i, errors.New("ack lost"))
			}
		})
		r := outboxtest.NewRelay(t, d.Pool, lossy, outbox.Config{RetryBaseDelay: time.Millisecond, RetryMaxDelay: time.Millisecond})
		outboxtest.Eventually(t, func() bool {
			_, err := r.RunOnce(context.Background())
			require.NoError(t, err)
			return d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NULL") == 0
		})
		// The first wave's messages (the heads and unordered ones) were
		// published twice and stored once.
		require.Equal(t, 8, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE attempts = 2 AND last_error = 'ack lost'"))
		msgs := ts.Messages(t)
		require.Len(t, msgs, len(ids))
		var got []string
		for _, m := range msgs {
			got = append(got, m.MsgID)
		}
		slices.Sort(got)
		require.Equal(t, ids, got)
	})
}

// publisherFunc adapts a batch function to Publisher.
type publisherFunc func(ctx context.Context, msgs []outbox.Envelope, res *outbox.Results)

func (f publisherFunc) Publish(ctx context.Context, msgs []outbox.Envelope, res *outbox.Results) {
	f(ctx, msgs, res)
}

// Four relays drain 10,000 messages on 100 ordering keys into JetStream
// while eight producers commit them concurrently. Every message is
// published, the stream holds each exactly once, and within each ordering
// key the stream order is the commit order.
//
// Commit order is witnessed independently of the outbox: each producer
// transaction increments a per-key counter row and stamps the value into its
// messages. The row lock is held until commit, so the counter values of a
// key increase in commit order, and the stream must hold them as 1, 2, 3...
func TestRelayConcurrentDrainIntoJetStream(t *testing.T) {
	t.Parallel()
	const (
		total     = 10000
		keys      = 100
		producers = 8
		relays    = 4
	)
	d := pgtest.New(t)
	url := outboxtest.NATSURL(t)
	ts := outboxtest.NewStream(t, outboxtest.Conn(t, url), 2*time.Minute)
	ctx := context.Background()
	_, err := d.Pool.Exec(ctx, `CREATE TABLE drain_seq (ordering_key text PRIMARY KEY, n integer NOT NULL DEFAULT 0);
		INSERT INTO drain_seq (ordering_key) SELECT 'key-' || i FROM generate_series(0, 99) AS i`)
	require.NoError(t, err)

	all := make([]*outbox.Relay, relays)
	for i := range all {
		pub, err := natspub.New(outboxtest.Conn(t, url), &natspub.Config{SubjectPrefix: ts.Prefix})
		require.NoError(t, err)
		all[i] = outboxtest.NewRelay(t, d.Pool, pub, outbox.Config{PollInterval: 100 * time.Millisecond})
		outboxtest.Start(t, all[i])
	}

	// The producers' commits need not wait for the disk: commit order, which
	// is what the test checks, is the same either way.
	producerPool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["synchronous_commit"] = "off" })

	began := time.Now()
	var left atomic.Int64
	left.Store(total)
	produce := func() error {
		for {
			n := int64(1 + rand.IntN(6))
			if rest := left.Add(-n); rest < 0 {
				n += rest
				if n <= 0 {
					return nil
				}
			}
			msgKeys := make([]string, n)
			for i := range msgKeys {
				msgKeys[i] = "key-" + strconv.Itoa(rand.IntN(keys))
			}
			slices.Sort(msgKeys) // counter rows locked in one order: no deadlocks
			tx, err := producerPool.Begin(ctx)
			if err != nil {
				return err
			}
			msgs := make([]outbox.Message, n)
			for i, k := range msgKeys {
				var seq int
				if err := tx.QueryRow(ctx, "UPDATE drain_seq SET n = n + 1 WHERE ordering_key = $1 RETURNING n", k).Scan(&seq); err != nil {
					_ = tx.Rollback(ctx)
					return err
				}
				msgs[i] = outbox.Message{Topic: "drain", OrderingKey: k, Payload: fmt.Appendf(nil, "%s/%d", k, seq)}
			}
			if err := outbox.Enqueue(ctx, tx, msgs...); err != nil {
				_ = tx.Rollback(ctx)
				return err
			}
			if err := tx.Commit(ctx); err != nil {
				return err
			}
		}
	}
	errs := make(chan error, producers)
	for range producers {
		go func() { errs <- produce() }()
	}
	for range producers {
		require.NoError(t, <-errs)
	}
	enqueued := time.Since(began)

	outboxtest.Eventually(t, func() bool {
		return d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NOT NULL") == total
	})
	drained := time.Since(began)
	var perRelay []uint64
	for _, r := range all {
		s, err := r.Stats(ctx)
		require.NoError(t, err)
		perRelay = append(perRelay, s.Published)
		require.Zero(t, s.Retried+s.Dead)
	}
	t.Logf("%d messages: enqueued by %d producers in %v, all published by %d relays after %v (%.0f msg/s); per relay %v",
		total, producers, enqueued.Round(time.Millisecond), relays, drained.Round(time.Millisecond),
		total/drained.Seconds(), perRelay)

	msgs := ts.Messages(t)
	require.Len(t, msgs, total, "each message once in the stream")
	seen := make(map[string]bool, total)
	next := make(map[string]int, keys)
	for _, m := range msgs {
		require.False(t, seen[m.MsgID], "message %s twice in the stream", m.MsgID)
		seen[m.MsgID] = true
		key, seqText, ok := strings.Cut(m.Data, "/")
		require.True(t, ok)
		seq, err := strconv.Atoi(seqText)
		require.NoError(t, err)
		require.Equal(t, next[key]+1, seq, "key %s out of commit order", key)
		next[key] = seq
	}
	var committed int
	for _, n := range next {
		committed += n
	}
	require.Equal(t, total, committed)
	require.Equal(t, total, d.Count(t, "SELECT sum(n) FROM drain_seq"))
}

// Two installations (two schemas, each with its own outbox and identity
// sequence) publish into one stream: every message of both is stored, none
// is dropped as a duplicate of the other installation's.
func TestTwoInstallationsShareAStreamWithoutDedupingEachOther(t *testing.T) {
	t.Parallel()
	js := outboxtest.Conn(t, outboxtest.NATSURL(t))
	ts := outboxtest.NewStream(t, js, 2*time.Minute)
	for _, name := range []string{"billing", "shipping"} {
		d := pgtest.New(t)
		for i := range 5 {
			outboxtest.Enqueue(t, d.Pool, outbox.Message{Topic: "evt", Payload: fmt.Appendf(nil, "%s-%d", name, i)})
		}
		pub, err := natspub.New(js, &natspub.Config{SubjectPrefix: ts.Prefix})
		require.NoError(t, err)
		require.Equal(t, 5, outboxtest.Drain(t, outboxtest.NewRelay(t, d.Pool, pub, outbox.Config{})))
	}
	msgs := ts.Messages(t)
	require.Len(t, msgs, 10, "each installation's five messages")
	ids := make(map[string]bool)
	for _, m := range msgs {
		ids[m.MsgID] = true
	}
	require.Len(t, ids, 10)
}

// After the schema is rolled back and migrated again (the row ids start
// over, as after restoring an old backup), new messages get new ids: the
// stream stores them instead of dropping them as duplicates of the earlier
// ones.
func TestNewMessagesAfterDownToZeroAndUpAreNotDuplicates(t *testing.T) {
	t.Parallel()
	js := outboxtest.Conn(t, outboxtest.NATSURL(t))
	ts := outboxtest.NewStream(t, js, 2*time.Minute)
	d := pgtest.New(t)
	// Rolling back drops the outbox table: an explicit opt-in on the
	// migrating connection allows it.
	pool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["atomicphase.allow_data_loss"] = "on" })
	pub, err := natspub.New(js, &natspub.Config{SubjectPrefix: ts.Prefix})
	require.NoError(t, err)
	ctx := context.Background()
	for round := range 2 {
		if round == 1 {
			require.NoError(t, migrations.DownTo(ctx, pool, 0))
			require.NoError(t, migrations.Up(ctx, pool))
		}
		for i := range 5 {
			outboxtest.Enqueue(t, d.Pool, outbox.Message{Topic: "evt", Payload: fmt.Appendf(nil, "round%d-%d", round, i)})
		}
		require.Equal(t, 5, outboxtest.Drain(t, outboxtest.NewRelay(t, d.Pool, pub, outbox.Config{})))
	}
	var stored []string
	for _, m := range ts.Messages(t) {
		stored = append(stored, m.Data)
	}
	require.ElementsMatch(t, []string{"round0-0", "round0-1", "round0-2", "round0-3", "round0-4",
		"round1-0", "round1-1", "round1-2", "round1-3", "round1-4"}, stored, "both rounds stored")
}

// The publisher reads the stream's duplicate window before a relay runs and
// refuses one shorter than the relay's republish interval, naming both;
// with settings that fit, the relay starts. A named stream that does not
// exist, or a prefix no stream stores, is refused too.
func TestPrepareRefusesADuplicateWindowShorterThanTheRelaysRepublishInterval(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	js := outboxtest.Conn(t, outboxtest.NATSURL(t))
	ts := outboxtest.NewStream(t, js, 2*time.Minute) // JetStream's default window
	pub, err := natspub.New(js, &natspub.Config{SubjectPrefix: ts.Prefix})
	require.NoError(t, err)

	defaults, err := outbox.New(d.Pool, pub, &outbox.Config{Logger: outboxtest.Logger(t)})
	require.NoError(t, err)
	err = defaults.Start(context.Background())
	require.ErrorIs(t, err, natspub.ErrDuplicateWindow)
	require.ErrorContains(t, err, "2m0s")
	require.ErrorContains(t, err, "10m21s", "RetryMaxDelay 10m + 2 x PublishTimeout 10s + PollInterval 1s")
	require.ErrorContains(t, err, ts.Name)
	outboxtest.Enqueue(t, d.Pool, outbox.Message{Topic: "t"})
	_, err = defaults.RunOnce(context.Background())
	require.ErrorIs(t, err, natspub.ErrDuplicateWindow)
	require.Zero(t, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE attempts > 0"), "nothing was published")

	fits, err := outbox.New(d.Pool, pub, &outbox.Config{Logger: outboxtest.Logger(t), RetryMaxDelay: time.Minute})
	require.NoError(t, err)
	require.NoError(t, fits.Start(context.Background()))
	fits.Stop()
	require.Equal(t, 1, outboxtest.Drain(t, fits))

	missing, err := natspub.New(js, &natspub.Config{SubjectPrefix: ts.Prefix, Streams: []string{"NO_SUCH_" + ts.Name}})
	require.NoError(t, err)
	_, err = outbox.New(d.Pool, missing, nil)
	require.NoError(t, err)
	relay, err := outbox.New(d.Pool, missing, &outbox.Config{Logger: outboxtest.Logger(t), RetryMaxDelay: time.Minute})
	require.NoError(t, err)
	require.ErrorIs(t, relay.Start(context.Background()), jetstream.ErrStreamNotFound)

	nowhere, err := natspub.New(js, &natspub.Config{SubjectPrefix: "nowhere" + outboxtest.UniqueName() + "."})
	require.NoError(t, err)
	relay, err = outbox.New(d.Pool, nowhere, &outbox.Config{Logger: outboxtest.Logger(t), RetryMaxDelay: time.Minute})
	require.NoError(t, err)
	require.ErrorContains(t, relay.Start(context.Background()), "no JetStream stream stores subjects")
}
