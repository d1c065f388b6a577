package scenarios

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/natspub"
)

// Relay capacity: n messages are committed first (100 per transaction),
// then the relay (or forwarder) is started and timed until JetStream has
// acknowledged them all. This isolates the relay from the producers'
// commit rate, which bounds the end-to-end figures.

func (a *ackTracker) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.acks)
}

// waitAcks waits until n messages are acknowledged or timeout passes.
func (a *ackTracker) waitAcks(n int, timeout time.Duration) (time.Duration, error) {
	t0 := time.Now()
	for a.count() < n {
		if time.Since(t0) > timeout {
			return time.Since(t0), fmt.Errorf("%d of %d acknowledged after %v", a.count(), n, timeout)
		}
		time.Sleep(2 * time.Millisecond)
	}
	return time.Since(t0), nil
}

const drainTimeout = 3 * time.Minute

func (s *Suite) drainOurs(ctx context.Context, n int) (float64, error) {
	cl, err := s.newCell(ctx, 4)
	if err != nil {
		return 0, err
	}
	defer cl.pool.Close()
	for i := 0; i < n; i += 100 {
		tx, err := cl.pool.Begin(ctx)
		if err != nil {
			return 0, err
		}
		msgs := make([]outbox.Message, 0, 100)
		for j := i; j < min(i+100, n); j++ {
			msgs = append(msgs, outbox.Message{Topic: "orders", Payload: seqPayload(int64(j))})
		}
		if err := outbox.Enqueue(ctx, tx, msgs...); err != nil {
			_ = tx.Rollback(ctx)
			return 0, err
		}
		if err := tx.Commit(ctx); err != nil {
			return 0, err
		}
	}
	if _, err := cl.pool.Exec(ctx, "VACUUM ANALYZE outbox_messages"); err != nil {
		return 0, err
	}
	took, err := s.relayDrain(ctx, cl, n, drainTimeout)
	if err != nil {
		return 0, err
	}
	return float64(n) / took.Seconds(), nil
}

// relayDrain starts a relay to a fresh JetStream stream on the n messages
// committed in cl's outbox (payloads seqPayload(0..n-1)) and returns how
// long it took until JetStream had acknowledged them all.
func (s *Suite) relayDrain(ctx context.Context, cl *cell, n int, timeout time.Duration) (time.Duration, error) {
	nc, js, err := freshStream(ctx, s.Env.NATSURL, apStream, "apbench.ap.")
	if err != nil {
		return 0, err
	}
	defer nc.Close()
	defer js.DeleteStream(context.Background(), apStream) //nolint:errcheck // best effort
	tr := newAckTracker()
	pub, err := natspub.New(js, &natspub.Config{SubjectPrefix: "apbench.ap."})
	if err != nil {
		return 0, err
	}
	relay, err := outbox.New(cl.pool, recordingPublisher{next: pub, tr: tr}, &outbox.Config{Logger: harness.Discard})
	if err != nil {
		return 0, err
	}
	if err := relay.Start(context.WithoutCancel(ctx)); err != nil {
		return 0, err
	}
	took, err := tr.waitAcks(n, timeout)
	relay.Stop()
	return took, err
}

func (s *Suite) drainWatermill(ctx context.Context, n int) (float64, error) {
	cl, err := s.newCell(ctx, 4)
	if err != nil {
		return 0, err
	}
	defer cl.pool.Close()
	nc, _, err := freshStream(ctx, s.Env.NATSURL, wmStream, "apbench.wm.")
	if err != nil {
		return 0, err
	}
	nc.Close()
	logger := watermill.NopLogger{}
	schema := wmsql.DefaultPostgreSQLSchema{}
	subCfg := wmsql.SubscriberConfig{
		ConsumerGroup:    "bench",
		PollInterval:     s.WatermillPoll,
		BackoffManager:   wmsql.NewDefaultBackoffManager(s.WatermillPoll, time.Second),
		SchemaAdapter:    schema,
		OffsetsAdapter:   wmsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
	}
	// Create the tables, then start from empty ones.
	initSub, err := wmsql.NewSubscriber(wmsql.BeginnerFromPgx(cl.pool), subCfg, logger)
	if err != nil {
		return 0, err
	}
	if err := initSub.SubscribeInitialize(wmForwarderTopic); err != nil {
		return 0, err
	}
	_ = initSub.Close()
	if err := reset(ctx, cl.pool); err != nil {
		return 0, err
	}
	for i := 0; i < n; i += 100 {
		tx, err := cl.pool.Begin(ctx)
		if err != nil {
			return 0, err
		}
		sqlPub, err := wmsql.NewPublisher(wmsql.TxFromPgx(tx), wmsql.PublisherConfig{SchemaAdapter: schema}, logger)
		if err != nil {
			_ = tx.Rollback(ctx)
			return 0, err
		}
		fp := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: wmForwarderTopic})
		msgs := make([]*message.Message, 0, 100)
		for j := i; j < min(i+100, n); j++ {
			msgs = append(msgs, message.NewMessage(watermill.NewUUID(), seqPayload(int64(j))))
		}
		if err := fp.Publish("apbench.wm.orders", msgs...); err != nil {
			_ = tx.Rollback(ctx)
			return 0, err
		}
		if err := tx.Commit(ctx); err != nil {
			return 0, err
		}
	}
	if _, err := cl.pool.Exec(ctx, "VACUUM ANALYZE"); err != nil {
		return 0, err
	}
	tr := newAckTracker()
	sub, err := wmsql.NewSubscriber(wmsql.BeginnerFromPgx(cl.pool), subCfg, logger)
	if err != nil {
		return 0, err
	}
	natsPub, err := wmnats.NewPublisher(wmnats.PublisherConfig{
		URL: s.Env.NATSURL, JetStream: wmnats.JetStreamConfig{TrackMsgId: true},
	}, logger)
	if err != nil {
		return 0, err
	}
	fwd, err := forwarder.NewForwarder(sub, recordingWMPublisher{next: natsPub, tr: tr}, logger, forwarder.Config{
		ForwarderTopic: wmForwarderTopic, CloseTimeout: 10 * time.Second,
	})
	if err != nil {
		return 0, err
	}
	runErr := make(chan error, 1)
	go func() { runErr <- fwd.Run(context.WithoutCancel(ctx)) }()
	took, err := tr.waitAcks(n, drainTimeout)
	_ = fwd.Close()
	if err != nil {
		select {
		case rerr := <-runErr:
			err = errors.Join(err, rerr)
		default:
		}
		return 0, err
	}
	return float64(n) / took.Seconds(), nil
}

// drainRows measures both relays' capacity on an n-message backlog.
func (s *Suite) drainRows(ctx context.Context, n int) ([]Row, float64, error) {
	wm, err := s.drainWatermill(ctx, n)
	if err != nil {
		return nil, 0, fmt.Errorf("watermill drain: %w", err)
	}
	s.Progress("Watermill forwarder drains %d: %.0f msg/s", n, wm)
	ours, err := s.drainOurs(ctx, n)
	if err != nil {
		return nil, 0, fmt.Errorf("relay drain: %w", err)
	}
	s.Progress("atomicphase relay drains %d: %.0f msg/s", n, ours)
	name := fmt.Sprintf("relay capacity: drain %d committed messages", n)
	return []Row{
		{System: "Watermill forwarder, " + name, Throughput: wm, Ratio: 1},
		{System: "atomicphase relay, " + name, Throughput: ours, Ratio: ratio(ours, wm)},
	}, ratio(ours, wm), nil
}
