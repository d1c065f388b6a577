package torture

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

// TestLinearizability records concurrent histories of Run, RunWorkflow and
// Resume on a few keys at a time, under faults, checks them with porcupine
// against a sequential specification (linearizability_model_test.go), and
// then checks the end state in SQL.
//
// The specification, per key. The state is the request the key row holds
// (none, A or B: the key's usual params, or other ones under the same key)
// and the answer stored (none, or one response: status, headers, body).
// Each operation takes effect at one instant between its call and return:
//   - run with request v: if no answer is stored and the row holds v or
//     nothing, it executes once and commits the row, its effects and its
//     answer together, and returns that answer (Replayed false), produced
//     for v; if an answer is stored and the row holds v, it returns the
//     stored answer byte for byte (Replayed true); if the row holds the
//     other request, ErrKeyReused; while no answer is stored it may
//     instead return ErrKeyInUse (another attempt holds the key).
//     Rejections change nothing.
//   - workflow with request v: the same, except that a workflow makes two
//     commits others can see: first its key row (its first phase), then
//     its answer (Finish). The history records a workflow call that may
//     have executed as two operations over its interval, its claim of the
//     key row and its answer, so that "in use" and "reused" may fall
//     between them.
//   - resume: the same for the request the row holds; ErrKeyNotFound (and
//     nothing else) while no row is committed.
//   - any other error is indeterminate: the call may have done nothing or
//     any part of what it would do (claim, then store an answer nobody has
//     seen yet). It never returns in the history (Jepsen's "info"): its
//     effect may lie after its return, as a COMMIT the server applies
//     after the client gave up does. The library may also abandon such an
//     operation, storing its own problem response (a failed key): safe if
//     the key then holds no effects and everyone gets that answer.
//   - audit, after every caller stopped and every key got a final retry
//     without faults: the database stores the key's one answer and holds
//     exactly the effects that answer reports (a business row per phase,
//     written by the execution whose id the answer carries, and for a
//     workflow one provider charge), so at most one execution of a key
//     ever committed and every caller that got an answer got the stored one.
//
// Beyond that safety, the end-state check requires liveness: every key ends
// finished, none abandoned. Each function generates a fresh execution id
// inside its transaction, writes it in its row and answers with it (body
// and an X-Execution header), so executions are told apart.
//
// The faults: a goroutine terminates a random backend of the runners' pool
// (pg_terminate_backend) every 5-35 ms; a fifth of the calls have a 1-40 ms
// timeout; a third of the function runs read, pause and write one shared
// row that another goroutine writes every 10 ms, so SERIALIZABLE fails
// some with 40001, and the runner that retries once gets hot Run functions
// that always do, with a longer pause, so ErrConflict appears; one phase in
// 25 takes longer than the 120 ms lease, so a twin takes the key over and
// the stale holder is fenced (ErrLeaseLost); one runner waits when the key
// is in use. Every outcome is counted and logged. One run (-race, two
// shared cores) made 8,392 storm calls on 352 keys in 12 s: 343 fresh
// answers, 4,087 replays, 2,396 in use, 946 reused, 125 not found, 873
// indeterminate (487 timed out, 360 unavailable, 13 lease lost, 10
// conflicts, 1 ErrInvalidUse, 2 other), with 439 backends terminated, 40 phases and 5
// foreign calls slower than the lease, and 335 serialization retries; an
// idle machine makes about twice as many calls.
//
// Broken builds it caught, tried locally and not committed: with the
// fences dropped from the statement that finishes a key (its ctid, lease
// token, status and recovery point conditions in internal/db's FinishKey),
// a stale holder's Finish overwrote a finished key: "the history is not
// linearizable: 6 of 636 keys have no linearization", the first showing
// two fresh answers with different finish executions for one order, the
// later one stored although a caller had been answered the first. With
// replays that restore only Content-Type (txn's storedResponse), 699 of
// 704 keys had none.
func TestLinearizability(t *testing.T) {
	t.Parallel()
	for range iterations() {
		t.Run("", linearizabilityOnce)
	}
}

const (
	linScope        = "lin"
	linCallers      = 16
	linKeysPerRound = 4  // keys raced on at a time: even ones Run, odd ones workflows
	linCallsPerKey  = 24 // calls on a key before the callers move to the next round's keys
	linStorm        = 12 * time.Second
	linLease        = 120 * time.Millisecond
	linSlowPhase    = 200 * time.Millisecond // longer than the lease: the key can be taken over meanwhile
)

