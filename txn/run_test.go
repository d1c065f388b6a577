package txn_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/txn"
)

func TestNewKeyRunsOnceAndStoresResponseWithWrites(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64

	resp, err := e.runner.Run(ctx, chargeKey("k1", 500), insertCharge(&calls, "c1", 500))
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.False(t, resp.Replayed)
	require.Equal(t, int64(1), calls.Load())
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))

	k := readKey(t, e.Pool, "acct_1", "k1")
	require.Equal(t, "finished", k.Status)
	require.Equal(t, 201, *k.RespStatus)
	require.Equal(t, resp.Body, k.RespBody)
	require.False(t, k.LeaseHeld)

	// The key row and the business row were written by the same transaction.
	require.Equal(t, 1, e.Count(t, `SELECT count(DISTINCT k.xmin::text) FROM idempotency_keys k, charges c WHERE k.xmin::text = c.xmin::text`))
}

// A Run on a new key writes its key row once: inserted at the end, finished
// and with the response, as a hand-written keyed transaction would, not
// inserted and then updated. Counted by the server: a trigger bumps a
// sequence (which no rollback undoes) for every row version written.
func TestRunWritesItsKeyRowOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	_, err := e.Pool.Exec(ctx, `
		CREATE SEQUENCE key_row_writes;
		CREATE FUNCTION count_key_row_write() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM nextval('key_row_writes'); RETURN NEW; END $$;
		CREATE TRIGGER count_key_row_writes BEFORE INSERT OR UPDATE ON idempotency_keys
			FOR EACH ROW EXECUTE FUNCTION count_key_row_write()`)
	require.NoError(t, err)
	var calls atomic.Int64
	for i := range 3 { // the first Run on a connection prepares; the later ones ride with BEGIN
		ref := fmt.Sprintf("c%d", i)
		resp, err := e.runner.Run(ctx, chargeKey(ref, 1), insertCharge(&calls, ref, 1))
		require.NoError(t, err)
		require.Equal(t, 201, resp.Status)
	}
	var writes int64
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT last_value FROM key_row_writes`).Scan(&writes))
	require.Equal(t, int64(3), writes, "one row version per key")
	require.Equal(t, 3, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'finished' AND response_status = 201`))
}

func TestFunctionErrorStoresNothingAndRetryRunsAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	_, err := e.runner.Run(ctx, chargeKey("k1", 500), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('x', 1)`); err != nil {
			return txn.Response{}, err
		}
		return txn.Response{}, errInjected
	})
	require.ErrorIs(t, err, errInjected)
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM charges`))

	// A retry runs afresh.
	var calls atomic.Int64
	resp, err := e.runner.Run(ctx, chargeKey("k1", 500), insertCharge(&calls, "c1", 500))
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), calls.Load())
}

func TestFinishedKeyReplaysByteForByteInOneRoundTrip(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	body := []byte("{\"weird\":  \"spacing\" , \"n\":1.50}\n")
	first, err := e.runner.Run(ctx, chargeKey("k1", 500), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		return txn.Response{Status: 201, Header: http.Header{"Location": {"/charges/1"}, "X-Multi": {"a", "b"}}, Body: body}, nil
	})
	require.NoError(t, err)
	before := readKey(t, e.Pool, "acct_1", "k1")

	r2, qc := e.countingRunner(t, nil)
	var ran atomic.Bool
	again, err := r2.Run(ctx, chargeKey("k1", 500), func(context.Context, pgx.Tx) (txn.Response, error) {
		ran.Store(true)
		return txn.Response{Status: 500}, nil
	})
	require.NoError(t, err)
	require.False(t, ran.Load(), "no user code runs on replay")
	require.True(t, again.Replayed)
	require.Equal(t, first.Status, again.Status)
	require.Equal(t, body, again.Body)
	require.Equal(t, first.Header, again.Header)
	require.Equal(t, int64(1), qc.n.Load(), "a replay is one statement")
	require.Equal(t, before.Xmin, readKey(t, e.Pool, "acct_1", "k1").Xmin, "the row is not written")
	require.Equal(t, uint64(1), r2.Stats().Replayed)
}

