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
	require.ErrorIs(t, r.Start(context.Background()), ErrAlreadyStarted)
	r.Stop()
	r.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, r.Start(ctx))
	enqueue(t, d.Pool, Message{Topic: "t"})
	eventually(t, func() bool { return len(rec.published()) == 1 })
	cancel() // the relay stops with its context; Stop still returns
	r.Stop()
}

// A relay whose Start context ended is no longer running: it starts again
// without a Stop in between, and only a running one refuses.
func TestRelayWhoseContextEndedStartsAgain(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	r := newTestRelay(t, d.Pool, PublisherFunc((&recorder{}).publish), Config{PollInterval: time.Hour, DisableNotify: true})
	t.Cleanup(r.Stop)
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, r.Start(ctx))
	cancel()
	require.Eventually(t, func() bool { return r.Start(context.Background()) == nil }, 10*time.Second, 5*time.Millisecond,
		"Start still refuses after its context ended")
	require.ErrorIs(t, r.Start(context.Background()), ErrAlreadyStarted)
}