func linearizabilityOnce(t *testing.T) {
	h := newLinHarness(t)
	stopFaults := h.startFaults()
	h.storm(time.Now().Add(linStorm))
	stopFaults()
	h.settleEveryKey()
	end := h.auditEndState()
	stats := h.logOutcomes()
	h.checkHistory()
	h.checkEndState(end)
	h.requireFaults(stats)
}

// linHarness holds one run of the test: the database, the runners, the
// functions they run, and the history recorded.
type linHarness struct {
	t       *testing.T
	d       *pgtest.DB
	pool    *pgxpool.Pool // the runners' and the provider's pool, whose backends are killed
	app     *linApp
	runners []*txn.Runner // the storm's, with different configurations
	// fewRetries is the storm's runner that retries a serialization failure once.
	fewRetries *txn.Runner
	calm       *txn.Runner // the final retries'
	rec        *historyRecorder
	issued     atomic.Int64 // calls started, which picks the round
	counts     counter
}

func newLinHarness(t *testing.T) *linHarness {
	d := pgtest.New(t)
	_, err := d.Pool.Exec(context.Background(), linSchema)
	require.NoError(t, err)
	// Only this test's sessions carry its schema's name as application_name.
	pool := d.NewPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["application_name"] = d.Schema
		c.MaxConns = linCallers + 4
	})
	h := &linHarness{t: t, d: d, pool: pool, rec: newHistoryRecorder()}
	reg := txn.NewRegistry()
	h.app = newLinApp(t, pool, reg, &h.counts)
	base := txn.Config{Workflows: reg, Logger: quietLogger(t), LeaseDuration: linLease,
		RetryBaseDelay: time.Millisecond, RetryMaxDelay: 20 * time.Millisecond, ReleaseTimeout: time.Second}
	fewRetries, waiting := base, base
	fewRetries.MaxRetries = 1
	waiting.WaitWhenInUse, waiting.WaitPollInterval = true, 5*time.Millisecond
	for _, cfg := range []txn.Config{base, fewRetries, waiting} {
		r, err := txn.New(pool, &cfg)
		require.NoError(t, err)
		h.runners = append(h.runners, r)
	}
	h.fewRetries = h.runners[1]
	h.calm, err = txn.New(pool, &waiting)
	require.NoError(t, err)
	return h
}

// startFaults starts the fault goroutines, until the returned function is
// called: one terminates a random backend of the runners' pool every 5-35
// ms; one commits a write of the shared row every 10 ms, so that a
// function that read it meanwhile fails with 40001 when it writes it.
func (h *linHarness) startFaults() (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		h.repeat(done, func() time.Duration { return time.Duration(5+rand.IntN(30)) * time.Millisecond }, h.killBackend)
	})
	wg.Go(func() {
		h.repeat(done, func() time.Duration { return 10 * time.Millisecond }, func() error {
			_, err := h.d.Pool.Exec(context.Background(), `UPDATE lin_hot SET n = n + 1 WHERE id = 1`)
			return err
		})
	})
	return func() { close(done); wg.Wait() }
}

// repeat calls fault after each pause until done is closed or fault fails.
func (h *linHarness) repeat(done <-chan struct{}, pause func() time.Duration, fault func() error) {
	for {
		select {
		case <-done:
			return
		case <-time.After(pause()): // fault timing
		}
		if err := fault(); err != nil {
			h.t.Errorf("fault injection failed: %v", err)
			return
		}
	}
}

// killBackend terminates a random backend of the runners' pool.
func (h *linHarness) killBackend() error {
	var killed bool
	err := h.d.Pool.QueryRow(context.Background(), `SELECT coalesce(bool_or(pg_terminate_backend(pid)), false) FROM (
		SELECT pid FROM pg_stat_activity WHERE application_name = $1 ORDER BY random() LIMIT 1) victim`,
		h.d.Schema).Scan(&killed)
	if killed {
		h.counts.add("fault: backend terminated")
	}
	return err
}

// storm runs the callers until the deadline.
func (h *linHarness) storm(until time.Time) {
	var wg sync.WaitGroup
	for client := range linCallers {
		wg.Go(func() {
			for time.Now().Before(until) {
				n := h.issued.Add(1) - 1
				key := linKeyAt(int(n)/(linKeysPerRound*linCallsPerKey), rand.IntN(linKeysPerRound))
				h.callOnce(client, h.runners[rand.IntN(len(h.runners))], key, h.pickCall(key), clientTimeout())
			}
		})
	}
	wg.Wait()
}

