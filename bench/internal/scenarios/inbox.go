package scenarios

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/inbox/natsin"
)

// messageID returns a fresh id shaped like the outbox's: time-ordered, so
// consecutive ids land on the same index page, as UUIDv7s do.
func messageID(seq int64) string {
	return fmt.Sprintf("%016x-%012d", time.Now().UnixNano(), seq)
}

// plainConsumer is the baseline: what a consumer without deduplication
// does with a message, the business row in a READ COMMITTED transaction.
var plainConsumer = subject{name: "plain consumer transaction", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	return func(ctx context.Context, _ int, seq int64) error {
		tx, err := cl.pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx) //nolint:errcheck // after Commit it is a no-op
		if _, err := tx.Exec(ctx, insertRow, messageID(seq), 1, 100); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}, func() {}, nil
}}

// inboxConsumer handles each message through inbox.Handle: the same row,
// with the message's inbox row, in one SERIALIZABLE transaction.
var inboxConsumer = subject{name: "inbox.Handle", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	if _, err := cl.pool.Exec(ctx, "TRUNCATE inbox_messages"); err != nil {
		return nil, nil, err
	}
	in, err := inbox.New(cl.pool, &inbox.Config{Consumer: "bench", Logger: harness.Discard})
	if err != nil {
		return nil, nil, err
	}
	return func(ctx context.Context, _ int, seq int64) error {
		id := messageID(seq)
		out, err := in.Handle(ctx, id, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, insertRow, id, 1, 100)
			return err
		})
		if err == nil && out != inbox.Handled {
			err = errors.New("fresh message reported " + out.String())
		}
		return err
	}, func() {}, nil
}}

// inboxRounds is how many cells of each subject RunInbox runs, interleaved.
const inboxRounds = 2

// inboxDrainMessages is the backlog each consumer drains from JetStream.
const inboxDrainMessages = 10_000

const (
	inStream  = "BENCH_IN"
	inPrefix  = "apbench.in."
	inDurable = "bench"
)

// drainConsumer publishes inboxDrainMessages messages (each with a
// Nats-Msg-Id, as the outbox's publisher sends them) to a fresh stream,
// then times a consumer at concurrency c draining them: every message
// handled, its row committed, and acknowledged. withInbox selects
// natsin with the inbox; otherwise a plain loop does the same pulls
// (batches of 4c), writes the row in a READ COMMITTED transaction and
// acknowledges after the commit.
func (s *Suite) drainConsumer(ctx context.Context, c int, withInbox bool) (float64, error) {
	cl, err := s.newCell(ctx, c)
	if err != nil {
		return 0, err
	}
	defer cl.pool.Close()
	if _, err := cl.pool.Exec(ctx, "TRUNCATE inbox_messages"); err != nil {
		return 0, err
	}
	nc, js, err := freshStream(ctx, s.Env.NATSURL, inStream, inPrefix)
	if err != nil {
		return 0, err
	}
	defer nc.Close()
	defer js.DeleteStream(context.Background(), inStream) //nolint:errcheck // best effort
	cons, err := js.CreateOrUpdateConsumer(ctx, inStream, jetstream.ConsumerConfig{
		Durable: inDurable, AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second,
		MaxDeliver: 5, MaxAckPending: 4 * inboxDrainMessages,
	})
	if err != nil {
		return 0, err
	}
	ids := make([]int, inboxDrainMessages)
	for i := range ids {
		ids[i] = i
	}
	for chunk := range slices.Chunk(ids, 1000) {
		var futures []jetstream.PubAckFuture
		for _, i := range chunk {
			m := nats.NewMsg(inPrefix + "orders")
			m.Header.Set(jetstream.MsgIDHeader, messageID(int64(i)))
			m.Data = seqPayload(int64(i))
			f, err := js.PublishMsgAsync(m)
			if err != nil {
				return 0, err
			}
			futures = append(futures, f)
		}
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				return 0, err
			case <-time.After(30 * time.Second):
				return 0, errors.New("publish not acknowledged")
			}
		}
	}

	write := func(ctx context.Context, tx pgx.Tx, id string) error {
		_, err := tx.Exec(ctx, insertRow, id, 1, 100)
		return err
	}
	deadline := time.Now().Add(drainTimeout)
	began := time.Now()
	if withInbox {
		in, err := inbox.New(cl.pool, &inbox.Config{Consumer: "bench", Logger: harness.Discard})
		if err != nil {
			return 0, err
		}
		consumer, err := natsin.New(in, js, func(ctx context.Context, tx pgx.Tx, msg natsin.Message) error {
			return write(ctx, tx, msg.ID)
		}, &natsin.Config{Stream: inStream, Consumer: inDurable, Concurrency: c, FetchWait: time.Second})
		if err != nil {
			return 0, err
		}
		for consumer.Stats().Acked < inboxDrainMessages {
			if time.Now().After(deadline) {
				return 0, fmt.Errorf("natsin: %d of %d acknowledged", consumer.Stats().Acked, inboxDrainMessages)
			}
			if _, err := consumer.RunOnce(ctx); err != nil {
				return 0, err
			}
		}
	} else {
		var acked atomic.Int64
		var firstErr error
		var mu sync.Mutex
		for acked.Load() < inboxDrainMessages {
			if time.Now().After(deadline) {
				return 0, fmt.Errorf("plain: %d of %d acknowledged (%v)", acked.Load(), inboxDrainMessages, firstErr)
			}
			fctx, cancel := context.WithTimeout(ctx, time.Second)
			batch, err := cons.Fetch(4*c, jetstream.FetchContext(fctx))
			if err != nil {
				cancel()
				return 0, err
			}
			sem := make(chan struct{}, c)
			var wg sync.WaitGroup
			for m := range batch.Messages() {
				sem <- struct{}{}
				wg.Go(func() {
					defer func() { <-sem }()
					err := pgx.BeginFunc(ctx, cl.pool, func(tx pgx.Tx) error {
						return write(ctx, tx, m.Headers().Get(jetstream.MsgIDHeader))
					})
					if err == nil {
						err = m.Ack()
					}
					if err != nil {
						mu.Lock()
						firstErr = cmp.Or(firstErr, err)
						mu.Unlock()
						_ = m.Nak()
						return
					}
					acked.Add(1)
				})
			}
			wg.Wait()
			cancel()
		}
	}
	return float64(inboxDrainMessages) / time.Since(began).Seconds(), nil
}

