package txn_test

// One test per behaviour rule of the design ("txn: semantics", rules 1-10),
// named after the rule it proves, against real PostgreSQL.

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

func TestRule1_NewKeyRunsOnceAndStoresResponseWithWrites(t *testing.T) {
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

func TestRule1_FailedBodyStoresNothing(t *testing.T) {
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

func TestRule2_FinishedKeyReplaysByteForByteInOneRoundTrip(t *testing.T) {
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

func TestRule3_SameKeyDifferentFingerprintIsKeyReused(t *testing.T) {
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
		require.Equal(t, "finished", kse.Status)
	}
	require.Equal(t, int64(1), calls.Load(), "nothing ran")
	require.Equal(t, before.Xmin, readKey(t, e.Pool, "acct_1", "k1").Xmin, "row unchanged")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))
}

func TestRule3_KeyUsedByAnotherWorkflowIsKeyReused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	var calls atomic.Int64
	_, err := e.runner.Run(ctx, rideKey("k1"), insertCharge(&calls, "c1", 1))
	require.NoError(t, err)
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, txn.ErrKeyReused)
	require.Equal(t, int64(0), f.p1.Load())
}

func TestRule4_ConcurrentAttemptGetsKeyInUseAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	entered, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int64
	done := make(chan error, 1)
	go func() {
		_, err := e.runner.Run(ctx, chargeKey("k1", 500), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			calls.Add(1)
			close(entered)
			<-release // holds the transaction (and the key) open
			return insertCharge(&atomic.Int64{}, "c1", 500)(ctx, tx)
		})
		done <- err
	}()
	<-entered

	// The holder's insert is uncommitted: the second caller must not wait
	// on the unique index but answer ErrKeyInUse while the holder still holds.
	_, err := e.runner.Run(ctx, chargeKey("k1", 500), insertCharge(&calls, "c2", 500))
	require.ErrorIs(t, err, txn.ErrKeyInUse)
	require.Equal(t, http.StatusConflict, txn.HTTPStatus(err))
	var kse *txn.KeyStateError
	require.ErrorAs(t, err, &kse)
	require.GreaterOrEqual(t, kse.RetryAfter, time.Second)

	close(release)
	require.NoError(t, <-done)
	require.Equal(t, int64(1), calls.Load())
}

func TestRule4_WorkflowLeaseHeldGivesKeyInUse(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{LeaseDuration: time.Minute})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	entered, release := make(chan struct{}), make(chan struct{})
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "after_p1" {
			close(entered)
			<-release
		}
	}
	done := make(chan error, 1)
	go func() { _, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf); done <- err }()
	<-entered

	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, txn.ErrKeyInUse)
	var kse *txn.KeyStateError
	require.ErrorAs(t, err, &kse)
	require.Equal(t, "ride_created", kse.RecoveryPoint)
	require.Greater(t, kse.RetryAfter, 30*time.Second, "Retry-After follows the holder's lease")

	f.hook = nil
	close(release)
	require.NoError(t, <-done)
}

