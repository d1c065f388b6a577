package cleanup_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/atomicphase/atomicphase/cleanup"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/txn"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var quiet = slog.New(slog.DiscardHandler)

func newCleaner(t *testing.T, d *pgtest.DB, cfg cleanup.Config) *cleanup.Cleaner {
	t.Helper()
	cfg.Logger = quiet
	c, err := cleanup.New(d.Pool, &cfg)
	require.NoError(t, err)
	return c
}

func exec(t *testing.T, d *pgtest.DB, sql string, args ...any) {
	t.Helper()
	_, err := d.Pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

// seed inserts n keys of mixed status and age, and n/5 outbox messages of
// mixed state and age, and records in expected_gone which of them a cleaner
// with the default TTL (24 h) and retention (7 days) must delete.
//
// Keys: i%10 in 0-1 running, 2-6 finished, 7-9 failed; terminal keys
// finished (i/10%5)*13 hours ago (0, 13, 26, 39 or 52 h), running keys
// created and last run (i/10%5)*3 days ago. Outbox: published, dead or pending,
// (i%4)*3 days ago.
func seed(t *testing.T, d *pgtest.DB, n int) (eligibleKeys, eligibleOutbox int) {
	t.Helper()
	exec(t, d, `
		INSERT INTO idempotency_keys (scope, key, fingerprint, request_method, request_path, workflow,
			recovery_point, status, attempts, created_at, last_run_at, finished_at,
			response_status, response_headers, response_body, failure_reason)
		SELECT 'seed', 'k' || i, decode(repeat('ab', 32), 'hex'), 'POST', '/orders', '',
			CASE WHEN i % 10 < 2 THEN 'started' ELSE 'finished' END,
			CASE WHEN i % 10 < 2 THEN 'running' WHEN i % 10 < 7 THEN 'finished' ELSE 'failed' END,
			1,
			now() - (i / 10 % 5) * interval '3 days' - interval '1 hour',
			now() - (i / 10 % 5) * interval '3 days',
			CASE WHEN i % 10 >= 2 THEN now() - (i / 10 % 5) * interval '13 hours' END,
			CASE WHEN i % 10 >= 7 THEN 500 WHEN i % 10 >= 2 THEN 201 END,
			CASE WHEN i % 10 >= 2 THEN '{}'::jsonb END,
			CASE WHEN i % 10 >= 2 THEN '\x7b7d'::bytea END,
			CASE WHEN i % 10 >= 7 THEN 'max_age' END
		FROM generate_series(1, $1::int) AS i`, n)
	exec(t, d, `
		INSERT INTO outbox_messages (idempotency_key_id, topic, payload, published_at, dead_at, created_at)
		SELECT (SELECT id FROM idempotency_keys WHERE scope = 'seed' AND key = 'k' || (i * 5)), 'receipts', '\x00'::bytea,
			CASE WHEN i % 3 = 0 THEN now() - (i % 4) * interval '3 days' END,
			CASE WHEN i % 3 = 1 THEN now() - (i % 4) * interval '3 days' END,
			now() - (i % 4) * interval '3 days' - interval '1 minute'
		FROM generate_series(1, $1::int / 5) AS i`, n)
	exec(t, d, `CREATE TABLE expected_gone AS
		SELECT 'key' AS kind, id FROM idempotency_keys WHERE status <> 'running' AND finished_at <= now() - interval '24 hours'
		UNION ALL
		SELECT 'outbox', id FROM outbox_messages WHERE coalesce(published_at, dead_at) <= now() - interval '7 days'`)
	return d.Count(t, `SELECT count(*) FROM expected_gone WHERE kind = 'key'`),
		d.Count(t, `SELECT count(*) FROM expected_gone WHERE kind = 'outbox'`)
}

// auditDeletes records, for every DELETE statement on the two tables, the
// transaction it ran in and how many rows it removed.
func auditDeletes(t *testing.T, d *pgtest.DB) {
	t.Helper()
	exec(t, d, `CREATE TABLE delete_audit (txid bigint NOT NULL, tbl text NOT NULL, n bigint NOT NULL)`)
	exec(t, d, `CREATE FUNCTION audit_delete() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO delete_audit SELECT txid_current(), TG_TABLE_NAME, count(*) FROM old_rows;
			RETURN NULL;
		END $$`)
	for _, tbl := range []string{"idempotency_keys", "outbox_messages"} {
		exec(t, d, `CREATE TRIGGER `+tbl+`_delete_audit AFTER DELETE ON `+tbl+`
			REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION audit_delete()`)
	}
}

func requireExactlyEligibleGone(t *testing.T, d *pgtest.DB, n, keys, outbox int) {
	t.Helper()
	require.Equal(t, n-keys, d.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE id IN (SELECT id FROM expected_gone WHERE kind = 'key')`))
	require.Equal(t, n/5-outbox, d.Count(t, `SELECT count(*) FROM outbox_messages`))
	require.Zero(t, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE id IN (SELECT id FROM expected_gone WHERE kind = 'outbox')`))
	require.Equal(t, n/5, d.Count(t, `SELECT count(*) FROM outbox_messages`)+outbox)
}