// pickCall chooses what a storm call does with key: mostly its usual
// request, sometimes the other one, and for a workflow sometimes a resume.
func (h *linHarness) pickCall(key linKey) keyedCall {
	c := keyedCall{Key: key.name, Kind: key.kind, Variant: "A"}
	if rand.IntN(12) == 0 {
		c.Variant = "B"
	}
	if key.kind == callWorkflow && rand.IntN(8) == 0 {
		c = keyedCall{Key: key.name, Kind: callResume}
	}
	return c
}

// clientTimeout is how long a storm call's client waits: a few seconds,
// or for a fifth of them a few milliseconds.
func clientTimeout() time.Duration {
	if rand.IntN(5) == 0 {
		return time.Duration(1+rand.IntN(40)) * time.Millisecond // fault timing: a client that gives up early
	}
	return 3 * time.Second
}

// callOnce makes one call, as a client would, and records it.
func (h *linHarness) callOnce(client int, r *txn.Runner, key linKey, c keyedCall, timeout time.Duration) keyedResult {
	return h.rec.record(client, key, c, func() keyedResult {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		resp, err := h.do(ctx, r, key, c)
		return h.classify(resp, err)
	})
}

func (h *linHarness) do(ctx context.Context, r *txn.Runner, key linKey, c keyedCall) (txn.Response, error) {
	switch c.Kind {
	case callRun:
		// The runner that retries once gets hot functions, so that
		// serialization failures outlast its retries: ErrConflict.
		return r.Run(ctx, key.request(c.Variant), h.app.runFunc(key.name, c.Variant, r == h.fewRetries))
	case callWorkflow:
		return r.RunWorkflow(ctx, key.request(c.Variant), h.app.wf)
	case callResume:
		return r.Resume(ctx, linScope, key.name)
	}
	panic("torture: no call of kind " + c.Kind)
}

// classify turns what a call returned into the model's result, and counts it.
func (h *linHarness) classify(resp txn.Response, err error) keyedResult {
	indeterminate := keyedResult{Outcome: outIndeterminate}
	if err != nil {
		indeterminate.Err = err.Error()
	}
	switch {
	case err == nil:
		how := "answered: fresh"
		if resp.Replayed {
			how = "answered: replayed"
		}
		h.counts.add(how)
		return keyedResult{Outcome: outAnswered, Answer: answerOf(resp.Status, resp.Header, resp.Body), Replayed: resp.Replayed}
	case errors.Is(err, txn.ErrLeaseLost):
		h.counts.add("indeterminate: lease lost")
		return indeterminate
	case errors.Is(err, txn.ErrConflict):
		h.counts.add("indeterminate: conflict")
		return indeterminate
	case errors.Is(err, txn.ErrUnavailable):
		h.counts.add("indeterminate: unavailable")
		return indeterminate
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		if errors.Is(err, txn.ErrKeyInUse) { // a waiting call whose client gave up
			h.counts.add("rejected: in use (waited)")
			return keyedResult{Outcome: outInUse}
		}
		h.counts.add("indeterminate: timed out")
		return indeterminate
	case errors.Is(err, txn.ErrKeyInUse):
		h.counts.add("rejected: in use")
		return keyedResult{Outcome: outInUse}
	case errors.Is(err, txn.ErrKeyReused):
		h.counts.add("rejected: reused")
		return keyedResult{Outcome: outReused}
	case errors.Is(err, txn.ErrKeyNotFound):
		h.counts.add("rejected: not found")
		return keyedResult{Outcome: outNotFound}
	case errors.Is(err, txn.ErrInvalidUse):
		// Today's txn answers this to a function that ended nothing when
		// a backend is killed while the library waits to settle a run
		// whose transaction was still in progress (txn/unsure.go,
		// settleUnsure: a failed wait counts as "did not end"). The
		// caller cannot know what happened, so it is indeterminate here;
		// the model and the audit judge its effects.
		h.counts.sample("indeterminate: ErrInvalidUse for a correct function", err)
		return indeterminate
	case errors.Is(err, txn.ErrPanicked), errors.Is(err, txn.ErrUnknownWorkflow), errors.Is(err, txn.ErrInvalidKey),
		errors.Is(err, txn.ErrInvalidRequest), errors.Is(err, txn.ErrKeyExpired):
		h.t.Errorf("a call the test makes correctly failed: %v", err)
		return indeterminate
	}
	h.counts.sample("indeterminate: other", err)
	return indeterminate
}

