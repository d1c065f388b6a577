package cleanup_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/cleanup"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// insertKeys inserts n finished keys named prefix1..prefixN whose
// finished_at is given by the SQL expression finished (over i, 1..n).
func insertKeys(t *testing.T, d *pgtest.DB, prefix string, n int, finished string) {
	t.Helper()
	exec(t, d, `
		INSERT INTO idempotency_keys (scope, key, fingerprint, request_method, request_path, recovery_point,
			status, created_at, last_run_at, finished_at, response_status, response_headers, response_body)
		SELECT 'batch', $1 || i, decode(repeat('ab', 32), 'hex'), 'POST', '/orders', 'finished',
			'finished', now() - interval '3 days', now() - interval '3 days', `+finished+`, 201, '{}', '\x7b7d'::bytea
		FROM generate_series(1, $2::int) AS i`, prefix, n)
}

// tombstoned counts the tombstones of the keys (scope 'batch') named.
func tombstoned(t *testing.T, d *pgtest.DB, keys ...string) int {
	t.Helper()
	return d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones
		WHERE scope = 'batch' AND key_hash IN (SELECT sha256(convert_to(k, 'UTF8')) FROM unnest($1::text[]) AS k)`, keys)
}

// lockHolder returns the backend pid of tx, whose locks a cleaner will wait on.
func lockHolder(t *testing.T, tx pgx.Tx) int {
	t.Helper()
	var pid int
	require.NoError(t, tx.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&pid))
	return pid
}

// waitForCleanerBlockedBy waits until a cleaner's delete of keys waits on a
// lock that the backend holder holds.
func waitForCleanerBlockedBy(t *testing.T, d *pgtest.DB, holder int) {
	t.Helper()
	waitForStatementBlockedBy(t, d, holder, "DeleteExpiredKeys")
}

// waitForStatementBlockedBy waits until the statement named query (its sqlc
// name) waits on a lock that the backend holder holds.
func waitForStatementBlockedBy(t *testing.T, d *pgtest.DB, holder int, query string) {
	t.Helper()
	require.Eventually(t, func() bool {
		return d.Count(t, `SELECT count(*) FROM pg_stat_activity
			WHERE $1::int = ANY (pg_blocking_pids(pid)) AND query LIKE '%' || $2 || '%'`, holder, query) > 0
	}, 10*time.Second, 5*time.Millisecond, "the cleaner never waited for the locked row")
}

// insertTombstones inserts n tombstones (scope 'batch') of keys named
// prefix1..prefixN whose expires_at is given by the SQL expression expires
// (over i, 1..n).
func insertTombstones(t *testing.T, d *pgtest.DB, prefix string, n int, expires string) {
	t.Helper()
	exec(t, d, `
		INSERT INTO idempotency_key_tombstones (scope, key_hash, fingerprint, finished_at, response_status, expires_at)
		SELECT 'batch', sha256(convert_to($1 || i, 'UTF8')), decode(repeat('ab', 32), 'hex'), now() - interval '40 days', 201, `+expires+`
		FROM generate_series(1, $2::int) AS i`, prefix, n)
}

// A key some other session holds locked (nothing in atomicphase locks a
// terminal key; an operator's SELECT ... FOR UPDATE does) is waited for and

// startRound runs one cleanup round in the background: done closes when it
// ends, and result waits for it and returns its outcome.
func startRound(t *testing.T, d *pgtest.DB, cfg cleanup.Config) (done <-chan struct{}, result func() (cleanup.Report, error)) {
	ch := make(chan struct{})
	var rep cleanup.Report
	var err error
	go func() {
		defer close(ch)
		rep, err = newCleaner(t, d, cfg).RunOnce(context.Background())
	}()
	return ch, func() (cleanup.Report, error) { <-ch; return rep, err }
}

// deleted with its tombstone, not skipped until a later round.
func TestCleanerWaitsForALockedExpiredKeyInsteadOfSkippingIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	const n = 30
	insertKeys(t, d, "k", n, "now() - interval '2 days' - i * interval '1 second'")

	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM idempotency_keys WHERE key = 'k5' FOR UPDATE`)
	require.NoError(t, err)
	holder := lockHolder(t, tx)

	done, result := startRound(t, d, cleanup.Config{BatchSize: 100})
	waitForCleanerBlockedBy(t, d, holder)
	select {
	case <-done:
		t.Fatal("the round ended while a key it must delete was locked")
	default:
	}
	require.NoError(t, tx.Commit(ctx))
	rep, runErr := result()
	require.NoError(t, runErr)
	require.Equal(t, int64(n), rep.KeysDeleted)
	require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Equal(t, n, d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones`))
}

// A key changed while the cleaner waited for it is judged by its new
// version: made running again (as an operator might), it is kept and gets
// no tombstone; changed but still expired, it is deleted with a tombstone
// from its new version, by that batch or (PostgreSQL 15, whose recheck of a
// TID scan matches the version the batch read) by the next round. Either
// way no key is deleted without its tombstone.
func TestCleanerRechecksAKeyChangedWhileItWaited(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	const n = 20
	insertKeys(t, d, "k", n, "now() - interval '2 days' - i * interval '1 second'")

	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `UPDATE idempotency_keys SET status = 'running', recovery_point = 'started', finished_at = NULL,
		response_status = NULL, response_headers = NULL, response_body = NULL WHERE key = 'k3'`)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `UPDATE idempotency_keys SET response_status = 202 WHERE key = 'k7'`)
	require.NoError(t, err)
	holder := lockHolder(t, tx)

	_, result := startRound(t, d, cleanup.Config{BatchSize: 100})
	waitForCleanerBlockedBy(t, d, holder)
	require.NoError(t, tx.Commit(ctx))
	rep, runErr := result()
	require.NoError(t, runErr)
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'k3' AND status = 'running'`),
		"the key made running meanwhile is kept")
	require.Zero(t, tombstoned(t, d, "k3"), "and has no tombstone")
	k7Left := d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'k7' AND response_status = 202`)
	require.Equal(t, 1-k7Left, tombstoned(t, d, "k7"), "k7 is either still there or tombstoned")
	require.Equal(t, int64(n-1-k7Left), rep.KeysDeleted)
	require.Equal(t, n, d.Count(t, `SELECT count(*) FROM idempotency_keys`)+d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones`))

	rep, err = newCleaner(t, d, cleanup.Config{BatchSize: 100}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(k7Left), rep.KeysDeleted)
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones
		WHERE key_hash = sha256(convert_to('k7', 'UTF8')) AND response_status = 202`),
		"k7's tombstone is from its new version")
	require.Zero(t, tombstoned(t, d, "k3"))
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

// Each batch starts where the previous one stopped (the latest finished_at
// it deleted); keys sharing one finish time across a batch boundary, and
// keys not yet expired or still running among them, are handled exactly.
func TestARoundDeletesKeysSharingAFinishTimeAcrossBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	// 250 keys finished at one instant, between two runs of distinct times;
	// and keys that must stay: finished within the TTL, and running.
	insertKeys(t, d, "early", 120, "now() - interval '3 days' - i * interval '1 millisecond'")
	insertKeys(t, d, "tied", 250, "date_trunc('second', now()) - interval '2 days 12 hours'")
	insertKeys(t, d, "late", 130, "now() - interval '2 days' + i * interval '1 millisecond'")
	insertKeys(t, d, "fresh", 40, "now() - interval '23 hours' - i * interval '1 second'")
	exec(t, d, `INSERT INTO idempotency_keys (scope, key, fingerprint, request_method, request_path, status, created_at, last_run_at)
		SELECT 'batch', 'running' || i, decode(repeat('ab', 32), 'hex'), 'POST', '/orders', 'running', now() - interval '9 days', now() - interval '9 days'
		FROM generate_series(1, 30) AS i`)
	auditDeletes(t, d)

	rep, err := newCleaner(t, d, cleanup.Config{BatchSize: 100}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(500), rep.KeysDeleted)
	require.Equal(t, 5, rep.Batches)
	require.Equal(t, 70, d.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Equal(t, 40, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key LIKE 'fresh%'`))
	require.Equal(t, 30, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'running'`))
	require.Equal(t, 500, d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones`))
	require.LessOrEqual(t, d.Count(t, `SELECT max(n)::int FROM delete_audit WHERE tbl = 'idempotency_keys'`), 100)
}