func TestCleanerDeletesExactlyEligibleRowsInBoundedBatchesAndNeverRunningKeys(t *testing.T) {
	t.Parallel()
	const n, batch = 100_000, 1000
	ctx := context.Background()
	d := pgtest.New(t)
	keys, outbox := seed(t, d, n)
	running := d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'running'`)
	require.Equal(t, n/5, running)
	require.Equal(t, 48_000, keys) // 80% terminal, 3 of 5 ages past 24 h
	auditDeletes(t, d)

	c := newCleaner(t, d, cleanup.Config{BatchSize: batch})
	dry, err := c.DryRun(ctx)
	require.NoError(t, err)
	require.Equal(t, cleanup.Report{KeysDeleted: int64(keys), OutboxDeleted: int64(outbox)}, dry)

	began := time.Now()
	rep, err := c.RunOnce(ctx)
	elapsed := time.Since(began)
	require.NoError(t, err)
	t.Logf("deleted %d keys and %d outbox messages in %d batches in %v (%.0f rows/s)",
		rep.KeysDeleted, rep.OutboxDeleted, rep.Batches, elapsed, float64(rep.KeysDeleted+rep.OutboxDeleted)/elapsed.Seconds())
	require.Equal(t, int64(keys), rep.KeysDeleted)
	require.Equal(t, int64(outbox), rep.OutboxDeleted)
	require.False(t, rep.Skipped)
	requireExactlyEligibleGone(t, d, n, keys, outbox)
	require.Equal(t, running, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'running'`),
		"running keys survive whatever their age")
	require.Equal(t, running*2/5, d.Count(t, `SELECT count(*) FROM idempotency_keys
		WHERE status = 'running' AND created_at < now() - interval '8 days'`), "including ones created 9 and 12 days ago")

	// No transaction deleted more than a batch; the batches are the ones reported.
	require.LessOrEqual(t, d.Count(t, `SELECT coalesce(max(s), 0) FROM
		(SELECT sum(n)::int AS s FROM delete_audit GROUP BY txid, tbl) AS per_tx`), batch)
	require.Equal(t, rep.Batches, d.Count(t, `SELECT count(*) FROM
		(SELECT txid FROM delete_audit GROUP BY txid, tbl HAVING sum(n) > 0) AS per_tx`))
	require.Equal(t, keys/batch+1, d.Count(t, `SELECT count(DISTINCT txid) FROM delete_audit WHERE tbl = 'idempotency_keys'`),
		"full batches, then one short one that ends the loop")
	// Outbox rows of deleted keys lost their link, not their existence.
	require.Zero(t, d.Count(t, `SELECT count(*) FROM outbox_messages m WHERE idempotency_key_id IS NOT NULL
		AND NOT EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.id = m.idempotency_key_id)`))

	again, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, cleanup.Report{}, again, "nothing left to delete")
}

