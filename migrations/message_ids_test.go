package migrations_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/outbox"
)

// Migrating an outbox that already holds messages adds the ids without
// rewriting the table: pending and dead-lettered rows (which can still be
// sent) get a UUIDv7 dated by their created_at; published rows, never sent
// again, keep none. New rows get one by default, and a row that could be
// published without one is refused.
func TestMessageIDMigrationOnAFilledTable(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	pool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["atomicphase.allow_data_loss"] = "on" })
	require.NoError(t, migrations.DownTo(ctx, pool, 2))
	_, err := pool.Exec(ctx, `
		INSERT INTO outbox_messages (topic, payload, created_at) VALUES ('pending', '', now() - interval '1 hour');
		INSERT INTO outbox_messages (topic, payload, dead_at) VALUES ('dead', '', now());
		INSERT INTO outbox_messages (topic, payload, published_at) VALUES ('published', '', now())`)
	require.NoError(t, err)
	var before uint32
	require.NoError(t, pool.QueryRow(ctx, "SELECT pg_relation_filenode('outbox_messages')").Scan(&before))

	require.NoError(t, migrations.Up(ctx, pool))
	var after uint32
	require.NoError(t, pool.QueryRow(ctx, "SELECT pg_relation_filenode('outbox_messages')").Scan(&after))
	require.Equal(t, before, after, "the table was not rewritten")

	ids := make(map[string]uuid.NullUUID)
	rows, err := pool.Query(ctx, "SELECT topic, message_id, created_at FROM outbox_messages")
	require.NoError(t, err)
	for rows.Next() {
		var topic string
		var id uuid.NullUUID
		var created time.Time
		require.NoError(t, rows.Scan(&topic, &id, &created))
		ids[topic] = id
		if id.Valid {
			require.Equal(t, uuid.Version(7), id.UUID.Version())
			sec, nsec := id.UUID.Time().UnixTime()
			require.WithinDuration(t, created, time.Unix(sec, nsec), time.Millisecond)
		}
	}
	require.NoError(t, rows.Err())
	require.True(t, ids["pending"].Valid)
	require.True(t, ids["dead"].Valid)
	require.False(t, ids["published"].Valid)

	enqueue(t, pool, outbox.Message{Topic: "new"})
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE topic = 'new' AND message_id IS NOT NULL"))
	_, err = pool.Exec(ctx, "INSERT INTO outbox_messages (topic, payload, message_id) VALUES ('no id', '', NULL)")
	require.ErrorContains(t, err, "outbox_messages_message_id_set")
	_, err = pool.Exec(ctx, "UPDATE outbox_messages SET idempotency_key_id = NULL WHERE topic = 'published'")
	require.NoError(t, err, "rows published before the migration can still be updated")
}

// Rolling the ids back loses them, so it refuses while the outbox holds
// messages, unless the session opted in to data loss.
func TestMessageIDMigrationDownRefusesWithoutOptIn(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	enqueue(t, d.Pool, outbox.Message{Topic: "t"})
	err := migrations.DownTo(ctx, d.Pool, 2)
	require.ErrorContains(t, err, "atomicphase.allow_data_loss")
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE message_id IS NOT NULL"), "nothing was dropped")

	optedIn := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["atomicphase.allow_data_loss"] = "on" })
	require.NoError(t, migrations.DownTo(ctx, optedIn, 2))
	require.Zero(t, d.Count(t, "SELECT count(*) FROM information_schema.columns WHERE table_schema = current_schema() AND column_name = 'message_id'"))
}

// enqueue stages msgs through outbox.Enqueue in a transaction of their own.
func enqueue(t *testing.T, pool *pgxpool.Pool, msgs ...outbox.Message) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, msgs...) }))
}