func TestRule4_WaitModeBlocksUntilHolderFinishesThenReplays(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{WaitWhenInUse: true, WaitPollInterval: 5 * time.Millisecond})
	ctx := ctxT(t)
	entered, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int64
	type result struct {
		resp txn.Response
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := e.runner.Run(ctx, chargeKey("k1", 500), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			close(entered)
			<-release
			return insertCharge(&calls, "c1", 500)(ctx, tx)
		})
		done <- result{resp, err}
	}()
	<-entered
	waiter := make(chan result, 1)
	go func() {
		resp, err := e.runner.Run(ctx, chargeKey("k1", 500), insertCharge(&calls, "c2", 500))
		waiter <- result{resp, err}
	}()
	select {
	case <-waiter:
		t.Fatal("waiter returned while the holder still runs")
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	first, second := <-done, <-waiter
	require.NoError(t, first.err)
	require.NoError(t, second.err)
	require.True(t, second.resp.Replayed)
	require.Equal(t, first.resp.Body, second.resp.Body)
	require.Equal(t, int64(1), calls.Load())

	// Waiting is bounded by ctx. The holder is inside its function, so its
	// insert (and the key's advisory lock) is in place before the waiter
	// starts; the waiter's deadline starts then too.
	entered2, blocker := make(chan struct{}), make(chan struct{})
	held := make(chan result, 1)
	go func() {
		resp, err := e.runner.Run(ctx, chargeKey("k2", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			close(entered2)
			<-blocker
			return txn.Response{Status: 204}, nil
		})
		held <- result{resp, err}
	}()
	<-entered2
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	_, err := e.runner.Run(short, chargeKey("k2", 1), insertCharge(&calls, "c3", 1))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, int64(1), calls.Load(), "the waiter ran nothing")
	close(blocker)
	h := <-held
	require.NoError(t, h.err)
	require.Equal(t, 204, h.resp.Status)
}
func TestRule5_StaleHolderCannotCommitAfterTakeover(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{LeaseDuration: time.Minute})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	paused, resume := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	first.Store(true)
	f.hook = func(point string, a *txn.Attempt) {
		if point == "after_p2" && a.Number() == 1 && first.CompareAndSwap(true, false) {
			close(paused)
			<-resume
		}
	}
	stale := make(chan error, 1)
	go func() { _, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf); stale <- err }()
	<-paused

	// The holder's lease expires (by the database clock); a retry takes over
	// with a new token and finishes the operation.
	_, err := e.Pool.Exec(ctx, `UPDATE idempotency_keys SET leased_until = now() - interval '1 second'`)
	require.NoError(t, err)
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	k := readKey(t, e.Pool, "user_1", "k1")
	require.Equal(t, 2, k.Attempts)
	require.Equal(t, "finished", k.Status)

	// The stale holder wakes and tries to commit its final phase: fenced.
	close(resume)
	err = <-stale
	require.ErrorIs(t, err, txn.ErrLeaseLost)
	require.Equal(t, http.StatusConflict, txn.HTTPStatus(err))
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%' AND attempt = 1`), "stale holder's writes are absent")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%'`))
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'ride'`))
	require.Equal(t, 1, f.prov.distinct())
	require.Equal(t, k.Xmin, readKey(t, e.Pool, "user_1", "k1").Xmin, "the finished key was not touched by the stale holder")
}

func TestRule5_LeaseIsExtendedAtEachPhase(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{LeaseDuration: time.Hour})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	var untils []time.Time
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "after_p1" || point == "after_p2" {
			var u time.Time
			require.NoError(t, e.Pool.QueryRow(ctx, `SELECT leased_until FROM idempotency_keys`).Scan(&u))
			untils = append(untils, u)
		}
	}
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.Len(t, untils, 2)
	require.True(t, untils[1].After(untils[0]), "each phase extends the lease")
}

func TestRule5_ExpiredLeaseCanBeTakenOverLiveOneCannot(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{LeaseDuration: time.Hour})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("after_p1")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	// Simulate a crashed holder: a live lease nobody will release.
	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET lease_token = gen_random_uuid(), leased_until = now() + interval '1 hour'`)
	require.NoError(t, err)
	f.failAt.Store("")
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, txn.ErrKeyInUse)

	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET leased_until = now() - interval '1 millisecond'`)
	require.NoError(t, err)
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), f.p1.Load())
}

func TestRule6_SerializationFailureRetriesOnlyTheFailingPhase(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{RetryBaseDelay: time.Millisecond})
	ctx := ctxT(t)
	var p1, p2 atomic.Int64
	wf := txn.NewWorkflow("retrying", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "one", func(ctx context.Context, tx pgx.Tx) (int, error) {
			p1.Add(1)
			_, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('one', 1)`)
			return 1, err
		}); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			n := p2.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('two', 1)`); err != nil {
				return txn.Response{}, err
			}
			code := map[int64]string{1: "40001", 2: "40P01"}[n]
			if code != "" {
				_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '`+code+`'; END $$`)
				return txn.Response{}, err
			}
			return txn.Response{Status: 201, Body: []byte("ok")}, nil
		})
	})
	require.NoError(t, e.reg.Register(wf))
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), p1.Load(), "the committed phase is not retried")
	require.Equal(t, int64(3), p2.Load(), "the failing phase ran until it committed")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'two'`), "rolled-back tries left nothing")
	require.Equal(t, uint64(2), e.runner.Stats().Retries)
}

func TestRule6_PersistentConflictIsErrConflictAtLastPoint(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{MaxRetries: 3, RetryBaseDelay: time.Millisecond})
	ctx := ctxT(t)
	var tries atomic.Int64
	wf := txn.NewWorkflow("conflicting", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "one", func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			tries.Add(1)
			_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END $$`)
			return txn.Response{}, err
		})
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, txn.ErrConflict)
	require.Equal(t, http.StatusConflict, txn.HTTPStatus(err))
	require.Equal(t, int64(4), tries.Load(), "one try plus MaxRetries retries")
	k := readKey(t, e.Pool, "user_1", "k1")
	require.Equal(t, "running", k.Status)
	require.Equal(t, "one", k.RecoveryPoint)
	require.False(t, k.LeaseHeld, "released for a later retry")
}

