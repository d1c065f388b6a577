package txn_test

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

func TestStaleHolderCannotCommitAfterTakeover(t *testing.T) {
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

func TestLeaseIsExtendedAtEachCommitAndCheckedOnlyWhenOld(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{LeaseDuration: time.Hour})
	ctx := ctxT(t)
	leasedUntil := func() time.Time {
		var u time.Time
		require.NoError(t, e.Pool.QueryRow(ctx, `SELECT leased_until FROM idempotency_keys WHERE status = 'running'`).Scan(&u))
		return u
	}
	var untils []time.Time
	var fail atomic.Bool
	wf := txn.NewWorkflow("two_phases_and_a_call", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		for _, phase := range []string{"first", "second"} {
			if _, err := txn.Atomic(ctx, a, phase, func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
				return txn.Response{}, err
			}
			untils = append(untils, leasedUntil())
		}
		if fail.Load() {
			return txn.Response{}, errInjected
		}
		if _, err := txn.Foreign(ctx, a, "call", func(context.Context, string) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		untils = append(untils, leasedUntil())
		return txn.Response{Status: 201}, nil
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Len(t, untils, 3)
	require.True(t, untils[1].After(untils[0]), "each commit extends the lease")
	require.Equal(t, untils[1], untils[2], "the lease a commit just set is not checked again before a foreign call")

	// An attempt that took the key over checks it (and its age) before
	// calling out.
	fail.Store(true)
	_, err = e.runner.RunWorkflow(ctx, rideKey("k2"), wf)
	require.ErrorIs(t, err, errInjected)
	fail.Store(false)
	untils = nil
	_, err = e.runner.RunWorkflow(ctx, rideKey("k2"), wf)
	require.NoError(t, err)
	require.Len(t, untils, 3)
	require.Equal(t, untils[0], untils[1], "the stored phases did not run again")
	require.True(t, untils[2].After(untils[1]), "the lease was extended before the call")
}

func TestSerializationFailureRetriesOnlyTheFailingPhase(t *testing.T) {
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

func TestPersistentConflictIsErrConflictAtLastPoint(t *testing.T) {
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

func TestForeignPhaseGetsStableDerivedKey(t *testing.T) {
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

	// A new operation under a reused key value (after cleanup, which
	// leaves a tombstone) derives a new key.
	_, err = e.Pool.Exec(ctx, `
		WITH d AS (DELETE FROM idempotency_keys RETURNING scope, key, fingerprint, finished_at, response_status)
		INSERT INTO idempotency_key_tombstones (scope, key_hash, fingerprint, finished_at, response_status, expires_at)
		SELECT scope, sha256(convert_to(key, 'UTF8')), fingerprint, finished_at, response_status, now() FROM d`)
	require.NoError(t, err)
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.NotEqual(t, keys[0], keys[2])
}

// An operation whose key row was lost (a failover to an asynchronous
// standby that had not received the commit) is run again by the client's
// retry under a new row id, as the promoted server's sequence hands out:
// its foreign call must reach the provider under the same key as the lost
// one did, or the provider charges twice.
func TestForeignKeyIsTheSameAfterTheKeyRowIsLost(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var keys []string
	wf := txn.NewWorkflow("lost", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		ch, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (string, error) {
			keys = append(keys, fk)
			return "ch_" + fk[:8], nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		return txn.Response{Status: 201, Body: []byte(ch)}, nil
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)

	var before, after int64
	require.NoError(t, e.Pool.QueryRow(ctx, `DELETE FROM idempotency_keys RETURNING id`).Scan(&before))
	_, err = e.Pool.Exec(ctx, `SELECT setval(pg_get_serial_sequence('idempotency_keys', 'id'), nextval(pg_get_serial_sequence('idempotency_keys', 'id')) + 32)`)
	require.NoError(t, err)
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT id FROM idempotency_keys`).Scan(&after))
	require.NotEqual(t, before, after, "the retry's row has another id")
	require.Len(t, keys, 2, "the lost operation runs again")
	require.Equal(t, keys[0], keys[1], "under the foreign key the lost operation used")
}

// A key row written before migration 00010, or by an older binary during a
// rolling deploy, has no seed: its foreign keys are still derived from its
// id, as that binary derived them before it crashed.
func TestForeignKeyOfARowWithoutSeedIsDerivedFromItsID(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var keys []string
	fail := true
	wf := txn.NewWorkflow("legacy", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "first", func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return txn.Response{}, err
		}
		ch, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (string, error) {
			keys = append(keys, fk)
			if fail {
				return "", errInjected
			}
			return "ch_" + fk[:8], nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		return txn.Response{Status: 201, Body: []byte(ch)}, nil
	})
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, errInjected)
	var id int64
	require.NoError(t, e.Pool.QueryRow(ctx, `UPDATE idempotency_keys SET foreign_key_seed = NULL RETURNING id`).Scan(&id))
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, errInjected)
	fail = false
	_, err = e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Len(t, keys, 3)
	require.Equal(t, foreignKeyV1(id, "user_1", "k1", "legacy", "charge"), keys[1], "the key an older binary derived")
	require.Equal(t, keys[1], keys[2])
	require.NotEqual(t, keys[0], keys[1], "a seeded row derives another way")
}

// foreignKeyV1 is the derivation of releases before migration 00010, from
// the key row's id: pinned here, because rows in flight depend on it.
func foreignKeyV1(id int64, parts ...string) string {
	h := sha256.New()
	h.Write([]byte("atomicphase/foreign/v1\x00"))
	h.Write(binary.BigEndian.AppendUint64(nil, uint64(id)))
	for _, s := range parts {
		h.Write(binary.BigEndian.AppendUint64(nil, uint64(len(s))))
		h.Write([]byte(s))
	}
	return "ap_" + hex.EncodeToString(h.Sum(nil))
}

func TestPhaseMisuseIsReportedAndTransient(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	for name, body := range map[string]txn.WorkflowFunc{
		"repeated phase": func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
			if _, err := txn.Atomic(ctx, a, "p", func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
				return txn.Response{}, err
			}
			_, err := txn.Atomic(ctx, a, "p", func(context.Context, pgx.Tx) (int, error) { return 1, nil })
			return txn.Response{Status: 200}, err
		},
		"reserved name": func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
			_, err := txn.Atomic(ctx, a, "finished", func(context.Context, pgx.Tx) (int, error) { return 1, nil })
			return txn.Response{Status: 200}, err
		},
		"unencodable result": func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
			_, err := txn.Atomic(ctx, a, "p", func(context.Context, pgx.Tx) (chan int, error) { return make(chan int), nil })
			return txn.Response{Status: 200}, err
		},
	} {
		wf := txn.NewWorkflow(strings.ReplaceAll(name, " ", "_"), body)
		require.NoError(t, e.reg.Register(wf))
		_, err := e.runner.RunWorkflow(ctx, rideKey(wf.Name()), wf)
		require.ErrorIs(t, err, txn.ErrInvalidUse, name)
		require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = $1 AND lease_token IS NOT NULL`, wf.Name()),
			"%s: the key is not held (a misuse before the first commit leaves no key at all)", name)
	}
}

// A lease is extended from the time of the phase's commit, not from the
// start of its transaction: a phase that runs longer than the lease commits
// a lease that is still live, so no other attempt may take the key over.
func TestLeaseOutlivesAPhaseLongerThanTheLease(t *testing.T) {
	t.Parallel()
	const lease, phase = time.Second, 1200 * time.Millisecond
	e := newEnv(t, &txn.Config{LeaseDuration: lease})
	ctx := ctxT(t)
	var counted, remaining float64 // seconds
	var inUse error
	var wf *txn.Workflow
	wf = txn.NewWorkflow("slow_phase", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "slow", func(ctx context.Context, tx pgx.Tx) (int, error) {
			// The phase outlasts the lease (a slow query, a lock wait).
			_, err := tx.Exec(ctx, `SELECT pg_sleep($1)`, phase.Seconds())
			return 1, err
		}); err != nil {
			return txn.Response{}, err
		}
		// last_run_at is the phase transaction's start (now()); the lease
		// must count from after the phase's work.
		if err := e.Pool.QueryRow(ctx, `SELECT extract(epoch FROM leased_until - last_run_at),
			extract(epoch FROM leased_until - clock_timestamp()) FROM idempotency_keys WHERE key = 'k1'`).
			Scan(&counted, &remaining); err != nil {
			return txn.Response{}, err
		}
		_, inUse = e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
		return txn.JSON(201, "done")
	})
	require.NoError(t, e.reg.Register(wf))
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.GreaterOrEqual(t, counted, (lease + phase).Seconds(), "the lease counts from the commit, not the phase's start")
	require.Greater(t, remaining, 0.0, "the lease is live after the commit")
	require.ErrorIs(t, inUse, txn.ErrKeyInUse, "a concurrent retry cannot take the key over")
	require.Equal(t, 1, readKey(t, e.Pool, "user_1", "k1").Attempts)
}

