package migrations_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
)

func insertKey(t *testing.T, d *pgtest.DB) {
	t.Helper()
	_, err := d.Pool.Exec(context.Background(), `INSERT INTO idempotency_keys
		(scope, key, fingerprint, request_method, request_path) VALUES ('', 'k1', decode(repeat('ab', 32), 'hex'), 'POST', '/')`)
	require.NoError(t, err)
}

func insertMessage(t *testing.T, d *pgtest.DB) {
	t.Helper()
	_, err := d.Pool.Exec(context.Background(), `INSERT INTO outbox_messages (topic, payload) VALUES ('t', '\x00')`)
	require.NoError(t, err)
}

func latestVersion(t *testing.T, d *pgtest.DB) int {
	t.Helper()
	return d.Count(t, `SELECT max(version_id) FROM `+migrations.TableName)
}

func TestDownRefusesToDropTablesThatHoldRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, fill := range map[string]func(*testing.T, *pgtest.DB){
		"a stored key":      insertKey,
		"an unsent message": insertMessage,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			d := pgtest.New(t)
			fill(t, d)
			before := latestVersion(t, d)
			for _, target := range []int64{0, 1, 2} {
				err := migrations.DownTo(ctx, d.Pool, target)
				require.ErrorIs(t, err, migrations.ErrDataLossRefused, "down to %d", target)
				require.Contains(t, err.Error(), "atomicphase.allow_data_loss", "the error says how to opt in")
				require.Equal(t, before, latestVersion(t, d), "nothing rolled back")
				require.Equal(t, []string{migrations.TableName, "idempotency_key_tombstones", "idempotency_keys", "inbox_messages", "outbox_messages"}, tables(t, d))
			}
			require.NoError(t, migrations.Check(ctx, d.Pool))
		})
	}
}

func TestDownDropsTablesThatHoldRowsWithTheOptIn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	insertKey(t, d)
	insertMessage(t, d)
	require.NoError(t, migrations.DownTo(ctx, d.Pool, 0, migrations.AllowDataLoss()))
	require.Equal(t, []string{migrations.TableName}, tables(t, d))
	require.Zero(t, latestVersion(t, d))
	require.NoError(t, migrations.Up(ctx, d.Pool))

	// The opt-in lasted for that rollback's transaction only.
	insertKey(t, d)
	require.ErrorIs(t, migrations.DownTo(ctx, d.Pool, 0), migrations.ErrDataLossRefused)
}

func TestDownOfEmptyTablesNeedsNoOptIn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	require.NoError(t, migrations.DownTo(ctx, d.Pool, 0))
	require.Equal(t, []string{migrations.TableName}, tables(t, d))
	require.NoError(t, migrations.Up(ctx, d.Pool))
}

// The guard is a function later migrations' Downs call first.
func TestRefuseDataLossChecksEveryTableItIsGiven(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	guard := `SELECT atomicphase_refuse_data_loss('00099', 'idempotency_keys', 'outbox_messages')`
	_, err := d.Pool.Exec(ctx, guard)
	require.NoError(t, err, "empty tables")
	insertMessage(t, d)
	_, err = d.Pool.Exec(ctx, guard)
	require.Error(t, err)
	require.Contains(t, err.Error(), "rolling back migration 00099 would delete the rows of outbox_messages")

	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, `SET LOCAL atomicphase.allow_data_loss = on`)
	require.NoError(t, err)
	var allowed bool
	require.NoError(t, tx.QueryRow(ctx, `SELECT atomicphase_data_loss_allowed()`).Scan(&allowed))
	require.True(t, allowed)
	_, err = tx.Exec(ctx, guard)
	require.NoError(t, err, "opted in")
}