// A single-phase Run of a new key whose function makes one statement costs
// the round trips of the hand-written keyed transaction, with the read of
// the key that answers a retry in one round trip besides: the read, BEGIN
// with the key insert and the function's statement, the response with
// COMMIT. That is in the exec mode, which prepares nothing on its own, and
// in cache_statement once the statement was prepared on the connection
// (TestFirstStatementPreparedByOneRunTravelsWithBeginInTheNext); otherwise
// BEGIN and the key insert go first, alone (one round trip more: see
// TestFirstStatementTravelsOnlyInModesThatPrepareNothing).
func TestRunRoundTrips(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, qc := e.countingRunnerIn(t, nil, pgx.QueryExecModeExec)
	var calls atomic.Int64
	roundTrips := func(run func()) int64 {
		before := qc.n.Load()
		run()
		return qc.n.Load() - before
	}

	require.Equal(t, int64(3), roundTrips(func() {
		resp, err := r.Run(ctx, chargeKey("k1", 500), insertCharge(&calls, "c1", 500))
		require.NoError(t, err)
		require.False(t, resp.Replayed)
	}), "first attempt: the read, BEGIN with the key insert and the function's insert, the response with COMMIT")
	require.Equal(t, int64(1), roundTrips(func() {
		resp, err := r.Run(ctx, chargeKey("k1", 500), insertCharge(&calls, "c1", 500))
		require.NoError(t, err)
		require.True(t, resp.Replayed)
	}), "replay")
	require.Equal(t, int64(1), roundTrips(func() {
		_, err := r.Run(ctx, chargeKey("k1", 999), insertCharge(&calls, "c1", 999))
		require.ErrorIs(t, err, txn.ErrKeyReused)
	}), "another request under the key")
	require.Equal(t, int64(1), calls.Load())
}

// Run makes its transaction SERIALIZABLE without leaving the setting on
// the pooled connection (PgBouncer in transaction mode hands it to anyone).
func TestRunLeavesNoIsolationLevelOnTheConnection(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	pool := e.NewPool(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	r, err := txn.New(pool, nil)
	require.NoError(t, err)
	var inside string
	_, err = r.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		return txn.Response{Status: 201}, tx.QueryRow(ctx, `SHOW transaction_isolation`).Scan(&inside)
	})
	require.NoError(t, err)
	require.Equal(t, "serializable", inside)
	_, err = r.Run(ctx, chargeKey("k1", 1), func(context.Context, pgx.Tx) (txn.Response, error) {
		return txn.Response{}, errors.New("a replay runs nothing")
	})
	require.NoError(t, err)

	// The same (only) connection: outside a transaction, and in the next one.
	var after, next string
	require.NoError(t, pool.QueryRow(ctx, `SHOW transaction_isolation`).Scan(&after))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, `SHOW transaction_isolation`).Scan(&next)
	}))
	require.Equal(t, "read committed", after)
	require.Equal(t, "read committed", next)
}

// A key stored again after its tombstone was left (under
// ExpiredKeyNewOperation) is answered from its row by a runner that rejects
// expired keys: the stored operation wins over the tombstone.
func TestStoredKeyWinsOverItsTombstone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64
	first, err := e.runner.Run(ctx, chargeKey("k1", 5), insertCharge(&calls, "c1", 5))
	require.NoError(t, err)
	_, err = e.Pool.Exec(ctx, `
		INSERT INTO idempotency_key_tombstones (scope, key_hash, fingerprint, finished_at, response_status, expires_at)
		SELECT scope, sha256(convert_to(key, 'UTF8')), fingerprint, finished_at, response_status, now() + interval '1 day'
		FROM idempotency_keys`)
	require.NoError(t, err)

	resp, err := e.runner.Run(ctx, chargeKey("k1", 5), insertCharge(&calls, "c1", 5))
	require.NoError(t, err)
	require.True(t, resp.Replayed)
	require.Equal(t, first.Body, resp.Body)
	_, err = e.runner.Run(ctx, chargeKey("k1", 6), insertCharge(&calls, "c1", 6))
	require.ErrorIs(t, err, txn.ErrKeyReused)
	require.Equal(t, int64(1), calls.Load())
	require.Zero(t, e.runner.Stats().ExpiredRejected)
}

