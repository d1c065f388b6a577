package outbox

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/internal/phasectx"
)

// Every staged message gets its own UUIDv7, drawn by the database: unique,
// and ordered by the time it was staged (to the millisecond).
func TestEnqueueGivesEachMessageAUUIDv7(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	for range 3 {
		enqueue(t, d.Pool, Message{Topic: "t"}, Message{Topic: "t"}, Message{Topic: "t", OrderingKey: "k"})
	}
	rows, err := d.Pool.Query(context.Background(), "SELECT message_id, created_at FROM outbox_messages ORDER BY id")
	require.NoError(t, err)
	seen := make(map[uuid.UUID]bool)
	var last time.Time
	for rows.Next() {
		var id uuid.UUID
		var created time.Time
		require.NoError(t, rows.Scan(&id, &created))
		require.Equal(t, uuid.Version(7), id.Version())
		require.Equal(t, uuid.RFC4122, id.Variant())
		require.False(t, seen[id])
		seen[id] = true
		sec, nsec := id.Time().UnixTime()
		at := time.Unix(sec, nsec)
		require.WithinDuration(t, created, at, time.Second, "the id carries the time it was drawn")
		require.False(t, at.Before(last.Truncate(time.Millisecond)), "ids follow the staging order to the millisecond")
		last = at
	}
	require.NoError(t, rows.Err())
	require.Len(t, seen, 9)
}

// A message staged in a transaction that rolls back never exists, so it is
// never published; one in a committed transaction is published once, with
// everything it was enqueued with.
func TestEnqueueRolledBackNeverPublishedCommittedPublished(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()

	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, Enqueue(ctx, tx, Message{Topic: "orders.created", Payload: []byte("rolled back")}))
	require.NoError(t, tx.Rollback(ctx))

	enqueue(t, d.Pool, Message{
		Topic:       "orders.created",
		OrderingKey: "order:1",
		Payload:     []byte("committed"),
		Headers:     map[string]string{"Content-Type": "application/json", "X-Trace": "abc\tdef"},
	})
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages"))

	rec := &recorder{}
	r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{})
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	n, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n)

	got := rec.published()
	require.Len(t, got, 1)
	e := got[0]
	require.Positive(t, e.RowID)
	require.Equal(t, uuid.Version(7), e.ID.Version())
	require.Equal(t, "orders.created", e.Topic)
	require.Equal(t, "order:1", e.OrderingKey)
	require.Equal(t, "committed", string(e.Payload))
	require.Equal(t, map[string]string{"Content-Type": "application/json", "X-Trace": "abc\tdef"}, e.Headers)
	require.Equal(t, 1, e.Attempt)
	require.False(t, e.CreatedAt.IsZero())
	require.Equal(t, 1, d.Count(t,
		"SELECT count(*) FROM outbox_messages WHERE id = $1 AND message_id = $2 AND published_at IS NOT NULL AND attempts = 1 AND dead_at IS NULL",
		e.RowID, e.ID))
}

// Enqueue records the idempotency key of the phase it runs in, which txn
// passes in the context; outside a phase the column stays NULL.
func TestEnqueueRecordsIdempotencyKeyID(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	var keyID int64
	require.NoError(t, d.Pool.QueryRow(ctx, `
		INSERT INTO idempotency_keys (scope, key, fingerprint, request_method, request_path)
		VALUES ('acct_1', 'key-1', $1, 'POST', '/v1/orders') RETURNING id`,
		bytes.Repeat([]byte{7}, 32)).Scan(&keyID))

	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, Enqueue(phasectx.WithKeyID(ctx, keyID), tx, Message{Topic: "in.phase"}))
	require.NoError(t, Enqueue(ctx, tx, Message{Topic: "no.phase"}))
	require.NoError(t, tx.Commit(ctx))

	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE topic = 'in.phase' AND idempotency_key_id = $1", keyID))
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE topic = 'no.phase' AND idempotency_key_id IS NULL"))
	// An empty payload is stored as empty, not NULL.
	require.Equal(t, 2, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE payload = ''::bytea"))
}