func TestTwoCleanersAtOnceDoNoDoubleWork(t *testing.T) {
	t.Parallel()
	const n = 20_000
	ctx := context.Background()
	d := pgtest.New(t)
	keys, outbox := seed(t, d, n)

	var wg sync.WaitGroup
	reports := make([]cleanup.Report, 2)
	start := make(chan struct{})
	for i := range reports {
		// Separate pools, as separate processes would have.
		c, err := cleanup.New(d.NewPool(t, nil), &cleanup.Config{Logger: quiet, BatchSize: 500})
		require.NoError(t, err)
		wg.Go(func() {
			<-start
			rep, err := c.RunOnce(ctx)
			require.NoError(t, err)
			reports[i] = rep
		})
	}
	close(start)
	wg.Wait()
	t.Logf("reports: %+v", reports)
	require.Equal(t, int64(keys), reports[0].KeysDeleted+reports[1].KeysDeleted)
	require.Equal(t, int64(outbox), reports[0].OutboxDeleted+reports[1].OutboxDeleted)
	requireExactlyEligibleGone(t, d, n, keys, outbox)
}

// holdLock takes the cleanup lock of d's installation on a connection of its
// own, as a cleaner in another process would, until the returned func runs.
func holdLock(t *testing.T, d *pgtest.DB) (release func()) {
	t.Helper()
	conn, err := d.Pool.Acquire(context.Background())
	require.NoError(t, err)
	_, err = conn.Exec(context.Background(), `SELECT pg_advisory_lock($1::int,
		('idempotency_keys'::regclass::oid::bigint - 2147483648)::int)`, cleanup.LockClass)
	require.NoError(t, err)
	return sync.OnceFunc(func() {
		_, err := conn.Exec(context.Background(), `SELECT pg_advisory_unlock_all()`)
		require.NoError(t, err)
		conn.Release()
	})
}

func TestCleanerSkipsRoundWhileAnotherCleanerHoldsTheLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	keys, outbox := seed(t, d, 1000)
	other := pgtest.New(t) // another installation in the same database
	otherKeys, _ := seed(t, other, 1000)

	release := holdLock(t, d)
	defer release()
	rep, err := newCleaner(t, d, cleanup.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, cleanup.Report{Skipped: true}, rep)
	require.Equal(t, 1000, d.Count(t, `SELECT count(*) FROM idempotency_keys`), "nothing deleted")

	rep, err = newCleaner(t, other, cleanup.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	require.False(t, rep.Skipped, "the lock is per installation, not per database")
	require.Equal(t, int64(otherKeys), rep.KeysDeleted)

	release()
	rep, err = newCleaner(t, d, cleanup.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(keys), rep.KeysDeleted)
	require.Equal(t, int64(outbox), rep.OutboxDeleted)
}