func TestSameKeyWithAnotherRequestIsKeyReused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64
	_, err := e.runner.Run(ctx, chargeKey("k1", 500), insertCharge(&calls, "c1", 500))
	require.NoError(t, err)
	before := readKey(t, e.Pool, "acct_1", "k1")

	for name, k := range map[string]txn.Key{
		"amount": chargeKey("k1", 999),
		"method": func() txn.Key { k := chargeKey("k1", 500); k.Method = "PUT"; return k }(),
		"path":   func() txn.Key { k := chargeKey("k1", 500); k.Path = "/refunds"; return k }(),
	} {
		_, err := e.runner.Run(ctx, k, insertCharge(&calls, "c2", 999))
		require.ErrorIs(t, err, txn.ErrKeyReused, name)
		require.Equal(t, http.StatusUnprocessableEntity, txn.HTTPStatus(err))
		var kse *txn.KeyStateError
		require.ErrorAs(t, err, &kse)
		require.Equal(t, txn.KeyFinished, kse.Status)
	}
	require.Equal(t, int64(1), calls.Load(), "nothing ran")
	require.Equal(t, before.Xmin, readKey(t, e.Pool, "acct_1", "k1").Xmin, "row unchanged")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))
}

// holdLock is a function's first statement that waits for whoever holds
// the same lock: a twin that ran it behind the holder would wait.
const holdLock = `SELECT pg_advisory_xact_lock(4242)`

func TestConcurrentAttemptGetsKeyInUseAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	entered, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int64
	done := make(chan error, 1)
	go func() {
		_, err := e.runner.Run(ctx, chargeKey("k1", 500), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			calls.Add(1)
			if _, err := tx.Exec(ctx, holdLock); err != nil { // takes the key too
				return txn.Response{}, err
			}
			close(entered)
			<-release // holds the transaction (and the key) open
			return insertCharge(&atomic.Int64{}, "c1", 500)(ctx, tx)
		})
		done <- err
	}()
	<-entered

	// The holder's insert is uncommitted: the second caller must not wait
	// on the unique index, nor run its first statement behind the holder's
	// lock, but answer ErrKeyInUse while the holder still holds.
	twinCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err := e.runner.Run(twinCtx, chargeKey("k1", 500), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		calls.Add(1)
		if _, err := tx.Exec(ctx, holdLock); err != nil {
			return txn.Response{}, err
		}
		return insertCharge(&atomic.Int64{}, "c2", 500)(ctx, tx)
	})
	require.ErrorIs(t, err, txn.ErrKeyInUse)
	require.Equal(t, http.StatusConflict, txn.HTTPStatus(err))
	var kse *txn.KeyStateError
	require.ErrorAs(t, err, &kse)
	require.GreaterOrEqual(t, kse.RetryAfter, time.Second)
	require.Equal(t, txn.KeyRunning, kse.Status)
	require.Equal(t, txn.RecoveryPointStarted, kse.RecoveryPoint)

	close(release)
	require.NoError(t, <-done)
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'c1'`))
}

// The key is taken by the transaction of the function's first statement,
// which carries its lock: a twin that comes before it runs and commits.
// The first caller's lookup came before the twin's commit, so its function
// runs on (the lock is free by then), and its key's insert, at the end,
// meets the twin's row: its writes are rolled back and it answers with the
// twin's stored response. The operation happens once.
func TestKeyIsTakenWithTheFunctionsFirstStatement(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	entered, release := make(chan struct{}), make(chan struct{})
	releaseFirst := sync.OnceFunc(func() { close(release) })
	t.Cleanup(releaseFirst) // on a failed assertion too: the pool's Close waits for the first call
	var calls, firstRan atomic.Int64
	type result struct {
		resp txn.Response
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := e.runner.Run(ctx, chargeKey("k1", 500), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if calls.Add(1) == 1 {
				close(entered)
				<-release // no statement yet: nothing taken
			}
			return insertCharge(&firstRan, "first", 500)(ctx, tx)
		})
		done <- result{resp, err}
	}()
	<-entered
	twin, err := e.runner.Run(ctx, chargeKey("k1", 500), insertCharge(&calls, "twin", 500))
	require.NoError(t, err)
	require.False(t, twin.Replayed)
	releaseFirst()
	first := <-done
	require.NoError(t, first.err)
	require.True(t, first.resp.Replayed, "the first caller's key insert lost to the committed twin")
	require.Equal(t, int64(1), firstRan.Load(), "the first caller's function ran, in a transaction rolled back")
	require.Equal(t, twin.Body, first.resp.Body)
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'twin'`))
}