// Invalid messages fail Enqueue with a specific sentinel, before any SQL:
// nothing of the call is written, valid messages beside them included.
func TestEnqueueRejectsInvalidMessages(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	valid := Message{Topic: "ok", Payload: []byte("fine")}
	cases := []struct {
		name string
		msg  Message
		want error
	}{
		{"empty topic", Message{Payload: []byte("x")}, ErrInvalidTopic},
		{"topic with newline", Message{Topic: "a\nb"}, ErrInvalidTopic},
		{"topic not utf8", Message{Topic: "a\xffb"}, ErrInvalidTopic},
		{"topic too long", Message{Topic: strings.Repeat("t", MaxTopicBytes+1)}, ErrInvalidTopic},
		{"payload too large", Message{Topic: "t", Payload: make([]byte, MaxPayloadBytes+1)}, ErrPayloadTooLarge},
		{"empty header name", Message{Topic: "t", Headers: map[string]string{"": "v"}}, ErrInvalidHeader},
		{"header name with space", Message{Topic: "t", Headers: map[string]string{"X Trace": "v"}}, ErrInvalidHeader},
		{"header name with colon", Message{Topic: "t", Headers: map[string]string{"X:Trace": "v"}}, ErrInvalidHeader},
		{"header value with CRLF", Message{Topic: "t", Headers: map[string]string{"X-Trace": "a\r\nInjected: yes"}}, ErrInvalidHeader},
		{"header value with LF", Message{Topic: "t", Headers: map[string]string{"X-Trace": "a\nb"}}, ErrInvalidHeader},
		{"header value with NUL", Message{Topic: "t", Headers: map[string]string{"X-Trace": "a\x00b"}}, ErrInvalidHeader},
		{"header value not utf8", Message{Topic: "t", Headers: map[string]string{"X-Trace": "\xc3"}}, ErrInvalidHeader},
		{"header names differing in case", Message{Topic: "t", Headers: map[string]string{"X-Trace": "a", "x-trace": "b"}}, ErrInvalidHeader},
		{"ordering key with NUL", Message{Topic: "t", OrderingKey: "k\x00"}, ErrInvalidMessage},
		{"ordering key too long", Message{Topic: "t", OrderingKey: strings.Repeat("k", MaxOrderingKeyBytes+1)}, ErrInvalidMessage},
		{"negative delay", Message{Topic: "t", Delay: -time.Second}, ErrInvalidMessage},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tx, err := d.Pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx)
			err = Enqueue(ctx, tx, valid, tc.msg)
			require.ErrorIs(t, err, tc.want)
			require.ErrorIs(t, err, ErrInvalidMessage)
			require.Contains(t, err.Error(), "message 1")
			require.NoError(t, tx.Commit(ctx), "the transaction is still usable: no SQL was sent")
			require.Zero(t, d.Count(t, "SELECT count(*) FROM outbox_messages"))
		})
	}

	// The limits themselves are accepted.
	enqueue(t, d.Pool, Message{Topic: strings.Repeat("t", MaxTopicBytes), Payload: make([]byte, MaxPayloadBytes)})
	require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE octet_length(payload) = $1", MaxPayloadBytes))
	// No messages, no work.
	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, Enqueue(ctx, tx))
	require.NoError(t, tx.Rollback(ctx))
	require.Error(t, Enqueue(ctx, nil, valid))
}

// A delayed message waits for its time by the database clock, and holds back
// its ordering key's later messages meanwhile; other messages go at once.
func TestEnqueueDelay(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	enqueue(t, d.Pool,
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("k delayed"), Delay: time.Hour},
		Message{Topic: "t", OrderingKey: "k", Payload: []byte("k after")},
		Message{Topic: "t", Payload: []byte("unordered")},
		Message{Topic: "t", OrderingKey: "j", Payload: []byte("j")},
	)
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages
		WHERE payload = 'k delayed' AND available_at - created_at = interval '1 hour'`))

	rec := &recorder{}
	r := newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{})
	require.Equal(t, 2, drain(t, r))
	require.ElementsMatch(t, []string{"unordered", "j"}, rec.payloads())

	// Once due, the delayed message goes first, then its key's next one.
	_, err := d.Pool.Exec(context.Background(), "UPDATE outbox_messages SET available_at = now() WHERE payload = 'k delayed'")
	require.NoError(t, err)
	require.Equal(t, 2, drain(t, r))
	got := rec.payloads()
	require.Len(t, got, 4)
	require.Equal(t, []string{"k delayed", "k after"}, got[2:])
}

// Validation errors name the message and match both sentinels.
func TestValidationErrorText(t *testing.T) {
	t.Parallel()
	_, err := validate(3, &Message{})
	require.EqualError(t, err, "outbox: invalid topic: message 3: topic is empty")
	require.True(t, errors.Is(err, ErrInvalidTopic) && errors.Is(err, ErrInvalidMessage))
}

// Enqueue and the relay work in every pgx query exec mode, as behind a
// transaction-pooling PgBouncer: JSON is bound as text, never as bytea.
func TestEnqueueAndRelayInEveryExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
	} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			d := pgtest.New(t)
			pool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			enqueue(t, pool, Message{
				Topic: "t", OrderingKey: "k", Payload: []byte{0, 1, 0xff, '\\'},
				Headers: map[string]string{"X-Json": `{"a":"\u00e9\"\\"}`},
				Delay:   time.Microsecond,
			})
			rec := &recorder{}
			r := newTestRelay(t, pool, PublisherFunc(rec.publish), Config{DisableNotify: true})
			eventually(t, func() bool {
				_, err := r.RunOnce(context.Background())
				require.NoError(t, err)
				return len(rec.published()) == 1
			})
			e := rec.published()[0]
			require.Equal(t, []byte{0, 1, 0xff, '\\'}, e.Payload)
			require.Equal(t, map[string]string{"X-Json": `{"a":"\u00e9\"\\"}`}, e.Headers)
			require.Equal(t, uuid.Version(7), e.ID.Version())
			require.Equal(t, 1, d.Count(t, "SELECT count(*) FROM outbox_messages WHERE published_at IS NOT NULL"))
		})
	}
}
