package scenarios

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/dbos-inc/dbos-transact-golang/dbos"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
	"github.com/atomicphase/atomicphase/txn"
)

var workflowNotes = []string{
	"atomicphase workflow: RunWorkflow with Atomic(write), Foreign(no-op), Finish(write): each atomic phase is a SERIALIZABLE transaction that also records the recovery point, fenced by the lease; the Foreign result is committed with the final phase. 6 round trips and 2 commits: the lookup; BEGIN with the key's lock and the first write; the key row with COMMIT; a read of the key before the foreign call (a failover to an asynchronous standby may have lost the commit); BEGIN with the second write; the response with COMMIT. With FailoverKeepsCommits (for synchronous replication) the read is skipped: 5 round trips.",
	"DBOS-Go: a workflow with a workflow id (the idempotency key), RunAsTransaction(write), RunAsStep(no-op), RunAsTransaction(write), then GetResult. The data source is the system database's own pool, so each transaction step commits the write and its checkpoint in one transaction (DBOS's fastest configuration). DBOS runs its transactions at its default isolation, READ COMMITTED.",
	"River: a unique job (UniqueOpts ByArgs on the key) inserted with InsertTx in the transaction of the first write; the worker does the no-op, then writes the final row and JobCompleteTx in one transaction; the operation ends when that commits. FetchCooldown lowered to 1 ms from the 100 ms default, FetchPollInterval 50 ms (default 1 s); MaxWorkers = c. River's transactions run at READ COMMITTED. The foreign step is not checkpointed: a retried job runs it again.",
}

// ---- atomicphase ----

var ourWF = txn.NewWorkflow("bench_three_steps", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
	_, key := a.Key()
	if _, err := txn.Atomic(ctx, a, "first_write", func(ctx context.Context, tx pgx.Tx) (int, error) {
		_, err := tx.Exec(ctx, insertRow, key, 1, 100)
		return 1, err
	}); err != nil {
		return txn.Response{}, err
	}
	if _, err := txn.Foreign(ctx, a, "foreign_noop", func(ctx context.Context, foreignKey string) (string, error) {
		return "ok", nil
	}); err != nil {
		return txn.Response{}, err
	}
	return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		if _, err := tx.Exec(ctx, insertRow, key, 3, 100); err != nil {
			return txn.Response{}, err
		}
		return txn.Response{Status: 201, Body: createdBody}, nil
	})
})

var ourWorkflow = subject{name: "atomicphase workflow", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	return workflowOp(cl.pool, &txn.Config{})
}}

// ourWorkflowKeptCommits is the same with Config.FailoverKeepsCommits: no
// read of the key before the foreign call.
var ourWorkflowKeptCommits = subject{name: "atomicphase workflow, FailoverKeepsCommits", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	return workflowOp(cl.pool, &txn.Config{FailoverKeepsCommits: true})
}}

func workflowOp(pool *pgxpool.Pool, cfg *txn.Config) (harness.Op, func(), error) {
	reg := txn.NewRegistry()
	if err := reg.Register(ourWF); err != nil {
		return nil, nil, err
	}
	cfg.Workflows, cfg.Logger = reg, harness.Discard
	r, err := txn.New(pool, cfg)
	if err != nil {
		return nil, nil, err
	}
	return func(ctx context.Context, _ int, seq int64) error {
		resp, err := r.RunWorkflow(ctx, orderKey(opKey("wf", seq)), ourWF)
		if err == nil && resp.Status != 201 {
			err = fmt.Errorf("workflow answered %d", resp.Status)
		}
		return err
	}, func() {}, nil
}

// ---- DBOS ----

// dbosDS is the data source of the DBOS context currently running; DBOS
// workflows must be top-level functions, so it is package state.
var dbosDS *dbos.DataSource

func dbosThreeSteps(ctx dbos.Context, key string) (string, error) {
	if _, err := dbos.RunAsTransaction(ctx, dbosDS, func(ctx context.Context, tx dbos.Tx) (int, error) {
		_, err := tx.Exec(ctx, insertRow, key, 1, 100)
		return 1, err
	}, dbos.WithStepName("first_write")); err != nil {
		return "", err
	}
	if _, err := dbos.RunAsStep(ctx, func(ctx context.Context) (string, error) {
		return "ok", nil
	}, dbos.WithStepName("foreign_noop")); err != nil {
		return "", err
	}
	if _, err := dbos.RunAsTransaction(ctx, dbosDS, func(ctx context.Context, tx dbos.Tx) (int, error) {
		_, err := tx.Exec(ctx, insertRow, key, 3, 100)
		return 3, err
	}, dbos.WithStepName("final_write")); err != nil {
		return "", err
	}
	return `{"status":"created"}`, nil
}