func TestWaitModeBlocksUntilHolderFinishesThenReplays(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{WaitWhenInUse: true, WaitPollInterval: 5 * time.Millisecond})
	ctx := ctxT(t)
	entered, release := make(chan struct{}), make(chan struct{})
	releaseHolder := sync.OnceFunc(func() { close(release) })
	t.Cleanup(releaseHolder)
	var calls atomic.Int64
	type result struct {
		resp txn.Response
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := e.runner.Run(ctx, chargeKey("k1", 500), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if err := takeKey(ctx, tx); err != nil {
				return txn.Response{}, err
			}
			close(entered)
			<-release
			return insertCharge(&calls, "c1", 500)(ctx, tx)
		})
		done <- result{resp, err}
	}()
	<-entered
	waiter := make(chan result, 1)
	var waiterCalls atomic.Int64
	go func() {
		resp, err := e.runner.Run(ctx, chargeKey("k1", 500), insertCharge(&waiterCalls, "c2", 500))
		waiter <- result{resp, err}
	}()
	// Release the holder only once the waiter is waiting: its lookup saw no
	// committed key, its function ran up to its first statement, whose key
	// insert lost to the holder's, and it slept.
	require.Eventually(t, func() bool { return e.runner.Stats().Waited == 1 }, 10*time.Second, time.Millisecond)
	select {
	case <-waiter:
		t.Fatal("waiter returned while the holder still runs")
	case <-time.After(20 * time.Millisecond): // a few more polls
	}
	releaseHolder()
	first, second := <-done, <-waiter
	require.NoError(t, first.err)
	require.NoError(t, second.err)
	require.True(t, second.resp.Replayed)
	require.Equal(t, first.resp.Body, second.resp.Body)
	require.Equal(t, int64(1), calls.Load())
	// The waiter's function ran once, and lost the key; from then on the
	// waiter only waited, unless the holder committed between one of its
	// polls' lookups and its take of the key: then its function ran once
	// more, in a transaction rolled back (the charge count below).
	require.LessOrEqual(t, waiterCalls.Load(), int64(2))
	require.Positive(t, waiterCalls.Load())
	require.Equal(t, uint64(1), e.runner.Stats().Waited, "counted once per call, however many polls")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))

	// Waiting is bounded by ctx. The holder's function has made its first
	// statement, so its insert (and the key's advisory lock) is in place
	// before the waiter starts.
	entered2, blocker := make(chan struct{}), make(chan struct{})
	unblock := sync.OnceFunc(func() { close(blocker) })
	t.Cleanup(unblock) // on a failed assertion too: the pool's Close waits for the holder
	held := make(chan result, 1)
	go func() {
		resp, err := e.runner.Run(ctx, chargeKey("k2", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if err := takeKey(ctx, tx); err != nil {
				return txn.Response{}, err
			}
			close(entered2)
			<-blocker
			return txn.Response{Status: 204}, nil
		})
		held <- result{resp, err}
	}()
	<-entered2
	short, cancel := context.WithCancel(ctx)
	defer cancel()
	bounded := make(chan error, 1)
	var boundedCalls atomic.Int64
	go func() {
		_, err := e.runner.Run(short, chargeKey("k2", 1), insertCharge(&boundedCalls, "c3", 1))
		bounded <- err
	}()
	require.Eventually(t, func() bool { return e.runner.Stats().Waited == 2 }, 10*time.Second, time.Millisecond)
	cancel()
	require.ErrorIs(t, <-bounded, context.Canceled)
	require.Equal(t, int64(1), boundedCalls.Load(), "the waiter's function ran once, and lost the key")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`), "the waiter wrote nothing")
	unblock()
	h := <-held
	require.NoError(t, h.err)
	require.Equal(t, 204, h.resp.Status)
}

func TestRealSerializationConflictsConvergeExactly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{MaxRetries: 50, RetryBaseDelay: time.Millisecond})
	ctx := ctxT(t)
	_, err := e.Pool.Exec(ctx, `CREATE TABLE counter (n int NOT NULL); INSERT INTO counter VALUES (0)`)
	require.NoError(t, err)
	const workers, perWorker = 8, 10
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWorker {
				_, err := e.runner.Run(ctx, chargeKey(strings.Repeat("w", w+1)+"-"+string(rune('a'+i)), 1),
					func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
						var n int
						if err := tx.QueryRow(ctx, `SELECT n FROM counter`).Scan(&n); err != nil {
							return txn.Response{}, err
						}
						if _, err := tx.Exec(ctx, `UPDATE counter SET n = $1`, n+1); err != nil {
							return txn.Response{}, err
						}
						return txn.Response{Status: 200}, nil
					})
				require.NoError(t, err)
			}
		}()
	}
	wg.Wait()
	require.Equal(t, workers*perWorker, e.Count(t, `SELECT n FROM counter`), "no lost update")
	require.Equal(t, workers*perWorker, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'finished'`))
	t.Logf("serialization retries: %d", e.runner.Stats().Retries)
}

