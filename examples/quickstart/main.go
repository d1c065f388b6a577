// Command quickstart shows atomicphase's guarantees in one run: the same
// charge request fired under one idempotency key from 20 goroutines and then
// retried 3 times executes exactly once, and a 3-phase workflow interrupted
// after its first phase is resumed by a retry without repeating anything.
//
// It connects to DATABASE_URL, or when that is unset starts a throwaway
// PostgreSQL cluster from the installed server binaries and removes it at exit.
//
//	go run ./examples/quickstart
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/pgcluster"
	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/txn"
)

func main() {
	if err := run(context.Background(), os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, out io.Writer) error {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		fmt.Fprintln(out, "DATABASE_URL is unset: starting a throwaway PostgreSQL cluster...")
		cluster, err := pgcluster.Start(ctx, pgcluster.Options{})
		if err != nil {
			return fmt.Errorf("no database: set DATABASE_URL or install PostgreSQL: %w", err)
		}
		defer cluster.Stop()
		url = cluster.ConnString("postgres")
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, chargesTable); err != nil {
		return err
	}

	registry := txn.NewRegistry()
	flow := newRideFlow()
	if err := registry.Register(flow.wf); err != nil {
		return err
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	runner, err := txn.New(pool, &txn.Config{Workflows: registry, Logger: quiet})
	if err != nil {
		return err
	}

	suffix := randomSuffix()
	failed := false

	// 1. One charge, 20 concurrent requests and 3 sequential retries.
	chargeKey := txn.Key{Scope: "customer_42", Value: "charge-" + suffix, Method: "POST", Path: "/charges",
		Params: []byte(`{"amount_cents": 2500, "currency": "eur"}`)}
	var executions, replays, inUse atomic.Int64
	charge := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		executions.Add(1)
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO quickstart_charges (idempotency_key, what, amount_cents)
			VALUES ($1, 'charge', 2500) RETURNING id`, chargeKey.Value).Scan(&id); err != nil {
			return txn.Response{}, err
		}
		time.Sleep(200 * time.Millisecond) // a slow endpoint: concurrent retries overlap
		return txn.JSON(201, map[string]any{"charge_id": id, "amount_cents": 2500})
	}
	tally := func(resp txn.Response, err error) {
		switch {
		case errors.Is(err, txn.ErrKeyInUse):
			inUse.Add(1)
		case err != nil:
			failed = true
			fmt.Fprintln(out, "  unexpected error:", err)
		case resp.Replayed:
			replays.Add(1)
		}
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := runner.Run(ctx, chargeKey, charge)
			mu.Lock()
			tally(resp, err)
			mu.Unlock()
		}()
	}
	wg.Wait()
	var last txn.Response
	for range 3 {
		last, err = runner.Run(ctx, chargeKey, charge)
		tally(last, err)
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM quickstart_charges WHERE idempotency_key = $1`, chargeKey.Value).Scan(&rows); err != nil {
		return err
	}
	fmt.Fprintf(out, "\ncharge under key %q: 23 requests (20 concurrent, then 3 retries)\n", chargeKey.Value)
	fmt.Fprintf(out, "  executions: %d   replays: %d   409 in use: %d   rows written: %d\n",
		executions.Load(), replays.Load(), inUse.Load(), rows)
	fmt.Fprintf(out, "  last retry got: %d %s (replayed=%v)\n", last.Status, last.Body, last.Replayed)
	if executions.Load() != 1 || rows != 1 {
		failed = true
	}

	// 2. A 3-phase workflow interrupted after phase 1, resumed by a retry.
	rideKey := txn.Key{Scope: "customer_42", Value: "ride-" + suffix, Method: "POST", Path: "/rides",
		Params: []byte(`{"amount_cents": 1800}`)}
	flow.interrupt.Store(true)
	_, err = runner.RunWorkflow(ctx, rideKey, flow.wf)
	fmt.Fprintf(out, "\nworkflow %q under key %q\n  attempt 1: %v\n", flow.wf.Name(), rideKey.Value, err)
	flow.interrupt.Store(false)
	resp, err := runner.RunWorkflow(ctx, rideKey, flow.wf)
	if err != nil {
		return fmt.Errorf("retry: %w", err)
	}
	fmt.Fprintf(out, "  attempt 2 (retry): %d %s\n", resp.Status, resp.Body)
	resp, err = runner.RunWorkflow(ctx, rideKey, flow.wf)
	if err != nil {
		return fmt.Errorf("second retry: %w", err)
	}
	fmt.Fprintf(out, "  attempt 3 (retry): %d, replayed=%v\n", resp.Status, resp.Replayed)
	fmt.Fprintf(out, "  phase executions: ride_created=%d charge_created=%d (provider calls) finish=%d\n",
		flow.phase1.Load(), flow.phase2.Load(), flow.phase3.Load())
	if flow.phase1.Load() != 1 || flow.phase2.Load() != 1 || flow.phase3.Load() != 1 || !resp.Replayed {
		failed = true
	}

	s := runner.Stats()
	fmt.Fprintf(out, "\nrunner stats: executed=%d replayed=%d in_use=%d reused=%d retries=%d released=%d\n",
		s.Executed, s.Replayed, s.InUse, s.Reused, s.Retries, s.Released)
	if failed {
		return errors.New("an exactly-once invariant did not hold")
	}
	fmt.Fprintln(out, "\nOK: every operation executed exactly once.")
	return nil
}

// chargesTable creates the table both demonstrations write to.
const chargesTable = `CREATE TABLE IF NOT EXISTS quickstart_charges (
	id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	idempotency_key text NOT NULL, what text NOT NULL, amount_cents bigint NOT NULL)`

type rideFlow struct {
	wf                     *txn.Workflow
	interrupt              atomic.Bool
	phase1, phase2, phase3 atomic.Int64
}

var errInterrupted = errors.New("interrupted after phase 1 (simulated crash)")

func newRideFlow() *rideFlow {
	f := &rideFlow{}
	f.wf = txn.NewWorkflow("quickstart_ride", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		scope, key := a.Key()
		rideID, err := txn.Atomic(ctx, a, "ride_created", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			f.phase1.Add(1)
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO quickstart_charges (idempotency_key, what, amount_cents)
				VALUES ($1, 'ride', 1800) RETURNING id`, scope+"/"+key).Scan(&id)
			return id, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		if f.interrupt.Load() {
			return txn.Response{}, errInterrupted
		}
		chargeID, err := txn.Foreign(ctx, a, "charge_created", func(ctx context.Context, foreignKey string) (string, error) {
			f.phase2.Add(1) // a payment provider would deduplicate on foreignKey
			return "ch_" + foreignKey[3:15], nil
		})
		if err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			f.phase3.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO quickstart_charges (idempotency_key, what, amount_cents)
				VALUES ($1, 'receipt', 1800)`, scope+"/"+key); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(201, map[string]any{"ride_id": rideID, "charge_id": chargeID})
		})
	})
	return f
}

func randomSuffix() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
