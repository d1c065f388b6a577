package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// Start refuses to start twice; Stop is idempotent and allows a restart.
func TestRelayStartStop(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	rec := &recorder{}
	r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{PollInterval: 10 * time.Millisecond})
	r.Stop() // never started: no-op
	require.NoError(t, r.Start(context.Background()))
	require.ErrorIs(t, r.Start(context.Background()), ErrRelayRunning)
	r.Stop()
	r.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, r.Start(ctx))
	enqueue(t, d.Pool, Message{Topic: "t"})
	eventually(t, func() bool { return len(rec.published()) == 1 })
	cancel() // the relay stops with its context; Stop still returns
	r.Stop()
}