// A call whose lookup came before a twin's commit, and whose function then
// fails on what the twin committed (here a unique business row) or
// answers with a rejection that is not stored, answers as a retry would:
// the twin's stored response, not its function's error. The operation
// happens once.
func TestCallThatLostToACommittedTwinReplaysWhateverItsFunctionReturned(t *testing.T) {
	t.Parallel()
	for _, outcome := range []string{"error", "rejection"} {
		t.Run(outcome, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			_, err := e.Pool.Exec(ctx, `CREATE TABLE orders (ref text PRIMARY KEY)`)
			require.NoError(t, err)
			body := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				_, err := tx.Exec(ctx, `INSERT INTO orders (ref) VALUES ('o1')`)
				switch {
				case err == nil:
					return txn.JSON(201, "o1")
				case outcome == "rejection":
					return txn.JSON(422, "order exists") // a rejection is not stored by default
				default:
					return txn.Response{}, err
				}
			}
			entered, release := make(chan struct{}), make(chan struct{})
			releaseFirst := sync.OnceFunc(func() { close(release) })
			t.Cleanup(releaseFirst) // on a failed assertion too: the pool's Close waits for the first call
			done := make(chan error, 1)
			var first txn.Response
			go func() {
				var err error
				first, err = e.runner.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
					close(entered)
					<-release // before its first statement: it holds nothing yet
					return body(ctx, tx)
				})
				done <- err
			}()
			<-entered
			twin, err := e.runner.Run(ctx, chargeKey("k1", 1), body)
			require.NoError(t, err)
			require.Equal(t, 201, twin.Status)
			releaseFirst()
			require.NoError(t, <-done)
			require.True(t, first.Replayed, "the twin's response, replayed")
			require.Equal(t, twin.Body, first.Body)
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM orders`))
		})
	}
}

// A single-phase run's key row is written only with the response, after
// the function: a function that writes the key table (here, every row of
// it, and the row its key would have) cannot reach it, and the run stores
// the key once with what the function returned.
func TestFunctionWritingTheKeyTableCannotReachItsKeyRow(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64
	_, err := e.runner.Run(ctx, chargeKey("k0", 1), insertCharge(&calls, "c0", 1))
	require.NoError(t, err)
	resp, err := e.runner.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('x', 1)`); err != nil {
			return txn.Response{}, err
		}
		if _, err := tx.Exec(ctx, `UPDATE idempotency_keys SET request_path = request_path`); err != nil {
			return txn.Response{}, err
		}
		if _, err := tx.Exec(ctx, `DELETE FROM idempotency_keys WHERE key = 'k1'`); err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(201, "k1")
	})
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'x'`))
	k := readKey(t, e.Pool, "acct_1", "k1")
	require.Equal(t, "finished", k.Status)
	require.Equal(t, `"k1"`, string(k.RespBody))
	again, err := e.runner.Run(ctx, chargeKey("k1", 1), insertCharge(&calls, "c1", 1))
	require.NoError(t, err)
	require.True(t, again.Replayed)
	require.Equal(t, int64(1), calls.Load())
}

func TestFiftyGoroutinesOnOneNewKeyRunItOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64
	var executed, replayed, inUse atomic.Int64
	var bodies sync.Map
	start := make(chan struct{})
	answered := make(chan struct{}, 50) // one per call that returned
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			resp, err := e.runner.Run(ctx, chargeKey("k1", 700), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				// Take the key and hold it until the 49 other calls have had
				// their answer.
				if err := takeKey(ctx, tx); err != nil {
					return txn.Response{}, err
				}
				for range 49 {
					select {
					case <-answered:
					case <-ctx.Done():
						return txn.Response{}, ctx.Err()
					}
				}
				return insertCharge(&calls, "c1", 700)(ctx, tx)
			})
			defer func() { answered <- struct{}{} }()
			switch {
			case err == nil && resp.Replayed:
				replayed.Add(1)
				bodies.Store(string(resp.Body), true)
			case err == nil:
				executed.Add(1)
				bodies.Store(string(resp.Body), true)
			case errors.Is(err, txn.ErrKeyInUse):
				inUse.Add(1)
			default:
				t.Errorf("unexpected result: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	require.Equal(t, int64(1), calls.Load(), "fn ran exactly once")
	require.Equal(t, int64(1), executed.Load())
	require.Equal(t, int64(49), inUse.Load(), "every other call found the key in use")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))
	n := 0
	bodies.Range(func(any, any) bool { n++; return true })
	require.Equal(t, 1, n, "every caller that got a response got the same one")
	t.Logf("executed=%d replayed=%d in_use=%d", executed.Load(), replayed.Load(), inUse.Load())
}

func TestAmbiguousCommitRetryReplaysNotReexecutes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	proxy, pool := e.NewProxy(t)
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)

	var calls atomic.Int64
	proxy.CutAfterNextCommit()
	_, err = r.Run(ctx, chargeKey("k1", 900), insertCharge(&calls, "c1", 900))
	require.Error(t, err, "the caller sees the commit fail")
	<-proxy.CommitCut()
	require.Equal(t, "finished", readKey(t, e.Pool, "acct_1", "k1").Status, "but it committed on the server")

	resp, err := r.Run(ctx, chargeKey("k1", 900), insertCharge(&calls, "c1", 900))
	require.NoError(t, err)
	require.True(t, resp.Replayed, "the retry replays")
	require.Equal(t, int64(1), calls.Load())
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))

	// The same for a workflow's final phase.
	f := newRideFlow(t, e.reg, "ride")
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "in_p3" {
			proxy.CutAfterNextCommit()
		}
	}
	_, err = r.RunWorkflow(ctx, rideKey("w1"), f.wf)
	require.Error(t, err)
	<-proxy.CommitCut()
	f.hook = nil
	resp, err = r.RunWorkflow(ctx, rideKey("w1"), f.wf)
	require.NoError(t, err)
	require.True(t, resp.Replayed)
	require.Equal(t, int64(1), f.p3.Load())
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%'`))
}

