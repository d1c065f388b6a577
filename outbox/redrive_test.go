package outbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/opstest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// deadLetter enqueues msgs and relays them once through a publisher that
// rejects everything permanently, so that each is dead-lettered with that
// error after one attempt. It returns the envelopes the relay had.
func deadLetter(t *testing.T, d *pgtest.DB, msgs ...Message) []Envelope {
	t.Helper()
	enqueue(t, d.Pool, msgs...)
	var seen []Envelope
	r := newTestRelay(t, d.Pool, PublisherFunc(func(_ context.Context, e Envelope) error {
		seen = append(seen, e)
		return Permanent(errors.New("receiver says 410 Gone"))
	}), Config{})
	_, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Len(t, seen, len(msgs))
	return seen
}

// A redriven message goes back to pending with its id, no attempts and no
// dead_at, is published by the next relay round, and the result says what
// it was before, for the audit log.
func TestRedriveReturnsDeadLettersToPendingForTheRelay(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	dead := deadLetter(t, d, Message{Topic: "receipts", Payload: []byte("one")}, Message{Topic: "receipts", Payload: []byte("two")})
	require.Equal(t, 2, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL AND attempts = 1`))

	got, err := Redrive(context.Background(), d.Pool, RedriveSelection{IDs: []uuid.UUID{dead[0].ID}, RowIDs: []int64{dead[1].RowID}})
	require.NoError(t, err)
	require.Len(t, got, 2)
	for i, r := range got {
		require.Equal(t, dead[i].ID, r.ID)
		require.Equal(t, dead[i].RowID, r.RowID)
		require.Equal(t, "receipts", r.Topic)
		require.Equal(t, 1, r.Attempts)
		require.Contains(t, r.LastError, "410 Gone")
		require.WithinDuration(t, time.Now(), r.DeadAt, time.Minute)
	}
	require.Equal(t, 2, d.Count(t, `SELECT count(*) FROM outbox_messages
		WHERE dead_at IS NULL AND published_at IS NULL AND attempts = 0 AND available_at <= now()`))

	rec := &recorder{}
	require.Equal(t, 2, drain(t, newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{})))
	require.Equal(t, []string{"one", "two"}, rec.payloads())
	require.Equal(t, dead[0].ID, rec.published()[0].ID, "the same message id: receivers deduplicate on it")
	require.Equal(t, 1, rec.published()[0].Attempt, "attempts start again")
}

// Naming one message that is not a dead letter changes nothing, and the
// error names it.
func TestRedriveByIDIsAllOrNothing(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	dead := deadLetter(t, d, Message{Topic: "receipts", Payload: []byte("dead")})
	pendingRow, pendingID := opstest.InsertMessage(t, d.Pool, opstest.Message{})
	unknown := uuid.New()

	for _, sel := range []RedriveSelection{
		{RowIDs: []int64{dead[0].RowID, pendingRow}},
		{IDs: []uuid.UUID{dead[0].ID, pendingID}},
		{IDs: []uuid.UUID{dead[0].ID, unknown}},
		{RowIDs: []int64{dead[0].RowID, 1 << 40}},
	} {
		got, err := Redrive(context.Background(), d.Pool, sel)
		require.ErrorIs(t, err, ErrNotDeadLettered, "%+v", sel)
		require.Nil(t, got)
		require.NotContains(t, err.Error(), dead[0].ID.String())
		require.NotContains(t, err.Error(), "outbox: redrive: outbox:", "one prefix")
		require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL`), "nothing changed")
	}
	_, err := Redrive(context.Background(), d.Pool, RedriveSelection{IDs: []uuid.UUID{unknown}})
	require.EqualError(t, err, "outbox: not dead-lettered: "+unknown.String()+
		" (pending, published, deleted or unknown); nothing was redriven")
	_, err = Redrive(context.Background(), d.Pool, RedriveSelection{RowIDs: []int64{pendingRow}})
	require.ErrorContains(t, err, strconv.FormatInt(pendingRow, 10))

	// The same message named twice, by both ids, is redriven once.
	got, err := Redrive(context.Background(), d.Pool, RedriveSelection{IDs: []uuid.UUID{dead[0].ID, dead[0].ID}, RowIDs: []int64{dead[0].RowID}})
	require.NoError(t, err)
	require.Len(t, got, 1)
}

// All with a topic takes every dead letter of that topic, in batches, and
// leaves the other topics' alone.
func TestRedriveAllOfATopicTakesEveryBatchAndNoOtherTopic(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	_, err := d.Pool.Exec(context.Background(), `
		INSERT INTO outbox_messages (topic, payload, attempts, last_error, dead_at)
		SELECT CASE WHEN i % 10 = 0 THEN 'webhooks' ELSE 'receipts' END, '\x00', 10, 'timeout', now() - interval '1 hour'
		FROM generate_series(1, 2500) AS i`)
	require.NoError(t, err)

	got, err := Redrive(context.Background(), d.Pool, RedriveSelection{All: true, Topic: "receipts"})
	require.NoError(t, err)
	require.Len(t, got, 2250, "three batches")
	require.Equal(t, 2250, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE topic = 'receipts' AND dead_at IS NULL AND attempts = 0`))
	require.Equal(t, 250, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE topic = 'webhooks' AND dead_at IS NOT NULL`))

	got, err = Redrive(context.Background(), d.Pool, RedriveSelection{All: true})
	require.NoError(t, err)
	require.Len(t, got, 250)
	got, err = Redrive(context.Background(), d.Pool, RedriveSelection{All: true})
	require.NoError(t, err)
	require.Empty(t, got, "nothing left")
}

