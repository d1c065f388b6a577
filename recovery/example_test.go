package recovery_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

// A service resumes its own stalled workflows by running a Resumer
// in-process with the registry its request path uses.
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
	// The request path: runner.RunWorkflow(ctx, key, createRide).
	// Recovery: the same registry, so the same code resumes stalled keys.
	resumer, err := recovery.New(pool, registry, &recovery.Config{Logger: logger})
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
	resumer, err := recovery.New(pool, txn.NewRegistry(), nil)
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

// MaxAge must stay under the payment providers' 24-hour idempotency window,
// so New rejects longer values.
func ExampleNew_maxAgeLimit() {
	pool, err := pgxpool.New(context.Background(), "postgres://localhost/none") // connects lazily
	if err != nil {
		return
	}
	defer pool.Close()
	_, err = recovery.New(pool, txn.NewRegistry(), &recovery.Config{MaxAge: 36 * time.Hour})
	fmt.Println(err)
	// Output:
	// recovery: new: recovery: invalid config: MaxAge 36h0m0s must be shorter than 24h0m0s, the payment providers' idempotency window
}
