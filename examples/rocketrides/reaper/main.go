// Command reaper is rocketrides' own reaper: the generic cmd/reaper cannot
// resume rides (it has no user code), this one registers the create_ride
// workflow, so a cron run resumes abandoned rides from their recovery point
// (charging with the same derived key), fails what is past its limits, and
// cleans up expired keys.
//
//	DATABASE_URL=... PROVIDER_URL=http://127.0.0.1:8091 go run ./examples/rocketrides/reaper
package main

import (
	"context"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/cleanup"
	"github.com/atomicphase/atomicphase/examples/rocketrides/rides"
	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

func main() {
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := run(ctx, logger); err != nil {
		logger.Error("reaper: " + err.Error())
		os.Exit(1)
	}
}

func run(ctx context.Context, logger *slog.Logger) error {
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	registry := txn.NewRegistry()
	provider := rides.Provider{URL: os.Getenv("PROVIDER_URL"), Client: &http.Client{Timeout: 5 * time.Second}}
	if err := registry.Register(rides.NewWorkflow(provider, "")); err != nil {
		return err
	}
	// The service's runner settings (lease, MaxAge), so the reaper resumes
	// keys exactly as the service would.
	runner, err := txn.New(pool, &txn.Config{Workflows: registry, Logger: logger})
	if err != nil {
		return err
	}
	resumer, err := recovery.New(runner, nil)
	if err != nil {
		return err
	}
	cleaner, err := cleanup.New(pool, &cleanup.Config{Logger: logger})
	if err != nil {
		return err
	}
	rep, err := resumer.RunOnce(ctx)
	if err != nil {
		return err
	}
	del, err := cleaner.RunOnce(ctx)
	if err != nil {
		return err
	}
	logger.Info("reaper round", "resumed", rep.Resumed, "failed", rep.Failed(), "left", rep.Left,
		"keys_deleted", del.KeysDeleted, "outbox_deleted", del.OutboxDeleted, "inbox_deleted", del.InboxDeleted)
	return nil
}