// expiredKeyEnv runs one operation under a key, then lets the cleaner
// delete it after its TTL, leaving a tombstone.
func expiredKeyEnv(t *testing.T, policy txn.ExpiredKeyPolicy) (d *pgtest.DB, runner *txn.Runner, key txn.Key, fn txn.Func, ran *int, first txn.Response) {
	t.Helper()
	ctx := context.Background()
	d = pgtest.New(t)
	var err error
	runner, err = txn.New(d.Pool, &txn.Config{Logger: quiet, ExpiredKeyPolicy: policy})
	require.NoError(t, err)
	// The scope is the test's schema: txn's in-flight advisory lock on
	// (scope, key) is shared by the whole database.
	key = txn.Key{Scope: d.Schema, Value: "order-1", Method: "POST", Path: "/orders", Params: []byte(`{"qty":1}`)}
	ran = new(int)
	fn = func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		*ran++
		return txn.JSON(201, map[string]int{"run": *ran})
	}
	first, err = runner.Run(ctx, key, fn)
	require.NoError(t, err)

	c := newCleaner(t, d, cleanup.Config{})
	exec(t, d, `UPDATE idempotency_keys SET finished_at = now() - interval '23 hours 59 minutes'`)
	rep, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, rep.KeysDeleted, "within the TTL the key is kept")
	resp, err := runner.Run(ctx, key, fn)
	require.NoError(t, err)
	require.True(t, resp.Replayed)
	require.Equal(t, first.Body, resp.Body)

	exec(t, d, `UPDATE idempotency_keys SET finished_at = now() - interval '24 hours 1 minute'`)
	rep, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), rep.KeysDeleted)
	require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones
		WHERE scope = $1 AND key_hash = sha256(convert_to('order-1', 'UTF8')) AND response_status = 201
		  AND expires_at BETWEEN now() + interval '29 days 23 hours' AND now() + interval '30 days'`, d.Schema),
		"the deletion left a tombstone for 30 days")
	return d, runner, key, fn, ran, first
}

// A retry that comes after its key was cleaned up is not a new operation:
// it is answered ErrKeyExpired (422) and nothing runs, single-phase or
// workflow; once the tombstone's horizon passes, the key is free again.
func TestExpiredKeyReuseIsRejectedUntilTheTombstoneExpires(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d, runner, key, fn, ran, _ := expiredKeyEnv(t, txn.ExpiredKeyReject)

	_, err := runner.Run(ctx, key, fn)
	require.ErrorIs(t, err, txn.ErrKeyExpired)
	require.Equal(t, http.StatusUnprocessableEntity, txn.HTTPStatus(err))
	require.Equal(t, 1, *ran, "the function was not called")
	require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys`), "nothing written")

	reg := txn.NewRegistry()
	wf := txn.NewWorkflow("order", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		return a.Finish(ctx, fn)
	})
	require.NoError(t, reg.Register(wf))
	wfRunner, err := txn.New(d.Pool, &txn.Config{Logger: quiet, Workflows: reg})
	require.NoError(t, err)
	_, err = wfRunner.RunWorkflow(ctx, key, wf)
	require.ErrorIs(t, err, txn.ErrKeyExpired)
	require.Equal(t, 1, *ran)
	require.Equal(t, uint64(1), runner.Stats().ExpiredRejected)

	// The horizon passes: the cleaner deletes the tombstone, the key is free.
	exec(t, d, `UPDATE idempotency_key_tombstones SET expires_at = now() - interval '1 second'`)
	rep, err := newCleaner(t, d, cleanup.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), rep.TombstonesDeleted)
	resp, err := runner.Run(ctx, key, fn)
	require.NoError(t, err)
	require.False(t, resp.Replayed)
	require.Equal(t, 2, *ran)
}

// Under ExpiredKeyNewOperation a reused expired key runs again, as a new
// operation with new foreign keys, and is counted.
func TestExpiredKeyReuseUnderNewOperationRunsAgainWithANewForeignKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d, runner, key, fn, ran, _ := expiredKeyEnv(t, txn.ExpiredKeyNewOperation)
	resp, err := runner.Run(ctx, key, fn)
	require.NoError(t, err)
	require.False(t, resp.Replayed)
	require.Equal(t, 2, *ran, "fn ran again: a new operation")
	require.JSONEq(t, `{"run":2}`, string(resp.Body))
	require.Equal(t, uint64(1), runner.Stats().ExpiredReused)

	// A workflow's foreign key is derived from the new row: not the old one.
	var keys []string
	reg := txn.NewRegistry()
	wf := txn.NewWorkflow("pay", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (string, error) {
			keys = append(keys, fk)
			return "ch_1", nil
		}); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, fn)
	})
	require.NoError(t, reg.Register(wf))
	wfRunner, err := txn.New(d.Pool, &txn.Config{Logger: quiet, Workflows: reg, ExpiredKeyPolicy: txn.ExpiredKeyNewOperation})
	require.NoError(t, err)
	wkey := key
	wkey.Value = "pay-1"
	_, err = wfRunner.RunWorkflow(ctx, wkey, wf)
	require.NoError(t, err)
	exec(t, d, `UPDATE idempotency_keys SET finished_at = now() - interval '25 hours' WHERE key = 'pay-1'`)
	_, err = newCleaner(t, d, cleanup.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	_, err = wfRunner.RunWorkflow(ctx, wkey, wf)
	require.NoError(t, err)
	require.Len(t, keys, 2)
	require.NotEqual(t, keys[0], keys[1], "the new operation has its own foreign key")
}

