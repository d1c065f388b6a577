package cleanup_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/cleanup"
	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// The cleaner deletes inbox rows, handled and dead-lettered alike, once
// past the keep_until their consumer stamped from its own Retention, in
// bounded batches, and no other row. Once a message's row is gone, a
// redelivery runs its handler again: why Retention must outlast the
// broker's redelivery horizon.
func TestCleanerDeletesInboxRowsPastTheirConsumersRetentionOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	short, err := inbox.New(d.Pool, &inbox.Config{Consumer: "short", Logger: quiet, Retention: time.Hour})
	require.NoError(t, err)
	long, err := inbox.New(d.Pool, &inbox.Config{Consumer: "long", Logger: quiet}) // 7 days
	require.NoError(t, err)
	var runs atomic.Int64
	count := func(context.Context, pgx.Tx) error { runs.Add(1); return nil }
	for _, id := range []string{"m1", "m2", "m3"} {
		for _, in := range []*inbox.Inbox{short, long} {
			_, err := in.Handle(ctx, id, count)
			require.NoError(t, err)
		}
	}
	_, err = short.DeadLetter(ctx, inbox.Message{ID: "m4"}, context.DeadlineExceeded)
	require.NoError(t, err)
	// Two hours pass: the short consumer's four rows are past keep_until.
	exec(t, d, `UPDATE inbox_messages SET recorded_at = recorded_at - interval '2 hours', keep_until = keep_until - interval '2 hours'`)

	c := newCleaner(t, d, cleanup.Config{BatchSize: 3})
	dry, err := c.DryRun(ctx)
	require.NoError(t, err)
	require.Equal(t, cleanup.Report{InboxDeleted: 4}, dry)
	rep, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, cleanup.Report{InboxDeleted: 4, Batches: 2}, rep, "batches of at most 3 rows")
	require.Zero(t, d.Count(t, `SELECT count(*) FROM inbox_messages WHERE consumer = 'short'`))
	require.Equal(t, 3, d.Count(t, `SELECT count(*) FROM inbox_messages WHERE consumer = 'long'`))

	runs.Store(0)
	out, err := long.Handle(ctx, "m1", count)
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out, "kept: still deduplicated")
	out, err = short.Handle(ctx, "m1", count)
	require.NoError(t, err)
	require.Equal(t, inbox.Handled, out, "forgotten: a redelivery this late runs the handler again")
	require.EqualValues(t, 1, runs.Load())
}