// BatchPause spaces a round's delete transactions, and a round stopped
// during a pause stops at once, with exactly the batches before it deleted.
func TestBatchPauseSpacesBatchesAndAStopDuringAPauseIsPrompt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	const n, batch, pause = 50, 10, 80 * time.Millisecond
	insertKeys(t, d, "k", n, "now() - interval '2 days' - i * interval '1 second'")
	exec(t, d, `CREATE TABLE delete_times (at timestamptz NOT NULL)`)
	exec(t, d, `CREATE FUNCTION note_delete() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN INSERT INTO delete_times VALUES (clock_timestamp()); RETURN NULL; END $$`)
	exec(t, d, `CREATE TRIGGER note_delete AFTER DELETE ON idempotency_keys FOR EACH STATEMENT EXECUTE FUNCTION note_delete()`)

	began := time.Now()
	rep, err := newCleaner(t, d, cleanup.Config{BatchSize: batch, BatchPause: pause}).RunOnce(ctx)
	elapsed := time.Since(began)
	require.NoError(t, err)
	require.Equal(t, int64(n), rep.KeysDeleted)
	require.Equal(t, n/batch, rep.Batches)
	require.GreaterOrEqual(t, elapsed, time.Duration(rep.Batches-1)*pause)
	// Every delete statement (the full batches and the short one that ends
	// the loop) came at least a pause after the previous one.
	require.Equal(t, n/batch+1, d.Count(t, `SELECT count(*) FROM delete_times`))
	require.Zero(t, d.Count(t, `SELECT count(*) FROM (
		SELECT at - lag(at) OVER (ORDER BY at) AS gap FROM delete_times) AS g
		WHERE gap < $1::interval`, pause.String()), "two batches less than a pause apart")

	// Stopped during a long pause: the round returns at once.
	insertKeys(t, d, "again", n, "now() - interval '2 days'")
	stopCtx, cancel := context.WithCancel(ctx)
	c := newCleaner(t, d, cleanup.Config{BatchSize: batch, BatchPause: cleanup.BatchPauseMax})
	done := make(chan struct{})
	go func() {
		defer close(done)
		rep, err = c.RunOnce(stopCtx)
	}()
	require.Eventually(t, func() bool { return d.Count(t, `SELECT count(*) FROM idempotency_keys`) == n-batch },
		10*time.Second, 5*time.Millisecond, "the first batch")
	time.Sleep(50 * time.Millisecond) // into the pause
	cancel()
	stopped := time.Now()
	<-done
	require.ErrorIs(t, err, context.Canceled)
	require.Less(t, time.Since(stopped), 5*time.Second, "the round waited out its pause")
	require.Equal(t, cleanup.Report{KeysDeleted: batch, Batches: 1}, rep, "one batch, then the pause")
	require.Equal(t, n-batch, d.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Equal(t, n+batch, d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones`))
}

// A tombstone some other session holds locked is waited for and deleted,
// not skipped until a later round; one whose expiry moved into the future
// while the cleaner waited (as a newer deletion of its key would move it)
// is kept.
func TestCleanerWaitsForALockedExpiredTombstoneAndRechecksIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	const n = 30
	insertTombstones(t, d, "k", n, "now() - interval '1 day' - i * interval '1 second'")

	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM idempotency_key_tombstones WHERE key_hash = sha256(convert_to('k5', 'UTF8')) FOR UPDATE`)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `UPDATE idempotency_key_tombstones SET expires_at = now() + interval '30 days'
		WHERE key_hash = sha256(convert_to('k9', 'UTF8'))`)
	require.NoError(t, err)
	holder := lockHolder(t, tx)

	done, result := startRound(t, d, cleanup.Config{BatchSize: 100})
	waitForStatementBlockedBy(t, d, holder, "DeleteExpiredTombstones")
	select {
	case <-done:
		t.Fatal("the round ended while a tombstone it must delete was locked")
	default:
	}
	require.NoError(t, tx.Commit(ctx))
	rep, runErr := result()
	require.NoError(t, runErr)
	require.Equal(t, int64(n-1), rep.TombstonesDeleted)
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones`))
	require.Equal(t, 1, tombstoned(t, d, "k9"), "the tombstone renewed meanwhile is kept")
}

// Each batch of tombstones starts where the previous one stopped (the latest
// expires_at it deleted); tombstones sharing one expiry across a batch
// boundary (every tombstone a batch of keys leaves has the same one) are all
// deleted, and unexpired ones are kept.
func TestARoundDeletesTombstonesSharingAnExpiryAcrossBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	insertTombstones(t, d, "early", 120, "now() - interval '3 days' - i * interval '1 millisecond'")
	insertTombstones(t, d, "tied", 250, "date_trunc('second', now()) - interval '2 days'")
	insertTombstones(t, d, "late", 130, "now() - interval '1 day' + i * interval '1 millisecond'")
	insertTombstones(t, d, "live", 40, "now() + interval '1 hour' - i * interval '1 second'")

	rep, err := newCleaner(t, d, cleanup.Config{BatchSize: 100}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(500), rep.TombstonesDeleted)
	require.Equal(t, 5, rep.Batches)
	require.Equal(t, 40, d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones`))
	require.Equal(t, 40, d.Count(t, `SELECT count(*) FROM idempotency_key_tombstones WHERE expires_at > now()`))
}
