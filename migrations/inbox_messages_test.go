package migrations_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
)

// Rolling 00006 back would forget which messages each consumer handled, so
// that every redelivery would run its handler again: its Down refuses while
// inbox_messages holds a row, unless the operator opts in.
func TestDownOfInboxMessagesRefusesWhileItHoldsRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	_, err := d.Pool.Exec(ctx, `INSERT INTO inbox_messages (consumer, message_id, keep_until) VALUES ('c', 'm', now())`)
	require.NoError(t, err)
	before := latestVersion(t, d)
	err = migrations.DownTo(ctx, d.Pool, 5)
	require.ErrorIs(t, err, migrations.ErrDataLossRefused)
	require.Contains(t, err.Error(), "rolling back migration 00006 would delete the rows of inbox_messages")
	require.Equal(t, before, latestVersion(t, d), "nothing rolled back")

	require.NoError(t, migrations.DownTo(ctx, d.Pool, 5, migrations.AllowDataLoss()))
	require.Equal(t, []string{migrations.TableName, "idempotency_keys", "outbox_messages"}, tables(t, d))
	require.NoError(t, migrations.Up(ctx, d.Pool))
}

// The table's CHECKs mirror the inbox's validation, as a backstop for rows
// written by other means.
func TestInboxMessagesRefusesMalformedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	for name, row := range map[string][]any{
		"empty id":        {"c", "", nil, nil},
		"long id":         {"c", strings.Repeat("m", 256), nil, nil},
		"control in id":   {"c", "m\n", nil, nil},
		"empty consumer":  {"", "m", nil, nil},
		"dead, no error":  {"c", "m", "now", nil},
		"error, not dead": {"c", "m", nil, "boom"},
	} {
		_, err := d.Pool.Exec(ctx, `INSERT INTO inbox_messages (consumer, message_id, keep_until, dead_at, last_error)
			VALUES ($1, $2, now(), $3::timestamptz, $4)`, row...)
		require.Error(t, err, name)
	}
	_, err := d.Pool.Exec(ctx, `INSERT INTO inbox_messages (consumer, message_id, keep_until, dead_at, last_error)
		VALUES ('c', 'm', now(), now(), 'boom')`)
	require.NoError(t, err)
}