// settleEveryKey retries every key the storm touched, without faults, until
// it answers: its usual request, or the one its row holds.
func (h *linHarness) settleEveryKey() {
	keys := make(chan linKey)
	var wg sync.WaitGroup
	for worker := range settleWorkers {
		wg.Go(func() {
			for key := range keys {
				h.settle(settleClient+worker, key)
			}
		})
	}
	for _, key := range h.rec.keys() {
		keys <- key
	}
	close(keys)
	wg.Wait()
}

func (h *linHarness) settle(client int, key linKey) {
	calls := []keyedCall{{Key: key.name, Kind: callResume}, {Key: key.name, Kind: callWorkflow, Variant: "A"}}
	if key.kind == callRun {
		calls = []keyedCall{{Key: key.name, Kind: callRun, Variant: "A"}, {Key: key.name, Kind: callRun, Variant: "B"}}
	}
	for i, tries := 0, 0; i < len(calls) && tries < 100; tries++ {
		switch h.callOnce(client, h.calm, key, calls[i], 10*time.Second).Outcome {
		case outAnswered:
			return
		case outReused, outNotFound:
			i++ // the key holds the other request, or none yet
		default:
			time.Sleep(10 * time.Millisecond) // a stale lease runs out
		}
	}
	h.t.Errorf("key %s: no final retry got an answer", key.name)
}

// Client ids in the history, after the storm's callers (0 to linCallers-1).
const (
	settleClient  = linCallers                   // the first of the final retries' workers
	settleWorkers = 4                            // how many make the final retries
	auditClient   = settleClient + settleWorkers // the end state's audit
)

// endState is what the database holds once every caller stopped.
type endState struct {
	status  map[string]string // key -> its row's status
	answers map[string]answer // key -> the stored answer
	effects map[string]string // key -> its effect rows and charges, in answer.Effects' form
}

// auditEndState reads the end state and records it in the history, one
// audit per key.
func (h *linHarness) auditEndState() endState {
	end := h.readEndState()
	for _, key := range h.rec.keys() {
		h.rec.record(auditClient, key, keyedCall{Key: key.name, Kind: callAudit}, func() keyedResult {
			return keyedResult{Outcome: outAudited, Answer: end.answers[key.name], Effects: end.effects[key.name]}
		})
	}
	return end
}

func (h *linHarness) readEndState() endState {
	ctx := context.Background()
	end := endState{status: map[string]string{}, answers: map[string]answer{}, effects: map[string]string{}}
	rows, err := h.d.Pool.Query(ctx, `SELECT key, status, response_status, response_headers::text, response_body
		FROM idempotency_keys WHERE scope = $1`, linScope)
	require.NoError(h.t, err)
	for rows.Next() {
		var key, status string
		var code *int32
		var headers *string
		var body []byte
		require.NoError(h.t, rows.Scan(&key, &status, &code, &headers, &body))
		end.status[key] = status
		if code == nil {
			continue
		}
		var header http.Header
		if headers != nil {
			require.NoError(h.t, json.Unmarshal([]byte(*headers), &header), "key %s: stored headers", key)
		}
		end.answers[key] = answerOf(int(*code), header, body)
	}
	require.NoError(h.t, rows.Err())

	effects := map[string][]string{}
	rows, err = h.d.Pool.Query(ctx, `SELECT key, effect || ':' || execution FROM lin_effects
		UNION ALL SELECT idem_key, 'charge:' || charge_id FROM lin_charges`)
	require.NoError(h.t, err)
	for rows.Next() {
		var key, effect string
		require.NoError(h.t, rows.Scan(&key, &effect))
		effects[key] = append(effects[key], effect)
	}
	require.NoError(h.t, rows.Err())
	for key, e := range effects {
		end.effects[key] = joinEffects(e)
	}
	return end
}

