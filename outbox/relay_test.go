package outbox

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// Stats reads the age of the oldest pending message from the database.
func TestRelayStatsOldestPendingAge(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	rec := &recorder{}
	r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{})
	stats, err := r.Stats(context.Background())
	require.NoError(t, err)
	require.Equal(t, Stats{}, stats)

	enqueue(t, d.Pool, Message{Topic: "t"})
	_, err = d.Pool.Exec(context.Background(), "UPDATE outbox_messages SET created_at = now() - interval '90 seconds'")
	require.NoError(t, err)
	stats, err = r.Stats(context.Background())
	require.NoError(t, err)
	require.GreaterOrEqual(t, stats.OldestPendingAge, 90*time.Second)
	require.Less(t, stats.OldestPendingAge, time.Hour)

	require.Equal(t, 1, drain(t, r))
	stats, err = r.Stats(context.Background())
	require.NoError(t, err)
	require.Equal(t, Stats{Published: 1}, stats)
}

// preparingPublisher records the limits a relay checks it against, and
// fails PrepareRelay while failPrepare is set.
type preparingPublisher struct {
	PublisherFunc
	mu          sync.Mutex
	checked     []RelayLimits
	prepared    []RelayLimits
	failPrepare error
}

func (p *preparingPublisher) CheckRelay(l RelayLimits) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.checked = append(p.checked, l)
	return nil
}

func (p *preparingPublisher) PrepareRelay(_ context.Context, l RelayLimits) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.prepared = append(p.prepared, l)
	return p.failPrepare
}

// New hands a Checker the relay's limits; Start and the first successful
// RunOnce prepare a Preparer, and a failed preparation fails them without
// publishing anything.
func TestRelayChecksAndPreparesItsPublisher(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	rec := &recorder{}
	pub := &preparingPublisher{PublisherFunc: PublisherFunc(rec.publish), failPrepare: errors.New("broker says no")}
	r := newTestRelay(t, d.Pool, pub, Config{PublishTimeout: 8 * time.Second, RetryMaxDelay: time.Minute, PollInterval: 2 * time.Second})
	want := RelayLimits{PublishDeadline: 6 * time.Second, RepublishInterval: time.Minute + 16*time.Second + 2*time.Second}
	require.Equal(t, []RelayLimits{want}, pub.checked)

	enqueue(t, d.Pool, Message{Topic: "t"})
	_, err := r.RunOnce(context.Background())
	require.ErrorContains(t, err, "broker says no")
	require.ErrorContains(t, r.Start(context.Background()), "broker says no")
	require.Empty(t, rec.published())

	pub.mu.Lock()
	pub.failPrepare = nil
	pub.mu.Unlock()
	require.Equal(t, 1, drain(t, r))
	require.Len(t, pub.prepared, 3, "prepared again until it succeeded, then not for every batch")
	require.NoError(t, r.Start(context.Background()))
	r.Stop()
	require.Len(t, pub.prepared, 4, "Start prepares again")
	require.Equal(t, want, pub.prepared[3])
}