var dbosWorkflow = subject{name: "DBOS-Go workflow", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	dctx, err := dbos.NewContext(ctx, dbos.Config{
		AppName:      "bench",
		SystemDBPool: cl.pool,
		Logger:       harness.Discard,
	})
	if err != nil {
		return nil, nil, err
	}
	ds, err := dbos.NewDataSource(dctx, cl.pool)
	if err != nil {
		return nil, nil, err
	}
	dbosDS = ds
	dbos.RegisterWorkflow(dctx, dbosThreeSteps, dbos.WithWorkflowName("bench_three_steps"))
	if err := dbos.Launch(dctx); err != nil {
		return nil, nil, err
	}
	// DBOS may have created its tables just now: start from empty ones.
	if err := reset(ctx, cl.pool); err != nil {
		return nil, nil, err
	}
	return func(ctx context.Context, _ int, seq int64) error {
			key := opKey("dbos", seq)
			h, err := dbos.RunWorkflow(dctx, dbosThreeSteps, key, dbos.WithWorkflowID(key))
			if err != nil {
				return err
			}
			_, err = h.GetResult()
			return err
		}, func() {
			_ = dbos.Shutdown(dctx, 10*time.Second)
		}, nil
}}

// ---- River ----

type riverArgs struct {
	Key string `json:"key" river:"unique"`
}

func (riverArgs) Kind() string { return "bench_three_steps" }

type riverWorker struct {
	river.WorkerDefaults[riverArgs]
	pool interface {
		Begin(context.Context) (pgx.Tx, error)
	}
	waiters *sync.Map // key -> chan error
}

func (w *riverWorker) Work(ctx context.Context, job *river.Job[riverArgs]) error {
	// The foreign no-op, then the final write with the job's completion.
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit it is a no-op
	if _, err := tx.Exec(ctx, insertRow, job.Args.Key, 3, 100); err != nil {
		return err
	}
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
		return err
	}
	err = tx.Commit(ctx)
	if ch, ok := w.waiters.LoadAndDelete(job.Args.Key); ok {
		ch.(chan error) <- err
	}
	return err
}

var riverJob = subject{name: "River unique job", setup: func(ctx context.Context, s *Suite, cl *cell, c int) (harness.Op, func(), error) {
	waiters := &sync.Map{}
	workers := river.NewWorkers()
	if err := river.AddWorkerSafely(workers, &riverWorker{pool: cl.pool, waiters: waiters}); err != nil {
		return nil, nil, err
	}
	client, err := river.NewClient(riverpgxv5.New(cl.pool), &river.Config{
		Logger:            harness.Discard,
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: c}},
		Workers:           workers,
		FetchCooldown:     time.Millisecond,
		FetchPollInterval: 50 * time.Millisecond,
	})
	if err != nil {
		return nil, nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	if err := client.Start(runCtx); err != nil {
		cancel()
		return nil, nil, err
	}
	opts := &river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}}
	return func(ctx context.Context, _ int, seq int64) error {
			key := opKey("river", seq)
			done := make(chan error, 1)
			waiters.Store(key, done)
			tx, err := cl.pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx) //nolint:errcheck // after Commit it is a no-op
			if _, err := tx.Exec(ctx, insertRow, key, 1, 100); err != nil {
				return err
			}
			res, err := client.InsertTx(ctx, tx, riverArgs{Key: key}, opts)
			if err != nil {
				return err
			}
			if res.UniqueSkippedAsDuplicate {
				return errors.New("fresh key skipped as duplicate")
			}
			if err := tx.Commit(ctx); err != nil {
				return err
			}
			select {
			case err := <-done:
				return err
			case <-time.After(30 * time.Second):
				waiters.Delete(key)
				return errors.New("river job not completed within 30s")
			}
		}, func() {
			stopCtx, stop := context.WithTimeout(context.Background(), 10*time.Second)
			defer stop()
			_ = client.Stop(stopCtx)
			cancel()
		}, nil
}}