// RunInbox measures the consumer side at each concurrency, in the same
// run: a consumer draining a JetStream backlog through natsin and the
// inbox, against a plain consumer writing the same row; and, to show the
// inbox's own cost, the same two transactions without the broker.
func (s *Suite) RunInbox(ctx context.Context) error {
	t := &Table{
		Title:    "4b. Inbox: messages handled exactly once vs a plain consumer writing the same row",
		Unit:     "msg/s",
		RatioCol: "ratio vs plain",
	}
	minRatio, minGot := math.Inf(1), ""
	dbMin, dbGot := math.Inf(1), ""
	for _, c := range s.Concurrency {
		// Two interleaved cells of each, keeping each one's best: the
		// figures compare two costs that differ by one row, and a burst of
		// other work on the machine during one cell would otherwise decide
		// the ratio.
		var plainRate, inboxRate float64
		var plain, ours harness.Result
		for range inboxRounds {
			r, err := s.drainConsumer(ctx, c, false)
			if err != nil {
				return fmt.Errorf("plain consumer: %w", err)
			}
			plainRate = max(plainRate, r)
			r, err = s.drainConsumer(ctx, c, true)
			if err != nil {
				return fmt.Errorf("natsin consumer: %w", err)
			}
			inboxRate = max(inboxRate, r)
			p, err := s.measure(ctx, plainConsumer, c)
			if err != nil {
				return err
			}
			o, err := s.measure(ctx, inboxConsumer, c)
			if err != nil {
				return err
			}
			if p.Throughput() > plain.Throughput() {
				plain = p
			}
			if o.Throughput() > ours.Throughput() {
				ours = o
			}
		}
		s.Progress("%-28s c=%-3d plain %6.0f msg/s  natsin+inbox %6.0f msg/s", "JetStream drain", c, plainRate, inboxRate)
		q := ratio(inboxRate, plainRate)
		t.Rows = append(t.Rows,
			Row{System: "JetStream → plain consumer", C: c, Throughput: plainRate, Ratio: 1},
			Row{System: "JetStream → natsin + inbox", C: c, Throughput: inboxRate, Ratio: q})
		if q < minRatio {
			minRatio, minGot = q, "lowest "+strconv.FormatFloat(q, 'f', 2, 64)+"× at c="+strconv.Itoa(c)
		}
		dq := ratio(ours.Throughput(), plain.Throughput())
		t.Rows = append(t.Rows, rowFrom(plainConsumer.name, c, plain, 1), rowFrom(inboxConsumer.name, c, ours, dq))
		if dq < dbMin {
			dbMin, dbGot = dq, "lowest "+strconv.FormatFloat(dq, 'f', 2, 64)+"× at c="+strconv.Itoa(c)
		}
	}
	t.Goals = append(t.Goals,
		Goal{Text: "natsin + inbox ≥ 0.8× a plain JetStream consumer at every concurrency", Met: minRatio >= 0.8, Got: minGot},
		Goal{Text: "(the transactions alone, no broker: inbox.Handle ≥ 0.8× the plain transaction)", Met: dbMin >= 0.8, Got: dbGot})
	t.Notes = append(t.Notes,
		fmt.Sprintf("JetStream rows: %d messages published first (Nats-Msg-Id set, as the outbox's publisher does) to a file-backed stream; a durable pull consumer (explicit acks) is then drained and timed until every message's row is committed and the message acknowledged. Both consumers pull batches of 4c and handle c messages at once; the plain one writes the row in a READ COMMITTED transaction and acks after the commit, with no deduplication. Latency is not measured for these rows.", inboxDrainMessages),
		"Transaction rows: one new message per operation, c goroutines back to back, a fresh time-ordered id each (UUIDv7-like). plain consumer transaction: BEGIN (READ COMMITTED); INSERT the business row; COMMIT. inbox.Handle: BEGIN ISOLATION LEVEL SERIALIZABLE and the inbox row's INSERT ... ON CONFLICT DO NOTHING in one round trip; INSERT the same business row; COMMIT.",
		"Each row is the better of two cells, run interleaved with the other subject's: the two differ by one row, and a burst of other work on a shared machine would otherwise decide the ratio.")
	s.Tables = append(s.Tables, t)
	return nil
}
