package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/internal/inboxtest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

var errInjected = errors.New("injected handler failure")

func newInbox(t *testing.T, pool *pgxpool.Pool, consumer string, mod ...func(*inbox.Config)) *inbox.Inbox {
	t.Helper()
	cfg := inbox.Config{Consumer: consumer, Logger: inboxtest.Logger(t)}
	for _, m := range mod {
		m(&cfg)
	}
	in, err := inbox.New(pool, &cfg)
	require.NoError(t, err)
	return in
}

func setup(t *testing.T) *pgtest.DB {
	t.Helper()
	d := pgtest.New(t)
	inboxtest.CreateEffects(t, d)
	return d
}

// effect returns a handler that writes one effect row for id and counts its runs.
func effect(consumer, id string, runs *atomic.Int64) inbox.Func {
	return func(ctx context.Context, tx pgx.Tx) error {
		runs.Add(1)
		return inboxtest.WriteEffect(ctx, tx, consumer, id, nil)
	}
}

func TestRedeliveredMessageIsAcknowledgedWithoutRunningTheHandler(t *testing.T) {
	t.Parallel()
	d := setup(t)
	in := newInbox(t, d.Pool, "receipts")
	ctx := context.Background()
	var runs atomic.Int64
	id := "0193b1c2-7d3e-7a10-8b2c-1f2e3d4c5b6a"

	out, err := in.Handle(ctx, id, effect("receipts", id, &runs))
	require.NoError(t, err)
	require.Equal(t, inbox.Handled, out)
	for range 3 {
		out, err = in.Handle(ctx, id, effect("receipts", id, &runs))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out)
	}
	require.EqualValues(t, 1, runs.Load(), "the handler ran for the first delivery only")
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM inbox_messages
		WHERE consumer = 'receipts' AND message_id = $1 AND dead_at IS NULL
		  AND keep_until = recorded_at + interval '7 days'`, id))
	require.Equal(t, inbox.Stats{Handled: 1, Duplicates: 3}, in.Stats())
}

func TestHandlerErrorRollsBackAndLeavesTheMessageForRedelivery(t *testing.T) {
	t.Parallel()
	d := setup(t)
	in := newInbox(t, d.Pool, "receipts")
	ctx := context.Background()
	fail := func(ctx context.Context, tx pgx.Tx) error {
		if err := inboxtest.WriteEffect(ctx, tx, "receipts", "m1", nil); err != nil {
			return err
		}
		return errInjected
	}
	_, err := in.Handle(ctx, "m1", fail)
	require.ErrorIs(t, err, errInjected)
	require.Zero(t, d.Count(t, `SELECT count(*) FROM effects`), "the handler's write rolled back")
	require.Zero(t, d.Count(t, `SELECT count(*) FROM inbox_messages`), "no row: the message is still to be handled")

	var runs atomic.Int64
	out, err := in.Handle(ctx, "m1", effect("receipts", "m1", &runs))
	require.NoError(t, err)
	require.Equal(t, inbox.Handled, out, "the redelivery runs the handler")
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, inbox.Stats{Handled: 1, Failed: 1}, in.Stats())
}

// A database that cannot be reached, or that takes no writes (a server in
// recovery or a demoted primary during a failover: SQLSTATE 25006), is not
// the handler's failure: Handle says ErrUnavailable, counts it apart from
// handler failures, and the redelivery once the database is back is handled.
func TestDatabaseUnavailableIsErrUnavailableNotAHandlerFailure(t *testing.T) {
	t.Parallel()
	d := setup(t)
	ctx := context.Background()
	var runs atomic.Int64

	readOnly := d.NewPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	})
	in := newInbox(t, readOnly, "receipts")
	_, err := in.Handle(ctx, "m1", effect("receipts", "m1", &runs))
	require.ErrorIs(t, err, inbox.ErrUnavailable)
	require.Equal(t, inbox.Stats{Unavailable: 1}, in.Stats())

	proxy, pool := d.NewProxy(t)
	in = newInbox(t, pool, "receipts")
	proxy.Unreachable()
	_, err = in.Handle(ctx, "m1", effect("receipts", "m1", &runs))
	require.ErrorIs(t, err, inbox.ErrUnavailable)
	require.Equal(t, inbox.Stats{Unavailable: 1}, in.Stats())
	require.Zero(t, d.Count(t, `SELECT count(*) FROM inbox_messages`))

	proxy.Reachable()
	out, err := in.Handle(ctx, "m1", effect("receipts", "m1", &runs))
	require.NoError(t, err)
	require.Equal(t, inbox.Handled, out)
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, inbox.Stats{Handled: 1, Unavailable: 1}, in.Stats())
}

func TestHandlerPanicIsAnErrorAndRollsBack(t *testing.T) {
	t.Parallel()
	d := setup(t)
	in := newInbox(t, d.Pool, "receipts")
	ctx := context.Background()
	_, err := in.Handle(ctx, "m1", func(ctx context.Context, tx pgx.Tx) error {
		if err := inboxtest.WriteEffect(ctx, tx, "receipts", "m1", nil); err != nil {
			return err
		}
		panic("handler bug")
	})
	require.ErrorIs(t, err, inbox.ErrPanicked)
	var pe *inbox.PanicError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, "handler bug", pe.Value)
	require.Contains(t, string(pe.Stack), "inbox_test.go")
	require.Zero(t, d.Count(t, `SELECT count(*) FROM effects`))
	require.Zero(t, d.Count(t, `SELECT count(*) FROM inbox_messages`))

	var runs atomic.Int64
	out, err := in.Handle(ctx, "m1", effect("receipts", "m1", &runs))
	require.NoError(t, err)
	require.Equal(t, inbox.Handled, out)
}

// A real serialization failure: the handler reads a counter, another
// transaction updates and commits it, then the handler updates it too
// (40001, concurrent update). Handle rolls back and runs the handler
// again, which commits; the counter counts both updates once each.
func TestSerializationFailureRetriesTheHandler(t *testing.T) {
	t.Parallel()
	d := setup(t)
	ctx := context.Background()
	_, err := d.Pool.Exec(ctx, `CREATE TABLE counter (id int PRIMARY KEY, n int NOT NULL); INSERT INTO counter VALUES (1, 0)`)
	require.NoError(t, err)
	contended := func(interfere func(int64) bool, runs *atomic.Int64) inbox.Func {
		return func(ctx context.Context, tx pgx.Tx) error {
			run := runs.Add(1)
			var n int
			if err := tx.QueryRow(ctx, `SELECT n FROM counter WHERE id = 1`).Scan(&n); err != nil {
				return err
			}
			if interfere(run) {
				if _, err := d.Pool.Exec(ctx, `UPDATE counter SET n = n + 1 WHERE id = 1`); err != nil {
					return err
				}
			}
			_, err := tx.Exec(ctx, `UPDATE counter SET n = n + 1 WHERE id = 1`)
			return err
		}
	}

	in := newInbox(t, d.Pool, "counter")
	var runs atomic.Int64
	out, err := in.Handle(ctx, "m1", contended(func(run int64) bool { return run == 1 }, &runs))
	require.NoError(t, err)
	require.Equal(t, inbox.Handled, out)
	require.EqualValues(t, 2, runs.Load(), "the first run met 40001 and was retried")
	require.Equal(t, 2, d.Count(t, `SELECT n FROM counter`), "the interfering update and the handler's, once each")
	require.Equal(t, inbox.Stats{Handled: 1, Retries: 1}, in.Stats())

	// A conflict on every try: ErrConflict after MaxRetries, nothing recorded.
	stubborn := newInbox(t, d.Pool, "counter", func(c *inbox.Config) { c.MaxRetries = 2; c.RetryBaseDelay = time.Millisecond })
	runs.Store(0)
	_, err = stubborn.Handle(ctx, "m2", contended(func(int64) bool { return true }, &runs))
	require.ErrorIs(t, err, inbox.ErrConflict)
	require.EqualValues(t, 3, runs.Load())
	require.Zero(t, d.Count(t, `SELECT count(*) FROM inbox_messages WHERE message_id = 'm2'`))
	require.Equal(t, inbox.Stats{Conflicts: 1, Retries: 2}, stubborn.Stats())
}

// Twenty deliveries of one message at once: the first records it and runs
// the handler; the others wait for its commit, find its row and are
// acknowledged. The handler runs once, its effect is written once.
func TestConcurrentDeliveriesOfOneMessageRunTheHandlerOnce(t *testing.T) {
	t.Parallel()
	d := setup(t)
	app := "inbox_concurrent_" + d.Schema
	pool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
	in := newInbox(t, pool, "receipts")
	var runs atomic.Int64
	release := make(chan struct{})
	slow := func(ctx context.Context, tx pgx.Tx) error {
		runs.Add(1)
		<-release // hold the row uncommitted while the others arrive
		return inboxtest.WriteEffect(ctx, tx, "receipts", "m1", nil)
	}
	var wg sync.WaitGroup
	outcomes := make(chan inbox.Outcome, 20)
	for range 20 {
		wg.Go(func() {
			out, err := in.Handle(context.Background(), "m1", slow)
			if err != nil {
				t.Errorf("handle: %v", err)
			}
			outcomes <- out
		})
	}
	deadline := time.Now().Add(30 * time.Second)
	for d.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = $1`, app) < 19 {
		require.True(t, time.Now().Before(deadline), "the other deliveries never queued behind the first")
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	wg.Wait()
	close(outcomes)
	count := map[inbox.Outcome]int{}
	for o := range outcomes {
		count[o]++
	}
	require.Equal(t, map[inbox.Outcome]int{inbox.Handled: 1, inbox.Duplicate: 19}, count)
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM effects`))
}

// Consumers share the table: the same message id is handled once by each.
func TestSeveralConsumersShareOneTable(t *testing.T) {
	t.Parallel()
	d := setup(t)
	ctx := context.Background()
	var runs atomic.Int64
	for _, consumer := range []string{"receipts", "analytics", "emails"} {
		in := newInbox(t, d.Pool, consumer)
		for range 2 {
			_, err := in.Handle(ctx, "m1", effect(consumer, "m1", &runs))
			require.NoError(t, err)
		}
		require.Equal(t, inbox.Stats{Handled: 1, Duplicates: 1}, in.Stats(), consumer)
	}
	require.EqualValues(t, 3, runs.Load())
	require.Equal(t, 3, d.Count(t, `SELECT count(DISTINCT consumer) FROM effects`))
	require.Equal(t, 3, d.Count(t, `SELECT count(*) FROM inbox_messages WHERE message_id = 'm1'`))
}

// Bad ids are refused before any SQL: nothing is sent to the server, the
// handler does not run.
func TestInvalidMessageIDIsRejectedBeforeAnySQL(t *testing.T) {
	t.Parallel()
	d := setup(t)
	pool, counter := inboxtest.CountingPool(t, d)
	in := newInbox(t, pool, "receipts")
	ctx := context.Background()
	for name, id := range map[string]string{
		"empty":       "",
		"oversized":   strings.Repeat("a", inbox.MaxMessageIDBytes+1),
		"nul":         "abc\x00def",
		"newline":     "abc\ndef",
		"del":         "abc\x7f",
		"non-ascii":   "caf\u00e9",
		"invalid utf": "\xff\xfe",
	} {
		var runs atomic.Int64
		_, err := in.Handle(ctx, id, effect("receipts", id, &runs))
		require.ErrorIs(t, err, inbox.ErrInvalidMessageID, name)
		require.Zero(t, runs.Load(), name)
		_, err = in.DeadLetter(ctx, inbox.Message{ID: id}, errInjected)
		require.ErrorIs(t, err, inbox.ErrInvalidMessageID, name)
	}
	require.Zero(t, counter.N(), "no statement reached the server")
	require.Zero(t, d.Count(t, `SELECT count(*) FROM inbox_messages`))

	// The longest valid id, and the characters at both ends of the range, are fine.
	for _, id := range []string{strings.Repeat("z", inbox.MaxMessageIDBytes), " ~", "evt_1NXu2x2eZvKYlo2C"} {
		var runs atomic.Int64
		_, err := in.Handle(ctx, id, effect("receipts", id, &runs))
		require.NoError(t, err, "%q", id)
	}
}

func TestHandlerCannotEndItsTransaction(t *testing.T) {
	t.Parallel()
	d := setup(t)
	in := newInbox(t, d.Pool, "receipts")
	ctx := context.Background()

	// Commit and Rollback are refused; ignoring the refusal commits normally.
	out, err := in.Handle(ctx, "m1", func(ctx context.Context, tx pgx.Tx) error {
		require.ErrorIs(t, tx.Commit(ctx), inbox.ErrInvalidUse)
		require.ErrorIs(t, tx.Rollback(ctx), inbox.ErrInvalidUse)
		return inboxtest.WriteEffect(ctx, tx, "receipts", "m1", nil)
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Handled, out)
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM effects`))

	// A savepoint is the handler's to end.
	_, err = in.Handle(ctx, "m2", func(ctx context.Context, tx pgx.Tx) error {
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if err := inboxtest.WriteEffect(ctx, sp, "receipts", "m2-discarded", nil); err != nil {
			return err
		}
		if err := sp.Rollback(ctx); err != nil {
			return err
		}
		return inboxtest.WriteEffect(ctx, tx, "receipts", "m2", nil)
	})
	require.NoError(t, err)
	require.Equal(t, 0, d.Count(t, `SELECT count(*) FROM effects WHERE message_id = 'm2-discarded'`))
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM effects WHERE message_id = 'm2'`))

	// ROLLBACK sent as SQL: reported, nothing recorded.
	_, err = in.Handle(ctx, "m3", func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "ROLLBACK")
		return err
	})
	require.ErrorIs(t, err, inbox.ErrInvalidUse)
	require.Zero(t, d.Count(t, `SELECT count(*) FROM inbox_messages WHERE message_id = 'm3'`))

	// A failed statement the handler swallows aborts the transaction: an
	// error, not a commit.
	_, err = in.Handle(ctx, "m4", func(ctx context.Context, tx pgx.Tx) error {
		_ = inboxtest.WriteEffect(ctx, tx, "receipts", "m4", nil)
		_, _ = tx.Exec(ctx, "SELECT 1/0")
		return nil
	})
	require.ErrorContains(t, err, "aborted the transaction")
	require.Zero(t, d.Count(t, `SELECT count(*) FROM inbox_messages WHERE message_id = 'm4'`))
	require.Zero(t, d.Count(t, `SELECT count(*) FROM effects WHERE message_id = 'm4'`))

	_, err = in.Handle(ctx, "m5", nil)
	require.ErrorIs(t, err, inbox.ErrInvalidUse)
}

func TestDeadLetterKeepsTheErrorAndAcknowledgesRedeliveries(t *testing.T) {
	t.Parallel()
	d := setup(t)
	in := newInbox(t, d.Pool, "receipts")
	ctx := context.Background()
	msg := inbox.Message{
		ID: "m1", Topic: "ride.receipt", Payload: []byte{0, 1, 2, 0xff}, Deliveries: 5,
		Headers: map[string][]string{"Content-Type": {"application/json"}, "X-Odd": {"nul\x00here", "\xff"}},
	}
	ok, err := in.DeadLetter(ctx, msg, fmt.Errorf("decode receipt: %w", errInjected))
	require.NoError(t, err)
	require.True(t, ok)
	var (
		lastError, topic, headers string
		payload                   []byte
		deliveries                int
	)
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT last_error, topic, payload, headers::text, deliveries
		FROM inbox_messages WHERE consumer = 'receipts' AND message_id = 'm1' AND dead_at IS NOT NULL`).
		Scan(&lastError, &topic, &payload, &headers, &deliveries))
	require.Equal(t, "decode receipt: injected handler failure", lastError)
	require.Equal(t, "ride.receipt", topic)
	require.Equal(t, msg.Payload, payload)
	require.Equal(t, 5, deliveries)
	require.Contains(t, headers, `"Content-Type": ["application/json"]`)
	require.Contains(t, headers, "\"X-Odd\": [\"nul\ufffdhere\", \"\ufffd\"]", "a NUL jsonb cannot hold is replaced, not fatal")

	var runs atomic.Int64
	out, err := in.Handle(ctx, "m1", effect("receipts", "m1", &runs))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out, "a redelivered dead letter is acknowledged")
	require.Zero(t, runs.Load())

	ok, err = in.DeadLetter(ctx, msg, errInjected)
	require.NoError(t, err)
	require.False(t, ok, "already dead-lettered: unchanged")
	_, err = in.Handle(ctx, "m2", effect("receipts", "m2", &runs))
	require.NoError(t, err)
	ok, err = in.DeadLetter(ctx, inbox.Message{ID: "m2"}, errInjected)
	require.NoError(t, err)
	require.False(t, ok, "handled meanwhile: not a dead letter")
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM inbox_messages WHERE dead_at IS NOT NULL`))
	require.EqualValues(t, 1, in.Stats().DeadLettered)

	// An error text PostgreSQL's text cannot hold is still recorded.
	ok, err = in.DeadLetter(ctx, inbox.Message{ID: "m3"}, errors.New("bad \x00 byte \xff"))
	require.NoError(t, err)
	require.True(t, ok)
}

// Every pgx query exec mode carries the inbox, BEGIN pipelined with the
// message's row included (PgBouncer in transaction mode needs exec or
// simple_protocol).
func TestEveryQueryExecModeHandlesAndDeduplicates(t *testing.T) {
	t.Parallel()
	d := setup(t)
	for name, mode := range map[string]pgx.QueryExecMode{
		"cache_statement": pgx.QueryExecModeCacheStatement,
		"cache_describe":  pgx.QueryExecModeCacheDescribe,
		"describe_exec":   pgx.QueryExecModeDescribeExec,
		"exec":            pgx.QueryExecModeExec,
		"simple_protocol": pgx.QueryExecModeSimpleProtocol,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			in := newInbox(t, pool, name)
			ctx := context.Background()
			var runs atomic.Int64
			for range 2 {
				_, err := in.Handle(ctx, "m1", effect(name, "m1", &runs))
				require.NoError(t, err)
			}
			ok, err := in.DeadLetter(ctx, inbox.Message{ID: "m2", Topic: "t", Payload: []byte{0}, Headers: map[string][]string{"a": {"b"}}}, errInjected)
			require.NoError(t, err)
			require.True(t, ok)
			require.EqualValues(t, 1, runs.Load())
			require.Equal(t, inbox.Stats{Handled: 1, Duplicates: 1, DeadLettered: 1}, in.Stats())
		})
	}
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	for name, cfg := range map[string]*inbox.Config{
		"nil config":         nil,
		"no consumer":        {},
		"consumer too long":  {Consumer: strings.Repeat("c", 256)},
		"consumer control":   {Consumer: "a\tb"},
		"negative retention": {Consumer: "c", Retention: -time.Second},
		"tiny retention":     {Consumer: "c", Retention: time.Millisecond},
		"negative retries":   {Consumer: "c", MaxRetries: -1},
	} {
		_, err := inbox.New(d.Pool, cfg)
		require.ErrorIs(t, err, inbox.ErrInvalidConfig, name)
	}
	_, err := inbox.New(nil, &inbox.Config{Consumer: "c"})
	require.ErrorIs(t, err, inbox.ErrInvalidConfig)

	in, err := inbox.New(d.Pool, &inbox.Config{Consumer: "c"})
	require.NoError(t, err)
	cfg := in.Config()
	require.Equal(t, inbox.RetentionDefault, cfg.Retention)
	require.Equal(t, 8, cfg.MaxRetries)
	require.NotNil(t, cfg.Logger)

	require.NoError(t, in.CheckHorizon(time.Hour, "the stream"))
	err = in.CheckHorizon(8*24*time.Hour, "the stream")
	require.ErrorIs(t, err, inbox.ErrRetentionTooShort)
	require.ErrorContains(t, err, "192h0m0s")
	require.ErrorContains(t, err, "168h0m0s")
}
