package outbox

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// A PublisherFunc whose function ignores ctx and hangs costs the messages
// after it nothing: at the deadline the hung message fails, and the ones not
// yet sent are left as they were, without an attempt.
func TestPublisherFuncHungCallCostsLaterMessagesNothing(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool,
		Message{Topic: "t", Payload: []byte("before")},
		Message{Topic: "t", Payload: []byte("stuck")},
		Message{Topic: "t", Payload: []byte("after")})
	release := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	t.Cleanup(func() { close(release); wg.Wait() })
	rec := &recorder{}
	r := newTestRelay(t, d.Pool, PublisherFunc(func(ctx context.Context, e Envelope) error {
		if string(e.Payload) == "stuck" {
			defer wg.Done()
			<-release // ignores ctx
		}
		return rec.publish(ctx, e)
	}), Config{PublishTimeout: 2 * time.Second})
	n, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, []string{"before"}, rec.payloads())
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE payload = 'stuck'
		AND attempts = 1 AND published_at IS NULL AND last_error LIKE '%deadline exceeded%'`))
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE payload = 'after'
		AND attempts = 0 AND published_at IS NULL AND last_error IS NULL`))
}