func TestTerminatedBackendMidPhaseIsTransient(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64
	var pid int32
	_, err := e.runner.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		calls.Add(1)
		if err := tx.QueryRow(ctx, `INSERT INTO charges (ref, amount) VALUES ('x', 1) RETURNING pg_backend_pid()`).Scan(&pid); err != nil {
			return txn.Response{}, err
		}
		_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
		return txn.Response{Status: 201}, err
	})
	require.Error(t, err)
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM charges`))
	// The client sees the FATAL before the backend has aborted its
	// transaction: until it exits it still holds the key's advisory lock, and
	// a retry in that window is rightly answered ErrKeyInUse (its insert is
	// in flight). Retry once the backend is gone.
	require.Eventually(t, func() bool {
		return e.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid) == 0
	}, 10*time.Second, 5*time.Millisecond)
	resp, err := e.runner.Run(ctx, chargeKey("k1", 1), insertCharge(&calls, "c", 1))
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(2), calls.Load())
}

// The same scope and key in another schema (another installation in the
// same database) is a different operation, never "in use".
func TestSameKeyInAnotherSchemaIsIndependent(t *testing.T) {
	t.Parallel()
	a, b := newEnv(t, nil), newEnv(t, nil)
	ctx := ctxT(t)
	entered, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := a.runner.Run(ctx, chargeKey("shared", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if err := takeKey(ctx, tx); err != nil {
				return txn.Response{}, err
			}
			close(entered)
			<-release
			return txn.Response{Status: 201}, nil
		})
		done <- err
	}()
	<-entered
	var calls atomic.Int64
	resp, err := b.runner.Run(ctx, chargeKey("shared", 1), insertCharge(&calls, "c", 1))
	require.NoError(t, err, "not blocked by the other schema's in-flight key")
	require.Equal(t, 201, resp.Status)
	f := newRideFlow(t, b.reg, "ride")
	_, err = b.runner.RunWorkflow(ctx, txn.Key{Scope: "acct_1", Value: "shared", Method: "POST", Path: "/rides", Params: []byte(`{"amount": 1}`)}, f.wf)
	require.ErrorIs(t, err, txn.ErrKeyReused, "same schema, other request: reuse, decided by the row")
	close(release)
	require.NoError(t, <-done)
}

// A replay writes nothing: the lookup that answers it draws a new key's id
// only for a missing key. So a retry of a finished key is answered by a
// server that takes no writes (a standby, a primary demoted in a failover),
// while a new key there is ErrUnavailable.
func TestReplayIsAnsweredByAServerThatTakesNoWrites(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64
	first, err := e.runner.Run(ctx, chargeKey("k1", 5), insertCharge(&calls, "c1", 5))
	require.NoError(t, err)

	readOnly := e.NewPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	})
	r, err := txn.New(readOnly, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	again, err := r.Run(ctx, chargeKey("k1", 5), insertCharge(&calls, "c1", 5))
	require.NoError(t, err)
	require.True(t, again.Replayed)
	require.Equal(t, first.Body, again.Body)
	_, err = r.Run(ctx, chargeKey("k2", 5), insertCharge(&calls, "c2", 5))
	require.ErrorIs(t, err, txn.ErrUnavailable)
	require.Equal(t, int64(1), calls.Load())
}

// A database that cannot be reached, or that takes no writes (a demoted
// primary or a standby during a failover: SQLSTATE 25006), is
// ErrUnavailable, answered 503 by HTTPStatus: the client retries with the
// same key, and the retry once the database is back runs the operation once.
func TestDatabaseUnavailableIsErrUnavailableAnd503(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64

	readOnly := e.NewPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	})
	r, err := txn.New(readOnly, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	_, err = r.Run(ctx, chargeKey("k1", 5), insertCharge(&calls, "c1", 5))
	require.ErrorIs(t, err, txn.ErrUnavailable)
	require.Equal(t, http.StatusServiceUnavailable, txn.HTTPStatus(err))
	f := newRideFlow(t, e.reg, "ride")
	_, err = r.RunWorkflow(ctx, rideKey("w1"), f.wf)
	require.ErrorIs(t, err, txn.ErrUnavailable)

	proxy, pool := e.NewProxy(t)
	r, err = txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	proxy.Unreachable()
	_, err = r.Run(ctx, chargeKey("k1", 5), insertCharge(&calls, "c1", 5))
	require.ErrorIs(t, err, txn.ErrUnavailable)
	require.Equal(t, http.StatusServiceUnavailable, txn.HTTPStatus(err))
	_, err = r.RunWorkflow(ctx, rideKey("w1"), f.wf)
	require.ErrorIs(t, err, txn.ErrUnavailable)
	_, err = r.Resume(ctx, "acct_1", "k1")
	require.ErrorIs(t, err, txn.ErrUnavailable)
	require.Zero(t, calls.Load(), "nothing ran without a database")

	proxy.Reachable()
	resp, err := r.Run(ctx, chargeKey("k1", 5), insertCharge(&calls, "c1", 5))
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), calls.Load())
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))

	// Not every error is an outage: a handler's own failure stays a 500.
	_, err = r.Run(ctx, chargeKey("k2", 5), func(context.Context, pgx.Tx) (txn.Response, error) {
		return txn.Response{}, errors.New("handler bug")
	})
	require.NotErrorIs(t, err, txn.ErrUnavailable)
	require.Equal(t, http.StatusInternalServerError, txn.HTTPStatus(err))
}

// The id a key gets is allotted by the lookup's nextval, which no commit
// waits for: after a failover the new primary's sequence can hand out an
// id that a key inserted since already took. That insert's unique
// violation on the id is an outage to retry (503), not a failure (500);
// the retry's lookup allots another id. The sequence is set back here, as
// a failover would leave it.
func TestKeyIDTakenAfterAFailoverIsUnavailable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var calls atomic.Int64
	_, err := e.runner.Run(ctx, chargeKey("k1", 1), insertCharge(&calls, "c1", 1))
	require.NoError(t, err)
	setBack := func() {
		_, err := e.Pool.Exec(ctx, `SELECT setval('idempotency_keys_id_seq', (SELECT max(id) FROM idempotency_keys), false)`)
		require.NoError(t, err)
	}

	setBack()
	_, err = e.runner.Run(ctx, chargeKey("k2", 1), insertCharge(&calls, "c2", 1))
	require.ErrorIs(t, err, txn.ErrUnavailable)
	require.Equal(t, http.StatusServiceUnavailable, txn.HTTPStatus(err))
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'c2'`))
	resp, err := e.runner.Run(ctx, chargeKey("k2", 1), insertCharge(&calls, "c2", 1))
	require.NoError(t, err, "the retry")
	require.Equal(t, 201, resp.Status)

	f := newRideFlow(t, e.reg, "ride")
	setBack()
	_, err = e.runner.RunWorkflow(ctx, rideKey("w1"), f.wf)
	require.ErrorIs(t, err, txn.ErrUnavailable, "a workflow's first phase")
	resp, err = e.runner.RunWorkflow(ctx, rideKey("w1"), f.wf)
	require.NoError(t, err, "the retry")
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), f.prov.calls.Load())
}

