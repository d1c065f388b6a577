// Command receipts is the rocketrides receipts service: it consumes the
// ride.receipt messages the ride service relays to NATS JetStream and writes
// one row per ride, exactly once, through atomicphase's inbox: each message
// is handled in a transaction that also records its id, and acknowledged
// only after that transaction committed, so a redelivery (after a crash
// between the commit and the acknowledgement, or a lost acknowledgement) is
// acknowledged without writing a second row.
//
//	go run ./examples/rocketrides/receipts -database-url "$DATABASE_URL" -nats-url "$NATS_URL"
//
// GET /healthz answers once the consumer runs.
package main

import (
	"context"
	"errors"
	"flag"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/examples/rocketrides/rides"
	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/inbox/natsin"
	"github.com/atomicphase/atomicphase/migrations"
)

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	fs := flag.NewFlagSet("receipts", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:8092", "listen address (GET /healthz)")
	dbURL := fs.String("database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL (env DATABASE_URL)")
	natsURL := fs.String("nats-url", os.Getenv("NATS_URL"), "NATS URL (env NATS_URL)")
	stream := fs.String("stream", rides.StreamName, "JetStream stream the receipts are published to")
	prefix := fs.String("subject-prefix", "", "prefix of receipt subjects (prefix + ride.receipt)")
	ackWait := fs.Duration("ack-wait", 30*time.Second, "how long JetStream waits for an acknowledgement before delivering a receipt again")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if *dbURL == "" || *natsURL == "" {
		logger.Error("receipts: -database-url (DATABASE_URL) and -nats-url (NATS_URL) are required")
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := serve(ctx, logger, *addr, *dbURL, *natsURL, *stream, *prefix, *ackWait); err != nil {
		logger.Error("receipts: " + err.Error())
		return 1
	}
	return 0
}

func serve(ctx context.Context, logger *slog.Logger, addr, dbURL, natsURL, stream, prefix string, ackWait time.Duration) error {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, rides.ReceiptsSchema); err != nil {
		return err
	}
	nc, err := nats.Connect(natsURL, nats.MaxReconnects(-1))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	if _, err := rides.EnsureStream(ctx, js, stream, prefix); err != nil {
		return err
	}
	if _, err := rides.EnsureReceiptsConsumer(ctx, js, stream, prefix, ackWait); err != nil {
		return err
	}
	in, err := inbox.New(pool, &inbox.Config{Consumer: rides.ReceiptsConsumer, Logger: logger, DuplicateLogLevel: slog.LevelDebug})
	if err != nil {
		return err
	}
	consumer, err := natsin.New(in, js, rides.HandleReceipt, &natsin.Config{Stream: stream, Consumer: rides.ReceiptsConsumer})
	if err != nil {
		return err
	}
	if err := consumer.Start(ctx); err != nil { // checks the consumer's redelivery horizon against the inbox's retention
		return err
	}
	defer func() {
		consumer.Stop()
		s := consumer.Stats()
		logger.Info("receipts: stopped", "acked", s.Acked, "duplicates", s.Duplicates, "dead_lettered", s.DeadLettered)
	}()

	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		if err := pool.Ping(r.Context()); err != nil {
			http.Error(w, "database unavailable", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	logger.Info("receipts listening", "addr", ln.Addr().String(), "stream", stream)
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