// checkHistory checks the whole history, audits included, against the
// model; on failure it names the keys without a linearization, shows the
// first one's history, and writes porcupine's visualization of them.
func (h *linHarness) checkHistory() {
	ops := reducePending(h.rec.history())
	model := keyedOperationModel()
	start := time.Now()
	result := porcupine.CheckOperationsTimeout(model, ops, 2*time.Minute)
	h.t.Logf("porcupine: %s for %d operations (pending calls reduced) in %v", result, len(ops), time.Since(start).Round(time.Millisecond))
	switch result {
	case porcupine.Ok:
		return
	case porcupine.Unknown:
		h.t.Fatalf("porcupine did not decide a history of %d operations in time", len(ops))
	}
	var illegal [][]porcupine.Operation
	var names []string
	for _, keyOps := range partitionByKey(ops) {
		if !porcupine.CheckOperations(model, keyOps) {
			illegal = append(illegal, keyOps)
			names = append(names, keyOps[0].Input.(keyedCall).Key)
		}
	}
	require.NotEmpty(h.t, illegal, "the history failed as a whole, so some key's must")
	h.t.Fatalf("the history is not linearizable: %d of %d keys have no linearization (%s)\n"+
		"key %s (indeterminate calls shown ending just after the key's first answer):\n%s\n%s",
		len(illegal), len(h.rec.keys()), strings.Join(names[:min(len(names), 10)], " "), names[0],
		describeOps(illegal[0]), visualize(model, slices.Concat(illegal...)))
}

// checkEndState checks in SQL what the audits recorded, with plain
// messages, and what the history does not show: every key finished, no row
// for a key nobody called, at most one charge per key.
func (h *linHarness) checkEndState(end endState) {
	keys := h.rec.keys()
	got := map[string]map[string]bool{} // key -> the answers callers got
	for _, op := range h.rec.history() {
		if r := op.Output.(keyedResult); r.Outcome == outAnswered {
			k := op.Input.(keyedCall).Key
			if got[k] == nil {
				got[k] = map[string]bool{}
			}
			got[k][r.Answer.Text] = true
		}
	}
	var failed []string
	for _, key := range keys {
		if status := end.status[key.name]; status != "finished" {
			failed = append(failed, fmt.Sprintf("%s (%s: %s)", key.name, status, shortAnswer(end.answers[key.name].Text)))
		}
	}
	require.Empty(h.t, failed, "every key ends finished after its final retry; the library stopped these "+
		"although their functions did nothing wrong (the model allows it: no effects, one answer for all)")
	for _, key := range keys {
		stored := end.answers[key.name]
		require.NotEmpty(h.t, stored.Effects, "key %s: the stored answer names its execution: %q", key.name, stored.Text)
		require.Equal(h.t, stored.Effects, end.effects[key.name],
			"key %s: the database holds the effects of exactly the execution whose answer is stored", key.name)
		for text := range got[key.name] {
			require.Equal(h.t, stored.Text, text, "key %s: what a caller got is the stored answer", key.name)
		}
	}
	require.Len(h.t, end.status, len(keys), "a key row for every key called, and for no other")
	require.Len(h.t, end.effects, len(keys), "effects for every key called, and for no other")
	require.Zero(h.t, h.d.Count(h.t, `SELECT count(*) FROM (SELECT idem_key FROM lin_charges GROUP BY 1 HAVING count(*) > 1) twice`),
		"the provider charged each key at most once")
}

// logOutcomes logs how often each outcome and fault happened, and returns
// the runners' summed stats.
func (h *linHarness) logOutcomes() txn.Stats {
	var stats txn.Stats
	for _, r := range append(slices.Clone(h.runners), h.calm) {
		s := r.Stats()
		stats.Retries += s.Retries
		stats.LeaseLost += s.LeaseLost
		stats.Conflicts += s.Conflicts
		stats.Waited += s.Waited
		stats.Released += s.Released
	}
	h.t.Logf("linearizability: %d storm calls, %d operations recorded, on %d keys; %d provider calls for %d charges; runners' stats: %d serialization retries, "+
		"%d lease lost, %d conflicts, %d waited, %d released%s",
		h.issued.Load(), len(h.rec.history()), len(h.rec.keys()), h.d.Count(h.t, `SELECT count(*) FROM lin_provider_calls`),
		h.d.Count(h.t, `SELECT count(*) FROM lin_charges`), stats.Retries, stats.LeaseLost, stats.Conflicts, stats.Waited,
		stats.Released, &h.counts)
	return stats
}

// requireFaults fails if the storm missed an outcome or a fault it is
// meant to produce: the checks would then have proven less.
func (h *linHarness) requireFaults(stats txn.Stats) {
	for _, label := range []string{"fault: backend terminated", "indeterminate: lease lost", "indeterminate: conflict",
		"indeterminate: timed out", "answered: fresh", "answered: replayed", "rejected: in use", "rejected: reused",
		"rejected: not found"} {
		require.Positive(h.t, h.counts.get(label), "the storm produced %q", label)
	}
	require.Positive(h.t, stats.Retries, "serialization failures were retried")
}