// A Run that stores nothing (its function failed, or answered with a
// response Config.Store does not store) must still find out whether a
// twin stored the key meanwhile, or whether the function committed its
// transaction itself (see KeyOutcome). That read goes out with the
// ROLLBACK, on the run's own connection, without preparing or describing
// anything (in an aborted transaction the server would parse nothing but
// ROLLBACK): in every exec mode such a Run costs no more round trips than
// a Run that stores its response, and leaves nothing behind. A function
// whose statement failed costs, in the modes with a statement cache, what
// pgx adds after a failed statement: preparing it again next time (3
// round trips in cache_statement, which also deallocates it, and 1 in
// cache_describe).
func TestRunThatStoresNothingReadsTheOutcomeWithItsRollback(t *testing.T) {
	t.Parallel()
	const insert = `INSERT INTO charges (ref, amount) VALUES ($1, 1)`
	kinds := []struct {
		name string
		fn   txn.Func
	}{
		{"stored", func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			_, err := tx.Exec(ctx, insert, "c")
			return txn.Response{Status: 201}, err
		}},
		{"unstored_response", func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			_, err := tx.Exec(ctx, insert, "c")
			return txn.Response{Status: 422, Body: []byte(`{"error":"amount"}`)}, err
		}},
		{"function_error", func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, insert, "c"); err != nil {
				return txn.Response{}, err
			}
			return txn.Response{}, errors.New("provider said no")
		}},
		{"failed_statement", func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			_, err := tx.Exec(ctx, insert, nil) // ref is NOT NULL
			return txn.Response{}, err
		}},
	}
	reprepare := map[pgx.QueryExecMode]int64{pgx.QueryExecModeCacheStatement: 3, pgx.QueryExecModeCacheDescribe: 1}
	for _, mode := range allExecModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			r, writes, settledOnThePool := e.wireRunner(t, mode)
			cost := map[string]int64{}
			for i, k := range kinds {
				// The third run of each kind, once pgx caches what it
				// caches on the connection.
				for n := range 3 {
					before := writes.Load()
					resp, err := r.Run(ctx, chargeKey(fmt.Sprintf("k%d-%d", i, n), 1), k.fn)
					cost[k.name] = writes.Load() - before
					switch k.name {
					case "stored":
						require.NoError(t, err)
						require.Equal(t, 201, resp.Status)
					case "unstored_response":
						require.NoError(t, err)
						require.Equal(t, 422, resp.Status)
						require.False(t, resp.Replayed)
					case "function_error":
						require.ErrorContains(t, err, "provider said no")
					case "failed_statement":
						require.Equal(t, "23502", pgerr.Code(err), "%v", err)
					}
				}
			}
			t.Logf("round trips: %v", cost)
			require.LessOrEqual(t, cost["unstored_response"], cost["stored"])
			require.LessOrEqual(t, cost["function_error"], cost["stored"])
			require.LessOrEqual(t, cost["failed_statement"], cost["stored"]+reprepare[mode])
			require.Zero(t, settledOnThePool.Load(), "every outcome was read with its run's ROLLBACK")
			require.Equal(t, 3, e.Count(t, `SELECT count(*) FROM charges`), "the stored runs' rows only")
			require.Equal(t, 3, e.Count(t, `SELECT count(*) FROM idempotency_keys`), "the stored runs' keys only")

			// The connection went back to the pool idle: the next Run on a
			// key that stored nothing runs it as new.
			var calls atomic.Int64
			resp, err := r.Run(ctx, chargeKey("k1-0", 1), insertCharge(&calls, "c2", 1))
			require.NoError(t, err)
			require.Equal(t, 201, resp.Status)
			require.Equal(t, int64(1), calls.Load())
		})
	}
}