// An attempt that holds its lease while the key passes MaxAge makes no
// foreign call after that: the lease extension before the call fails the
// key instead, and that failure is the workflow's answer.
func TestForeignPhaseOfKeyOlderThanMaxAgeDoesNotCallOut(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	// A first attempt is younger than MaxAge by its own clock; an attempt
	// that took the key over asks the database. The key passes MaxAge
	// while that attempt runs.
	f.failAt.Store("after_p1")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	f.failAt.Store("")
	f.hook = func(point string, _ *txn.Attempt) {
		if point == "after_p1" {
			e.age(t, "k1", 12*time.Hour+time.Second)
		}
	}
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	requireMaxAgeFailure(t, resp)
	require.Zero(t, f.prov.calls.Load(), "the provider was not called")
	require.Zero(t, f.p3.Load(), "the final phase did not run")
	require.Equal(t, "max_age", e.failureReason(t, "k1"))
	require.Equal(t, "ride_created", readKey(t, e.Pool, "user_1", "k1").RecoveryPoint)

	f.hook = nil
	again, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.True(t, again.Replayed)
	require.Equal(t, resp.Body, again.Body)
}

// A foreign call's result is always recorded, and comes
// back byte for byte on a resume, even what jsonb cannot hold (\u0000, a
// number beyond numeric's range).
func TestForeignResultJSONBCannotHoldRoundTripsByteExactThroughResume(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	result := json.RawMessage(`{"memo":"a\u0000b <&>","amount":1e1000000,"fee":1.50,"ok":true}`)
	want, err := json.Marshal(result) // what encoding/json produces is what is stored
	require.NoError(t, err)

	var calls atomic.Int64
	var fail atomic.Bool
	fail.Store(true)
	seen := make(chan []byte, 2)
	wf := txn.NewWorkflow("provider_answer", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		got, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (json.RawMessage, error) {
			calls.Add(1)
			return result, nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		seen <- append([]byte(nil), got...)
		if fail.Load() {
			return txn.Response{}, errInjected // crash after the phase committed
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			return txn.Response{Status: 201, Body: got}, nil
		})
	})
	require.NoError(t, e.reg.Register(wf))
	_, err = e.runner.RunWorkflow(ctx, rideKey("k"), wf)
	require.ErrorIs(t, err, errInjected)
	require.Equal(t, "charge", readKey(t, e.Pool, "user_1", "k").RecoveryPoint, "the result was recorded")
	require.Equal(t, string(want), string(<-seen), "the first attempt sees the stored form")

	fail.Store(false)
	resp, err := e.runner.Resume(ctx, "user_1", "k")
	require.NoError(t, err)
	require.Equal(t, string(want), string(<-seen), "the resumed attempt sees the same bytes")
	require.Equal(t, string(want), string(resp.Body))
	require.Equal(t, int64(1), calls.Load(), "the provider was called once")
}

