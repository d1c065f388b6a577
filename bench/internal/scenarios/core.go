package scenarios

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
	"github.com/atomicphase/atomicphase/txn"
)

// subject sets up one system under test on a cell's pool and returns its
// operation and a teardown.
type subject struct {
	name  string
	setup func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error)
}

// measure runs one subject at concurrency c in a fresh cell.
func (s *Suite) measure(ctx context.Context, sub subject, c int) (harness.Result, error) {
	cl, err := s.newCell(ctx, c)
	if err != nil {
		return harness.Result{}, err
	}
	defer cl.pool.Close()
	op, teardown, err := sub.setup(ctx, s, cl, c)
	if err != nil {
		return harness.Result{}, fmt.Errorf("%s: setup: %w", sub.name, err)
	}
	timing := s.Timing
	timing.OnMeasure = func() { s.resetStatements(ctx, cl.pool) }
	res := harness.Drive(ctx, c, timing, cl.ctr, op)
	s.dumpStatements(ctx, cl.pool, fmt.Sprintf("%s, c=%d", sub.name, c), res.Ops)
	teardown()
	s.Progress("%-28s c=%-3d %8.0f ops/s  p50 %6s ms  p99 %6s ms  rt/op %.1f  cpu %s ms/op  errors %d",
		sub.name, c, res.Throughput(), harness.FormatMs(res.Percentile(50)), harness.FormatMs(res.Percentile(99)), res.RoundTrips, harness.FormatMs(res.CPUPerOp), res.Errors)
	if res.Ops == 0 && res.FirstError != nil {
		return res, fmt.Errorf("%s: no operation succeeded: %w", sub.name, res.FirstError)
	}
	if res.FirstError != nil {
		s.Progress("%s: first error: %v", sub.name, res.FirstError)
	}
	return res, nil
}

// bare is the baseline: the business row in a hand-written SERIALIZABLE
// transaction, with no idempotency at all.
var bare = subject{name: "bare SERIALIZABLE tx", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	return func(ctx context.Context, _ int, seq int64) error {
		return bareInsert(ctx, cl.pool, opKey("bare", seq))
	}, func() {}, nil
}}

func bareInsert(ctx context.Context, pool *pgxpool.Pool, key string) error {
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit it is a no-op
	if _, err := tx.Exec(ctx, insertRow, key, 1, 100); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// orderParams is the request body every keyed subject fingerprints.
var orderParams = []byte(`{"amount":100,"currency":"usd"}`)

func orderKey(value string) txn.Key {
	return txn.Key{Scope: "bench", Value: value, Method: "POST", Path: "/orders", Params: orderParams}
}

var createdBody = []byte(`{"status":"created"}`)

// runFunc is the single-phase operation: the same business row as bare.
func runFunc(key string) txn.Func {
	return func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, insertRow, key, 1, 100); err != nil {
			return txn.Response{}, err
		}
		return txn.Response{Status: 201, Body: createdBody}, nil
	}
}

func newRunner(pool *pgxpool.Pool, reg *txn.Registry) (*txn.Runner, error) {
	return txn.New(pool, &txn.Config{Workflows: reg, Logger: harness.Discard})
}

var singlePhase = subject{name: "atomicphase Run", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	r, err := newRunner(cl.pool, nil)
	if err != nil {
		return nil, nil, err
	}
	return func(ctx context.Context, _ int, seq int64) error {
		key := opKey("run", seq)
		resp, err := r.Run(ctx, orderKey(key), runFunc(key))
		if err == nil && resp.Replayed {
			err = errors.New("fresh key replayed")
		}
		return err
	}, func() {}, nil
}}

// replayKeys is how many finished keys the replay subject reads at random.
const replayKeys = 2000

var replay = subject{name: "atomicphase replay", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	r, err := newRunner(cl.pool, nil)
	if err != nil {
		return nil, nil, err
	}
	keys := make([]string, replayKeys)
	for i := range keys {
		keys[i] = opKey("replay", int64(i))
		if _, err := r.Run(ctx, orderKey(keys[i]), runFunc(keys[i])); err != nil {
			return nil, nil, err
		}
	}
	if _, err := cl.pool.Exec(ctx, "VACUUM ANALYZE idempotency_keys"); err != nil {
		return nil, nil, err
	}
	return func(ctx context.Context, _ int, _ int64) error {
		key := keys[rand.IntN(len(keys))]
		resp, err := r.Run(ctx, orderKey(key), runFunc(key))
		if err == nil && !resp.Replayed {
			err = errors.New("finished key not replayed")
		}
		return err
	}, func() {}, nil
}}

