package natsin_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/inbox/natsin"
	"github.com/atomicphase/atomicphase/internal/outboxtest"
)

// A database outage is not the handler's failure. While PostgreSQL cannot
// be reached, the consumer holds the messages it received (telling the
// server it is still working on them) and tries again, instead of NAKing
// them: a NAK would spend a delivery, and after MaxDeliver of them the
// message would be dead-lettered, or, with the dead letter unrecordable
// during the outage, terminated and lost. Here the outage lasts longer than
// MaxDeliver × AckWait; afterwards every message is handled once, on its
// first delivery, and none is dead-lettered.
func TestDatabaseOutageSpendsNoDeliveryAndDeadLettersNothing(t *testing.T) {
	t.Parallel()
	const maxDeliver, ackWait = 3, 500 * time.Millisecond
	e := newEnv(t, jetstream.ConsumerConfig{MaxDeliver: maxDeliver, AckWait: ackWait})
	ids := []string{"outage-1", "outage-2", "outage-3"}
	for _, id := range ids {
		e.publish(t, id, []byte(id))
	}
	proxy, pool := e.d.NewProxy(t)
	in := e.inbox(t, pool)
	var runs atomic.Int64
	var mu sync.Mutex
	deliveries := map[string][]int{}
	c := e.newConsumer(t, in, nil, func(ctx context.Context, tx pgx.Tx, msg natsin.Message) error {
		mu.Lock()
		deliveries[msg.ID] = append(deliveries[msg.ID], msg.Delivery)
		mu.Unlock()
		return writeEffect(&runs)(ctx, tx, msg)
	}, func(cfg *natsin.Config) { cfg.Concurrency = len(ids) })

	proxy.Unreachable()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	require.NoError(t, c.Start(ctx))
	defer c.Stop()
	// Hold the outage until the consumer has met it many times, for longer
	// than MaxDeliver acknowledgement deadlines.
	began := time.Now()
	outboxtest.Eventually(t, func() bool {
		return time.Since(began) > 2*maxDeliver*ackWait && in.Stats().Unavailable >= uint64(3*len(ids))
	})
	info := e.consumerInfo(t)
	require.Zero(t, info.NumRedelivered, "the outage spent a delivery: %+v", info)
	require.Zero(t, c.Stats().Failed)
	require.Zero(t, c.Stats().DeadLettered)
	proxy.Reachable()

	outboxtest.Eventually(t, func() bool { return c.Stats().Acked == uint64(len(ids)) })
	outboxtest.Eventually(t, func() bool { return e.settled(t) })
	require.Equal(t, len(ids), e.d.Count(t, `SELECT count(*) FROM effects`))
	require.Zero(t, e.d.Count(t, `SELECT count(*) FROM inbox_messages WHERE dead_at IS NOT NULL`))
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		require.Equal(t, []int{1}, deliveries[id], "%s ran only on its first delivery, after the outage", id)
	}
	require.EqualValues(t, len(ids), runs.Load())
	st := c.Stats()
	require.Zero(t, st.Failed)
	require.Zero(t, st.DeadLettered)
	require.NotZero(t, st.Unavailable)
}