// A rejection from the final phase before anything took effect rolls back
// that phase's writes too, and leaves no key.
func TestFinishRejectionBeforeAnyPhaseRollsBackAndLeavesNoKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	wf := txn.NewWorkflow("finish_only", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('finish', 1)`); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(409, "out of stock")
		})
	})
	require.NoError(t, e.reg.Register(wf))
	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.Equal(t, 409, resp.Status)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges`))
}

// lostPhaseWorkflow is Atomic "first", whose result counts its runs; then,
// on the first run only, lose, which stands for a failover that lost
// "first"'s commit; a Foreign "charge" that passes its foreign key to call
// (none when call is nil); and a Finish that writes a charge row with
// "first"'s result and answers it.
func lostPhaseWorkflow(name string, lose func(ctx context.Context), call func(fk string)) *txn.Workflow {
	var runs atomic.Int64
	var lost atomic.Bool
	return txn.NewWorkflow(name, func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		id, err := txn.Atomic(ctx, a, "first", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			return runs.Add(1), nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		if !lost.Swap(true) {
			lose(ctx)
		}
		if call != nil {
			if _, err := txn.Foreign(ctx, a, "charge", func(ctx context.Context, fk string) (string, error) {
				call(fk)
				return "ch", nil
			}); err != nil {
				return txn.Response{}, err
			}
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('ride', $1)`, id); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(201, map[string]int64{"first": id})
		})
	})
}

// A phase this attempt committed can vanish while the attempt holds the
// lease: a failover to an asynchronous standby that had not received the
// commit, where the key row (with the attempt's lease, committed earlier)
// survives. The attempt must not build on the hole: by default the read
// before the foreign call finds the key's recovery point behind its own
// and stops (ErrLeaseLost, 409) before calling out, giving the lease back;
// the retry resumes from the key's recovery point and runs the lost phase
// again.
//
// With Config.FailoverKeepsCommits (a promise that no failover loses a
// commit, broken here) the call is made; the next commit finds the hole
// and commits nothing over it, and the retry calls the provider again
// under the same foreign key.
func TestAttemptStopsWhenAPhaseItCommittedIsLost(t *testing.T) {
	t.Parallel()
	for _, keeps := range []bool{false, true} {
		t.Run(fmt.Sprintf("failover_keeps_commits=%v", keeps), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, &txn.Config{FailoverKeepsCommits: keeps})
			ctx := ctxT(t)
			var mu sync.Mutex
			var keys []string
			wf := lostPhaseWorkflow("lossy", func(ctx context.Context) {
				// The server now holds the key as it was before "first"
				// committed: recovery point, results and lease as inserted.
				_, err := e.Pool.Exec(ctx, `UPDATE idempotency_keys SET recovery_point = 'started', phase_results_raw = NULL`)
				require.NoError(t, err)
			}, func(fk string) {
				mu.Lock()
				defer mu.Unlock()
				keys = append(keys, fk)
			})
			require.NoError(t, e.reg.Register(wf))
			_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
			require.ErrorIs(t, err, txn.ErrLeaseLost)
			if keeps {
				require.Len(t, keys, 1, "the call is made on top of the lost commit")
			} else {
				require.Empty(t, keys, "no foreign call on top of the lost commit, though the lease is fresh")
			}
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'running' AND recovery_point = 'started' AND lease_token IS NULL AND phase_results_raw IS NULL`),
				"nothing built on the hole, no foreign result either; the lease given back")
			require.Zero(t, e.Count(t, `SELECT count(*) FROM charges`), "the final phase committed nothing")

			resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
			require.NoError(t, err, "the retry runs at once")
			require.Equal(t, 201, resp.Status)
			require.JSONEq(t, `{"first":2}`, string(resp.Body), "the lost phase ran again")
			var results []byte
			require.NoError(t, e.Pool.QueryRow(ctx, `SELECT phase_results_raw FROM idempotency_keys`).Scan(&results))
			require.JSONEq(t, `{"first":2,"charge":"ch"}`, string(results))
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE amount = 2`))
			if keeps {
				require.Len(t, keys, 2)
				require.Equal(t, keys[0], keys[1], "the provider got the same foreign key twice")
			} else {
				require.Len(t, keys, 1)
			}
		})
	}
}

// A failover to an asynchronous standby lost the commit of phase "first",
// and on the new primary the key's version from before that commit (same
// id, same lease token, recovery point "started") sits in the very slot
// (ctid) where the lost commit's version was: a resumer's claim rewrote it
// there, say. The attempt addresses its row by ctid, id and token; the
// recovery point must be part of that fence too, or Finish commits over the
// hole: a finished key without the phase. Here the slot is reproduced by
// truncating the table and filling it back up to that slot.
func TestFenceRefusesAnOlderVersionOfTheKeyInTheSameSlot(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	wf := lostPhaseWorkflow("same_slot", func(ctx context.Context) {
		var block, slot int
		require.NoError(t, e.Pool.QueryRow(ctx,
			`SELECT (ctid::text::point)[0]::int, (ctid::text::point)[1]::int FROM idempotency_keys`).Scan(&block, &slot))
		require.Zero(t, block)
		_, err := e.Pool.Exec(ctx, fmt.Sprintf(`
			CREATE TABLE hole_saved AS SELECT * FROM idempotency_keys;
			UPDATE hole_saved SET recovery_point = 'started', phase_results_raw = NULL;
			CREATE TABLE hole_fill AS SELECT s.* FROM hole_saved AS s, generate_series(1, %d);
			UPDATE hole_fill SET key = key || '-fill-' || (ctid::text::point)[1]::int,
			                     id = id + 1000 + (ctid::text::point)[1]::int;
			TRUNCATE idempotency_keys;
			INSERT INTO idempotency_keys SELECT * FROM hole_fill;
			INSERT INTO idempotency_keys SELECT * FROM hole_saved;`, slot-1))
		require.NoError(t, err)
		var now int
		require.NoError(t, e.Pool.QueryRow(ctx,
			`SELECT (ctid::text::point)[1]::int FROM idempotency_keys WHERE key = 'k1'`).Scan(&now))
		require.Equal(t, slot, now, "the older version is in the lost commit's slot")
	}, nil)
	require.NoError(t, e.reg.Register(wf))
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.ErrorIs(t, err, txn.ErrLeaseLost)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges`), "nothing committed over the hole")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'k1' AND status = 'running' AND recovery_point = 'started' AND lease_token IS NULL`),
		"the key still before the lost phase; the lease given back")

	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
	require.NoError(t, err)
	require.JSONEq(t, `{"first":2}`, string(resp.Body), "the retry runs the lost phase again")
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE amount = 2`))
}