// A cleanup racing a reuse of the key: each request gets one answer (a
// replay, a rejection, or, if it came before the deletion committed and
// after its lookup, a run), never a run that leaves the tombstone
// contradicting it; and no key is ever deleted without its tombstone, even
// when a round is stopped between batches.
func TestConcurrentCleanupAndReuseAndInterruptedRoundsKeepEveryTombstone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	runner, err := txn.New(d.Pool, &txn.Config{Logger: quiet})
	require.NoError(t, err)
	const n = 200
	fn := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) { return txn.JSON(201, map[string]int{}) }
	for i := range n {
		_, err := runner.Run(ctx, txn.Key{Scope: d.Schema, Value: fmt.Sprint("k", i), Method: "POST", Path: "/o"}, fn)
		require.NoError(t, err)
	}
	exec(t, d, `UPDATE idempotency_keys SET finished_at = now() - interval '25 hours'`)

	// A round stopped after its first batch: every deleted key has its tombstone.
	stopCtx, cancel := context.WithCancel(ctx)
	c := newCleaner(t, d, cleanup.Config{BatchSize: 10})
	exec(t, d, `CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(0.05); RETURN NULL; END $$`)
	exec(t, d, `CREATE TRIGGER slow_delete AFTER DELETE ON idempotency_keys FOR EACH STATEMENT EXECUTE FUNCTION slow()`)
	time.AfterFunc(120*time.Millisecond, cancel)
	rep, err := c.RunOnce(stopCtx)
	require.ErrorIs(t, err, context.Canceled)
	require.Positive(t, rep.KeysDeleted)
	require.Less(t, rep.KeysDeleted, int64(n))
	require.Equal(t, int(rep.KeysDeleted), d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones`))
	require.Equal(t, n, d.Count(t, `SELECT count(*) FROM idempotency_keys`)+d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones`))
	exec(t, d, `DROP TRIGGER slow_delete ON idempotency_keys`)

	// Reuse every key while another cleaner deletes the rest.
	var wg sync.WaitGroup
	var runs, rejected, replayed atomic.Int64
	wg.Go(func() {
		_, err := newCleaner(t, d, cleanup.Config{BatchSize: 7}).RunOnce(ctx)
		require.NoError(t, err)
	})
	for i := range n {
		wg.Go(func() {
			resp, err := runner.Run(ctx, txn.Key{Scope: d.Schema, Value: fmt.Sprint("k", i), Method: "POST", Path: "/o"},
				func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
					runs.Add(1)
					return txn.JSON(201, map[string]int{})
				})
			switch {
			case errors.Is(err, txn.ErrKeyExpired):
				rejected.Add(1)
			case err == nil && resp.Replayed:
				replayed.Add(1)
			default:
				require.NoError(t, err)
			}
		})
	}
	wg.Wait()
	require.Equal(t, int64(n), runs.Load()+rejected.Load()+replayed.Load(), "one answer per request")
	require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys k JOIN idempotency_key_tombstones t
		ON t.scope = k.scope AND t.key_hash = sha256(convert_to(k.key, 'UTF8')) WHERE k.created_at > now() - interval '1 hour'`),
		"no request ran under a key whose tombstone it should have met")
	t.Logf("reuse during cleanup: %d rejected, %d replayed, %d run", rejected.Load(), replayed.Load(), runs.Load())
}

func TestCleanerStoppedMidRoundLeavesOnlyWholeBatches(t *testing.T) {
	t.Parallel()
	const batch = 10
	d := pgtest.New(t)
	keys, _ := seed(t, d, 2000)
	// Slow every delete statement down so the round is still going when stopped.
	exec(t, d, `CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(0.02); RETURN NULL; END $$`)
	exec(t, d, `CREATE TRIGGER slow_delete AFTER DELETE ON idempotency_keys FOR EACH STATEMENT EXECUTE FUNCTION slow()`)

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	rep, err := newCleaner(t, d, cleanup.Config{BatchSize: batch}).RunOnce(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Positive(t, rep.KeysDeleted)
	require.Less(t, rep.KeysDeleted, int64(keys))
	require.Zero(t, rep.KeysDeleted%batch, "only whole batches were deleted")
	require.Equal(t, 2000-int(rep.KeysDeleted), d.Count(t, `SELECT count(*) FROM idempotency_keys`),
		"exactly the reported batches committed; the one in flight when stopped finished")

	// The lock was released with the round: the next round runs.
	rep, err = newCleaner(t, d, cleanup.Config{BatchSize: 1000}).RunOnce(context.Background())
	require.NoError(t, err)
	require.False(t, rep.Skipped)
	require.Equal(t, 2000-keys, d.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

func TestCleanerStartRunsRoundsUntilStop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	seed(t, d, 100)
	c := newCleaner(t, d, cleanup.Config{Interval: 20 * time.Millisecond})
	pgtest.WithLoopLabel(t, ctx, func(ctx context.Context) { require.NoError(t, c.Start(ctx)) })
	err := c.Start(ctx)
	require.ErrorIs(t, err, cleanup.ErrAlreadyStarted)
	requireOnePrefix(t, err)
	require.Eventually(t, func() bool {
		return d.Count(t, `SELECT count(*) FROM idempotency_keys`) == 100-d.Count(t, `SELECT count(*) FROM expected_gone WHERE kind = 'key'`)
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, 1, pgtest.LoopsRunning(t), "the loop runs")
	c.Stop()
	// Stop returned after the loop did: no round can start any more.
	require.Zero(t, pgtest.LoopsRunning(t), "no round after Stop")
	c.Stop()
	exec(t, d, `UPDATE idempotency_keys SET finished_at = now() - interval '2 days' WHERE status <> 'running'`)
	require.NotZero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status <> 'running'`))
}