// RunCore runs scenarios 1, 2 and 3 (those enabled), sharing one bare
// baseline per concurrency, measured in the same block as its subjects.
func (s *Suite) RunCore(ctx context.Context, s1, s2, s3 bool) error {
	t1 := &Table{
		Title:    "1. Single-phase Run vs bare SERIALIZABLE transaction (one business row)",
		Unit:     "ops/s",
		RatioCol: "ratio vs bare",
		LimitCol: "ratio vs hand-written keyed tx",
	}
	t2 := &Table{
		Title:    "2. Replay of a finished key vs bare transaction",
		Unit:     "ops/s",
		RatioCol: "ratio vs bare",
	}
	t3 := &Table{
		Title:    "3. Three-step exactly-once operation (atomic write, foreign no-op, final atomic write)",
		Unit:     "ops/s",
		RatioCol: "ratio vs bare",
		LimitCol: "ratio vs hand-written 2-tx",
	}
	minRun, replayAt8 := math.Inf(1), math.NaN()
	minWF, minVsDBOS := math.Inf(1), math.Inf(1)
	var minRunGot, minWFGot, minVsDBOSGot string
	for _, c := range s.Concurrency {
		b, err := s.measure(ctx, bare, c)
		if err != nil {
			return err
		}
		bt := b.Throughput()
		for _, t := range []*Table{t1, t2, t3} {
			t.Rows = append(t.Rows, rowFrom(bare.name, c, b, 1))
		}
		if s1 {
			h, err := s.measure(ctx, handKeyed, c)
			if err != nil {
				return err
			}
			t1.add(handKeyed.name, c, h, bt, h.Throughput())
			r, err := s.measure(ctx, singlePhase, c)
			if err != nil {
				return err
			}
			row := t1.add(singlePhase.name, c, r, bt, h.Throughput())
			if q := row.Limit; q < minRun {
				minRun, minRunGot = q, fmt.Sprintf("lowest %.2f at c=%d (%.2f of bare)", q, c, row.Ratio)
			}
			if s.Experiments {
				x, err := s.measure(ctx, leanRun, c)
				if err != nil {
					return err
				}
				t1.Rows = append(t1.Rows, rowFrom(leanRun.name, c, x, ratio(x.Throughput(), bt)))
			}
		}
		if s2 {
			r, err := s.measure(ctx, replay, c)
			if err != nil {
				return err
			}
			q := ratio(r.Throughput(), bt)
			t2.Rows = append(t2.Rows, rowFrom(replay.name, c, r, q))
			if c == 8 {
				replayAt8 = q
			}
		}
		if s3 {
			h, err := s.measure(ctx, handTwoTx, c)
			if err != nil {
				return err
			}
			t3.add(handTwoTx.name, c, h, bt, h.Throughput())
			var ours float64
			for _, sub := range []subject{ourWorkflow, ourWorkflowKeptCommits, dbosWorkflow, riverJob} {
				r, err := s.measure(ctx, sub, c)
				if err != nil {
					return err
				}
				row := t3.add(sub.name, c, r, bt, h.Throughput())
				switch sub.name {
				case ourWorkflow.name:
					ours = r.Throughput()
					if row.Limit < minWF {
						minWF, minWFGot = row.Limit, fmt.Sprintf("lowest %.2f at c=%d (%.2f of bare)", row.Limit, c, row.Ratio)
					}
				case dbosWorkflow.name:
					if q := ratio(ours, r.Throughput()); q < minVsDBOS {
						minVsDBOS, minVsDBOSGot = q, fmt.Sprintf("lowest %.2f× at c=%d", q, c)
					}
				}
			}
		}
	}
	if s1 {
		t1.Goals = append(t1.Goals, Goal{Text: "Run ≥ 0.90 of the hand-written keyed tx at every concurrency", Met: minRun >= 0.90, Got: minRunGot})
		t1.Notes = append(t1.Notes,
			"Run: a lookup read of the key (a retry is answered by it, in one round trip), then one SERIALIZABLE transaction that writes the key row, the business row and the stored response: one commit, 3 round trips (the read; BEGIN pipelined with the key insert and the business row, the function's first statement; the response pipelined with COMMIT). Round trips per op are counted by a pgx tracer; CPU ms/op is the whole machine's busy CPU time (client, server, everything) per op over the window.",
			"bare: BEGIN ISOLATION LEVEL SERIALIZABLE; INSERT the same row; COMMIT. No idempotency.",
			"hand-written keyed tx, the physical limit of storing a key with its response: BEGIN ISOLATION LEVEL SERIALIZABLE pipelined with the key row's insert (our table, its indexes, the response inline, ON CONFLICT DO NOTHING), the business row, COMMIT: 3 round trips; on a conflict it would look the stored row up; a serialization failure is retried. No fencing, no recovery.")
		s.Tables = append(s.Tables, t1)
	}
	if s2 {
		t2.Goals = append(t2.Goals, Goal{Text: "≥ 4× the bare transaction at c=8", Met: replayAt8 >= 4, Got: fmt.Sprintf("%.2f× at c=8", replayAt8)})
		t2.Notes = append(t2.Notes, fmt.Sprintf("replay: Run on one of %d finished keys, chosen at random; returns the stored response and runs nothing.", replayKeys))
		s.Tables = append(s.Tables, t2)
	}
	if s3 {
		t3.Goals = append(t3.Goals,
			Goal{Text: "atomicphase workflow ≥ 0.90 of the hand-written 2-tx workflow at every concurrency", Met: minWF >= 0.90, Got: minWFGot},
			Goal{Text: "atomicphase workflow ≥ 3× DBOS-Go at every concurrency", Met: minVsDBOS >= 3, Got: minVsDBOSGot})
		t3.Notes = append(t3.Notes, workflowNotes...)
		t3.Notes = append(t3.Notes, "hand-written 2-tx workflow, the limit of a three-step operation with a checkpoint before the foreign call: tx1 = BEGIN ISOLATION LEVEL SERIALIZABLE pipelined with the key row's insert, then the first write pipelined with COMMIT; the foreign no-op; tx2 = BEGIN, the second write, the response (the key row addressed by ctid, as ours is, so that no predicate lock is taken on a shared index page) and COMMIT in one round trip; serialization failures retried. SERIALIZABLE like ours; no fencing, no recovery.")
		s.Tables = append(s.Tables, t3)
	}
	return nil
}