// A first attempt that has run for more than half its lease, or half of
// MaxAge, asks the database before calling out, as any other attempt does:
// here the key passes MaxAge while the first phase's attempt waits, so the
// call is not made and the key is failed.
func TestFirstAttemptPastHalfItsLeaseOrMaxAgeChecksBeforeCallingOut(t *testing.T) {
	t.Parallel()
	t.Run("half_the_lease", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, &txn.Config{LeaseDuration: time.Second})
		writes := keyWrites(t, e)
		f := newRideFlow(t, e.reg, "ride")
		f.hook = func(point string, _ *txn.Attempt) {
			if point == "after_p1" {
				time.Sleep(600 * time.Millisecond)
			}
		}
		resp, err := e.runner.RunWorkflow(ctxT(t), rideKey("k1"), f.wf)
		require.NoError(t, err)
		require.Equal(t, 201, resp.Status)
		require.Equal(t, 3, writes(), "the first phase, the lease extension, the final phase")
	})
	t.Run("half_max_age", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, &txn.Config{MaxAge: time.Second})
		f := newRideFlow(t, e.reg, "ride")
		f.hook = func(point string, _ *txn.Attempt) {
			if point == "after_p1" {
				time.Sleep(1100 * time.Millisecond)
			}
		}
		resp, err := e.runner.RunWorkflow(ctxT(t), rideKey("k1"), f.wf)
		require.NoError(t, err)
		require.Equal(t, http.StatusInternalServerError, resp.Status, string(resp.Body))
		require.Contains(t, string(resp.Body), `"reason":"max_age"`)
		require.Zero(t, f.prov.calls.Load(), "the provider was not called")
		require.Equal(t, "max_age", e.failureReason(t, "k1"))
	})
}