// A message that dies again while Redrive with All is at work is not
// redriven a second time by the same call.
func TestRedriveAllTakesOnlyWhatWasDeadWhenItStarted(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	_, err := d.Pool.Exec(context.Background(), `
		INSERT INTO outbox_messages (topic, payload, attempts, dead_at)
		SELECT 'receipts', '\x00', 10, now() - interval '1 hour' FROM generate_series(1, 1500)`)
	require.NoError(t, err)
	// Every message dies again as soon as it is redriven (as with a relay
	// at MaxAttempts 1 and a broken receiver, only sooner): its dead_at is
	// then after the call began. Without that bound the call would take
	// the same messages again forever.
	_, err = d.Pool.Exec(context.Background(), fmt.Sprintf(`
		CREATE FUNCTION %[1]s.die_again() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF OLD.dead_at IS NOT NULL AND NEW.dead_at IS NULL THEN
				NEW.dead_at := clock_timestamp() + interval '1 second';
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER die_again BEFORE UPDATE ON %[1]s.outbox_messages FOR EACH ROW EXECUTE FUNCTION %[1]s.die_again()`, d.Schema))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	got, err := Redrive(ctx, d.Pool, RedriveSelection{All: true})
	require.NoError(t, err)
	require.Len(t, got, 1500, "each message once: the call ends although they are dead again")
}

// Listening relays wake at the redrive's commit: with an hour between
// polls, the message is published at once.
func TestRedriveWakesAnIdleRelay(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	dead := deadLetter(t, d, Message{Topic: "receipts", Payload: []byte("again")})
	published := make(chan Envelope, 1)
	r := newTestRelay(t, d.Pool, PublisherFunc(func(_ context.Context, e Envelope) error {
		published <- e
		return nil
	}), Config{PollInterval: time.Hour})
	idle := idleSignal(r)
	start(t, r)
	waitIdle(t, idle, true)

	_, err := Redrive(context.Background(), d.Pool, RedriveSelection{IDs: []uuid.UUID{dead[0].ID}})
	require.NoError(t, err)
	select {
	case e := <-published:
		require.Equal(t, dead[0].ID, e.ID)
	case <-time.After(20 * time.Second):
		t.Fatal("not published: the redrive did not wake the relay")
	}
}

// A redriven message goes out before its ordering key's messages still
// pending: it is the oldest of its key again.
func TestRedrivenMessageLeadsItsOrderingKeyAgain(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	dead := deadLetter(t, d, Message{Topic: "orders", OrderingKey: "order:1", Payload: []byte("created")})
	enqueue(t, d.Pool, Message{Topic: "orders", OrderingKey: "order:1", Payload: []byte("paid")})

	got, err := Redrive(context.Background(), d.Pool, RedriveSelection{IDs: []uuid.UUID{dead[0].ID}})
	require.NoError(t, err)
	require.Equal(t, "order:1", got[0].OrderingKey)
	rec := &recorder{}
	drain(t, newTestRelay(t, d.Pool, PublisherFunc(rec.publish), Config{}))
	require.Equal(t, []string{"created", "paid"}, rec.payloads())
}

func TestRedriveRefusesASelectionThatNamesNothingOrMixesModes(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	for _, sel := range []RedriveSelection{
		{},
		{Topic: "receipts"},
		{All: true, IDs: []uuid.UUID{uuid.New()}},
		{All: true, RowIDs: []int64{1}},
		{RowIDs: make([]int64, MaxRedriveIDs+1)},
	} {
		_, err := Redrive(context.Background(), d.Pool, sel)
		require.ErrorIs(t, err, ErrInvalidRedrive, "%+v", sel)
	}
	_, err := Redrive(context.Background(), nil, RedriveSelection{All: true})
	require.ErrorIs(t, err, ErrInvalidRedrive)
}

// Redrive by message id and by row id works in every pgx query exec mode,
// including exec and simple_protocol (the modes used behind PgBouncer),
// which cannot encode a []uuid.UUID parameter as uuid[].
func TestRedriveByIDInEveryQueryExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement,
		pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec,
		pgx.QueryExecModeExec,
		pgx.QueryExecModeSimpleProtocol,
	} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			d := pgtest.New(t)
			pool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			dead := deadLetter(t, d, Message{Topic: "receipts", Payload: []byte("one")}, Message{Topic: "receipts", Payload: []byte("two")})

			got, err := Redrive(context.Background(), pool, RedriveSelection{IDs: []uuid.UUID{dead[0].ID}, RowIDs: []int64{dead[1].RowID}})
			require.NoError(t, err)
			require.Len(t, got, 2)
			require.Equal(t, dead[0].ID, got[0].ID)
			require.Equal(t, dead[1].RowID, got[1].RowID)

			_, err = Redrive(context.Background(), pool, RedriveSelection{IDs: []uuid.UUID{dead[0].ID}})
			require.ErrorIs(t, err, ErrNotDeadLettered, "no longer dead")
			require.ErrorContains(t, err, dead[0].ID.String())
		})
	}
}
