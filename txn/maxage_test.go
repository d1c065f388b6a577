package txn_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

// requireMaxAgeFailure checks a stored max_age failure: the same shape as
// the one the recovery Resumer stores.
func requireMaxAgeFailure(t *testing.T, resp txn.Response) {
	t.Helper()
	require.Equal(t, http.StatusInternalServerError, resp.Status, string(resp.Body))
	require.Equal(t, "application/problem+json", resp.Header.Get("Content-Type"))
	var p struct {
		Status int    `json:"status"`
		Reason string `json:"reason"`
		Detail string `json:"detail"`
	}
	require.NoError(t, json.Unmarshal(resp.Body, &p))
	require.Equal(t, "max_age", p.Reason)
	require.Equal(t, 500, p.Status)
	require.Contains(t, p.Detail, "12h0m0s")
}

// age makes a key look created long ago, and last run just now (so the
// recovery Resumer would leave it alone: only a retry can reach it).
func (e *env) age(t *testing.T, key string, age time.Duration) {
	t.Helper()
	_, err := e.Pool.Exec(context.Background(), `UPDATE idempotency_keys
		SET created_at = now() - make_interval(secs => $2), last_run_at = now() - interval '10 seconds'
		WHERE key = $1`, key, age.Seconds())
	require.NoError(t, err)
}

// DESIGN rule 11: a client retry of a key older than MaxAge does not take it
// over (the provider would be called again past its idempotency window): the
// statement that would have taken it fails it, storing the problem response.
func TestKeyOlderThanMaxAgeIsFailedNotTakenOver(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil) // MaxAge: the default, 12 hours
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("foreign")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	e.age(t, "k1", 30*time.Hour)
	f.failAt.Store("")

	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	requireMaxAgeFailure(t, resp)
	require.False(t, resp.Replayed)
	require.Zero(t, f.prov.calls.Load(), "no foreign call past MaxAge")
	require.Equal(t, int64(1), f.p1.Load(), "no phase ran again")
	k := readKey(t, e.Pool, "user_1", "k1")
	require.Equal(t, "failed", k.Status)
	require.Equal(t, 1, k.Attempts, "not taken over")
	require.Equal(t, "max_age", e.failureReason(t, "k1"))
	require.Equal(t, uint64(1), e.runner.Stats().TooOld)

	again, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	require.True(t, again.Replayed)
	require.Equal(t, resp.Body, again.Body)

	// A younger key is resumed as before.
	f.failAt.Store("foreign")
	_, err = e.runner.RunWorkflow(ctx, rideKey("k2"), f.wf)
	require.ErrorIs(t, err, errInjected)
	e.age(t, "k2", 11*time.Hour)
	f.failAt.Store("")
	resp, err = e.runner.RunWorkflow(ctx, rideKey("k2"), f.wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
}

func (e *env) failureReason(t *testing.T, key string) string {
	t.Helper()
	var reason *string
	require.NoError(t, e.Pool.QueryRow(context.Background(),
		`SELECT failure_reason FROM idempotency_keys WHERE key = $1`, key).Scan(&reason))
	if reason == nil {
		return ""
	}
	return *reason
}

// A waiting retry (WaitWhenInUse) that outlives the holder's lease does not
// take over a key past MaxAge either.
func TestWaitModeTakeoverOfKeyOlderThanMaxAgeFailsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{WaitWhenInUse: true, WaitPollInterval: 5 * time.Millisecond})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("after_p1")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	f.failAt.Store("")
	// A crashed holder's lease, expiring shortly, on a key created 13 hours ago.
	_, err = e.Pool.Exec(ctx, `UPDATE idempotency_keys SET lease_token = gen_random_uuid(),
		leased_until = now() + interval '200 milliseconds', created_at = now() - interval '13 hours'`)
	require.NoError(t, err)

	resp, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.NoError(t, err)
	requireMaxAgeFailure(t, resp)
	require.Zero(t, f.prov.calls.Load())
	require.Equal(t, "failed", readKey(t, e.Pool, "user_1", "k1").Status)
}

// Resume (the recovery path and admin tools) fails such a key too.
func TestResumeOfKeyOlderThanMaxAgeFailsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("after_p1")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	f.failAt.Store("")
	e.age(t, "k1", 12*time.Hour+time.Minute)

	resp, err := e.runner.Resume(ctx, "user_1", "k1")
	require.NoError(t, err)
	requireMaxAgeFailure(t, resp)
	require.Zero(t, f.prov.calls.Load())
	require.Equal(t, "max_age", e.failureReason(t, "k1"))
}

// An attempt that holds its lease while the key passes MaxAge makes no
// foreign call after that: the lease extension before the call fails the
// key instead, and that failure is the workflow's answer.
func TestForeignPhaseOfKeyOlderThanMaxAgeDoesNotCallOut(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
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

func TestMaxAgeMustStayUnderTheProvidersWindow(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	for _, bad := range []time.Duration{txn.MaxAgeLimit, 36 * time.Hour, -time.Second} {
		_, err := txn.New(e.Pool, &txn.Config{MaxAge: bad})
		require.ErrorIs(t, err, txn.ErrInvalidConfig, bad)
	}
	r, err := txn.New(e.Pool, &txn.Config{MaxAge: txn.MaxAgeLimit - time.Second})
	require.NoError(t, err)
	require.Equal(t, txn.MaxAgeLimit-time.Second, r.Config().MaxAge)
	r, err = txn.New(e.Pool, nil)
	require.NoError(t, err)
	require.Equal(t, txn.MaxAgeDefault, r.Config().MaxAge)
	require.Equal(t, 12*time.Hour, txn.MaxAgeDefault)
}

// Client retries and the recovery path racing on one key past MaxAge: one
// statement fails it, nobody takes it over, and every caller gets the one
// stored failure.
func TestConcurrentRetriesOfAKeyPastMaxAgeAllGetItsOneFailure(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{WaitWhenInUse: true, WaitPollInterval: time.Millisecond})
	ctx := ctxT(t)
	f := newRideFlow(t, e.reg, "ride")
	f.failAt.Store("foreign")
	_, err := e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
	require.ErrorIs(t, err, errInjected)
	f.failAt.Store("")
	e.age(t, "k1", 13*time.Hour)

	bodies := make(chan string, 21)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 21 {
		wg.Go(func() {
			<-start
			var resp txn.Response
			var err error
			if i%7 == 0 {
				resp, err = e.runner.Resume(ctx, "user_1", "k1")
			} else {
				resp, err = e.runner.RunWorkflow(ctx, rideKey("k1"), f.wf)
			}
			if err != nil {
				bodies <- "error: " + err.Error()
				return
			}
			bodies <- strconv.Itoa(resp.Status) + " " + string(resp.Body)
		})
	}
	close(start)
	wg.Wait()
	close(bodies)
	distinct := map[string]int{}
	for b := range bodies {
		distinct[b]++
	}
	require.Len(t, distinct, 1, "one answer: %v", distinct)
	for b := range distinct {
		require.True(t, strings.HasPrefix(b, "500 "), b)
		require.Contains(t, b, "max_age")
	}
	require.Zero(t, f.prov.calls.Load(), "nobody called the provider")
	require.Equal(t, int64(1), f.p1.Load())
	k := readKey(t, e.Pool, "user_1", "k1")
	require.Equal(t, "failed", k.Status)
	require.Equal(t, 1, k.Attempts, "nobody took it over")
	require.Equal(t, uint64(1), e.runner.Stats().TooOld, "one statement failed it")
}