func TestRule6_RealSerializationConflictsConvergeExactly(t *testing.T) {
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

func TestRule7_TerminalResponsesAreStoredAndReplayed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.declined = true
	resp, err := e.runner.RunWorkflow(ctx, rideKey("declined"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 402, resp.Status)
	again, err := e.runner.RunWorkflow(ctx, rideKey("declined"), f.wf)
	require.NoError(t, err)
	require.True(t, again.Replayed)
	require.Equal(t, resp.Body, again.Body)
	require.Equal(t, int64(1), f.p1.Load())
	k := readKey(t, e.Pool, "user_1", "declined")
	require.Equal(t, "finished", k.Status)
	require.Equal(t, "ride_created", k.RecoveryPoint, "stored where the workflow stopped")

	// A 5xx the operation chooses to return is terminal too.
	var calls atomic.Int64
	r5, err := e.runner.Run(ctx, chargeKey("five", 1), func(context.Context, pgx.Tx) (txn.Response, error) {
		calls.Add(1)
		return txn.JSON(503, map[string]string{"error": "upstream unavailable"})
	})
	require.NoError(t, err)
	require.Equal(t, 503, r5.Status)
	r5b, err := e.runner.Run(ctx, chargeKey("five", 1), insertCharge(&calls, "c", 1))
	require.NoError(t, err)
	require.True(t, r5b.Replayed)
	require.Equal(t, 503, r5b.Status)
	require.Equal(t, int64(1), calls.Load())
}

func TestRule7_TransientErrorReleasesKeyAndRetryResumes(t *testing.T) {
	t.Parallel()
	for _, point := range []string{"after_p1", "foreign", "after_p2", "in_p3"} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			f := newRideFlow(t, e.reg, "ride")
			f.failAt.Store(point)
			_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
			require.ErrorIs(t, err, errInjected)
			k := readKey(t, e.Pool, "user_1", "k1")
			require.Equal(t, "running", k.Status)
			require.False(t, k.LeaseHeld, "released")
			wantPoint := map[string]string{"after_p1": "ride_created", "foreign": "ride_created", "after_p2": "charge_created", "in_p3": "charge_created"}[point]
			require.Equal(t, wantPoint, k.RecoveryPoint, "recovery point intact")
			require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%'`), "the failed phase rolled back")

			f.failAt.Store("")
			resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
			require.NoError(t, err)
			require.Equal(t, 201, resp.Status)
			require.Equal(t, int64(1), f.p1.Load(), "phase 1 ran once")
			require.Equal(t, 1, f.prov.distinct(), "one charge at the provider")
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'ride'`))
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref LIKE 'ch_%'`))
			require.Equal(t, 2, readKey(t, e.Pool, "user_1", "k1").Attempts)
		})
	}
}