// A Cleaner whose Start context ended is no longer running: it starts
// again without a Stop in between, and only a running one refuses.
func TestCleanerWhoseContextEndedStartsAgain(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	c := newCleaner(t, d, cleanup.Config{Interval: time.Hour})
	t.Cleanup(c.Stop)
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, c.Start(ctx))
	cancel()
	require.Eventually(t, func() bool { return c.Start(context.Background()) == nil }, 10*time.Second, 5*time.Millisecond,
		"Start still refuses after its context ended")
	require.ErrorIs(t, c.Start(context.Background()), cleanup.ErrAlreadyStarted)
}

// requireOnePrefix asserts the error names the package once, as in
// "cleanup: new: invalid config: ...", never "cleanup: new: cleanup: ...".
func requireOnePrefix(t *testing.T, err error) {
	t.Helper()
	require.Equal(t, 1, strings.Count(err.Error(), "cleanup:"), err.Error())
	require.True(t, strings.HasPrefix(err.Error(), "cleanup: "), err.Error())
}

func TestSkippedRoundIsLoggedAsAWarningWithTheReason(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seed(t, d, 100)
	release := holdLock(t, d)
	defer release()
	var logs bytes.Buffer
	c, err := cleanup.New(d.Pool, &cleanup.Config{Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	require.NoError(t, err)
	rep, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.True(t, rep.Skipped)
	var line struct {
		Level  string `json:"level"`
		Msg    string `json:"msg"`
		Reason string `json:"reason"`
	}
	require.NoError(t, json.Unmarshal(logs.Bytes(), &line), logs.String())
	require.Equal(t, "WARN", line.Level)
	require.Contains(t, line.Msg, "another cleaner holds the cleanup lock")
	require.Equal(t, "lock_held", line.Reason)
}

// A round is one span with what it deleted.
func TestCleanerRoundIsASpan(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	keys, _ := seed(t, d, 100)
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	rep, err := newCleaner(t, d, cleanup.Config{TracerProvider: tp}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(keys), rep.KeysDeleted)
	ended := spans.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, telemetry.SpanCleanup, ended[0].Name())
	require.Contains(t, ended[0].Attributes(), attribute.Int64("atomicphase.keys_deleted", int64(keys)))
	require.Contains(t, ended[0].Attributes(), attribute.Bool("atomicphase.skipped", false))
}
