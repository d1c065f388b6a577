package recovery_test

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

// A service resumes its own stalled workflows by running a Resumer
// in-process with the runner its request path uses: the same registry, the
// same lease and the same MaxAge.
func ExampleResumer_Start() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		logger.Error("connect", "error", err)
		return
	}
	defer pool.Close()

	createRide := txn.NewWorkflow("create_ride", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		// ... txn.Atomic and txn.Foreign phases ...
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			return txn.JSON(201, map[string]string{"status": "created"})
		})
	})
	registry := txn.NewRegistry()
	if err := registry.Register(createRide); err != nil {
		logger.Error("register", "error", err)
		return
	}
	runner, err := txn.New(pool, &txn.Config{Workflows: registry, Logger: logger})
	if err != nil {
		logger.Error("runner", "error", err)
		return
	}
	// The request path: runner.RunWorkflow(ctx, key, createRide).
	// Recovery: the same runner, so the same code resumes stalled keys.
	resumer, err := recovery.New(runner, nil)
	if err != nil {
		logger.Error("resumer", "error", err)
		return
	}
	if err := resumer.Start(ctx); err != nil {
		logger.Error("resumer", "error", err)
		return
	}
	defer resumer.Stop()

	<-ctx.Done() // serve requests until told to stop
}

// RunOnce runs a single round, for a cron job or an admin tool; DryRun
// reports what a round would do without changing anything.
func ExampleResumer_RunOnce() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return
	}
	defer pool.Close()
	runner, err := txn.New(pool, nil) // no workflows: it fails stalled keys it cannot resume
	if err != nil {
		return
	}
	resumer, err := recovery.New(runner, nil)
	if err != nil {
		return
	}
	report, err := resumer.RunOnce(ctx)
	if err != nil {
		slog.Error("recovery round failed", "error", err)
		return
	}
	slog.Info("recovery round", "resumed", report.Resumed, "failed", report.Failed(), "left", report.Left)
}