func TestRule7_PanicIsTransient(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	_, err := e.runner.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('x', 1)`); err != nil {
			return txn.Response{}, err
		}
		panic("boom")
	})
	require.ErrorIs(t, err, txn.ErrPanicked)
	var pe *txn.PanicError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, "boom", pe.Value)
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM charges`))
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM idempotency_keys`))

	f := newRideFlow(t, e.reg, "ride")
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "after_p2" {
			panic("boom in workflow")
		}
	}
	_, err = e.runner.RunWorkflow(ctx, rideKey("k2"), f.wf)
	require.ErrorIs(t, err, txn.ErrPanicked)
	k := readKey(t, e.Pool, "user_1", "k2")
	require.Equal(t, "charge_created", k.RecoveryPoint)
	require.False(t, k.LeaseHeld)
	f.hook = nil
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k2"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
}

func TestRule7_CancelledContextStillReleasesKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	cctx, cancel := context.WithCancel(ctx)
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "after_p1" {
			cancel() // the client went away mid-operation
		}
	}
	_, err := e.runner.RunWorkflow(cctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, context.Canceled)
	k := readKey(t, e.Pool, "user_1", "k1")
	require.Equal(t, "ride_created", k.RecoveryPoint)
	require.False(t, k.LeaseHeld, "released on a fresh context")
	f.hook = nil
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, int64(1), f.p1.Load())
}

func TestRule8_ForeignPhaseGetsStableDerivedKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var keys []string
	var calls, afterRuns atomic.Int64
	fail := true
	wf := txn.NewWorkflow("foreign", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		ch, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (string, error) {
			calls.Add(1)
			keys = append(keys, fk)
			if fail {
				return "", errInjected // e.g. a timeout: did the provider charge? unknown
			}
			return "ch_" + fk[:8], nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		if _, err := txn.Atomic(ctx, a, "after", func(ctx context.Context, tx pgx.Tx) (int, error) {
			if afterRuns.Add(1) == 1 {
				return 0, errInjected // fail after the foreign result was committed
			}
			return 1, nil
		}); err != nil {
			return txn.Response{}, err
		}
		return txn.Response{Status: 201, Body: []byte(ch)}, nil
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, errInjected)
	fail = false
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, errInjected)
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, int64(2), calls.Load(), "not called again once its result committed")
	require.Equal(t, keys[0], keys[1], "the same derived key on every retry")
	require.True(t, strings.HasPrefix(keys[0], "ap_"))
	require.Equal(t, "ch_"+keys[0][:8], string(resp.Body))

	// A new operation under a reused key value (after expiry) derives a new key.
	_, err = e.Pool.Exec(ctx, `DELETE FROM idempotency_keys`)
	require.NoError(t, err)
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.NotEqual(t, keys[0], keys[2])
}

func TestRule9_TimesComeFromTheDatabaseClock(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	// Give this schema a database clock ten days ahead of the application's:
	// with pg_catalog after the schema in search_path, now() resolves here.
	_, err := e.Pool.Exec(ctx, `CREATE FUNCTION now() RETURNS timestamptz LANGUAGE sql STABLE
		AS $$ SELECT pg_catalog.now() + interval '10 days' $$`)
	require.NoError(t, err)
	pool := e.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["search_path"] = e.Schema + ", pg_catalog" })
	reg := txn.NewRegistry()
	r, err := txn.New(pool, &txn.Config{Workflows: reg, LeaseDuration: time.Hour})
	require.NoError(t, err)
	f := newRideFlow(t, reg, "ride")
	f.failAt.Store("after_p1")
	_, err = r.RunWorkflow(ctx, rideKey("wf"), f.wf)
	require.ErrorIs(t, err, errInjected)
	var calls atomic.Int64
	_, err = r.Run(ctx, chargeKey("single", 1), insertCharge(&calls, "c", 1))
	require.NoError(t, err)

	appNow := time.Now()
	rows, err := e.Pool.Query(ctx, `SELECT created_at, last_run_at, coalesce(finished_at, last_run_at) FROM idempotency_keys`)
	require.NoError(t, err)
	for rows.Next() {
		var ts [3]time.Time
		require.NoError(t, rows.Scan(&ts[0], &ts[1], &ts[2]))
		for _, tm := range ts {
			require.InDelta(t, (10 * 24 * time.Hour).Hours(), tm.Sub(appNow).Hours(), 1, "timestamp %v is not from the database clock", tm)
		}
	}
	require.NoError(t, rows.Err())

	// Leases are judged by the same clock: a lease set by the shifted clock
	// is live by it, although it ended long ago by the unshifted one.
	_, err = pool.Exec(ctx, `UPDATE idempotency_keys SET lease_token = gen_random_uuid(), leased_until = now() + interval '1 minute' WHERE key = 'wf'`)
	require.NoError(t, err)
	f.failAt.Store("")
	_, err = r.RunWorkflow(ctx, rideKey("wf"), f.wf)
	require.ErrorIs(t, err, txn.ErrKeyInUse)
}

func TestRule10_InvalidKeysAreRejectedBeforeAnySQL(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, qc := e.countingRunner(t, nil)
	var calls atomic.Int64
	for name, v := range map[string]string{
		"empty":         "",
		"256 bytes":     strings.Repeat("a", 256),
		"newline":       "abc\n",
		"tab":           "a\tb",
		"DEL":           "a\x7f",
		"non-ASCII":     "clé",
		"NUL":           "a\x00b",
		"bad scope":     "ok",
		"bad scope NUL": "ok",
	} {
		k := chargeKey(v, 1)
		switch name {
		case "bad scope":
			k.Scope = strings.Repeat("s", 256)
		case "bad scope NUL":
			k.Scope = "a\x00"
		}
		_, err := r.Run(ctx, k, insertCharge(&calls, "c", 1))
		require.ErrorIs(t, err, txn.ErrInvalidKey, name)
		require.Equal(t, http.StatusBadRequest, txn.HTTPStatus(err), name)
	}
	require.Equal(t, int64(0), qc.n.Load(), "no statement was sent")
	require.Equal(t, int64(0), calls.Load())
	require.NoError(t, txn.ValidateKey(strings.Repeat("a", 255)))
	require.NoError(t, txn.ValidateKey(" ~!valid key~ "))
	require.Equal(t, 0, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
}
