// Command rocketrides is a small ride-hailing payment service in the spirit
// of Brandur Leach's Rocket Rides, built on atomicphase: POST /rides creates
// a ride, charges the card at the payment provider and stages a receipt, each
// exactly once however often clients retry and wherever the process dies.
// It runs its own recovery.Resumer (finishing rides whose client gave up) and
// outbox.Relay (publishing receipts to NATS JetStream) in-process.
//
//	go run ./examples/rocketrides -database-url "$DATABASE_URL" -provider-url http://127.0.0.1:8091
//
// Receipts go to NATS_URL when set, otherwise to an embedded NATS server.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/examples/rocketrides/rides"
	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/natspub"
	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	fs := flag.NewFlagSet("rocketrides", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:8090", "listen address")
	dbURL := fs.String("database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL (env DATABASE_URL)")
	providerURL := fs.String("provider-url", envOr("PROVIDER_URL", "http://127.0.0.1:8091"), "payment provider URL (env PROVIDER_URL)")
	natsURL := fs.String("nats-url", os.Getenv("NATS_URL"), "NATS URL for receipts (env NATS_URL); empty starts an embedded server")
	resumeDelay := fs.Duration("resume-delay", time.Minute, "how long an abandoned ride waits before the in-process resumer finishes it")
	resumeEvery := fs.Duration("resume-interval", 10*time.Second, "how often the in-process resumer looks for abandoned rides")
	providerTimeout := fs.Duration("provider-timeout", 2*time.Second, "timeout of one call to the provider")
	lease := fs.Duration("lease", 30*time.Second, "idempotency key lease")
	stream := fs.String("stream", rides.StreamName, "JetStream stream for receipts")
	prefix := fs.String("subject-prefix", "", "prefix of receipt subjects (prefix + ride.receipt)")
	crashAfter := fs.String("crash-after-phase", "", "fault injection: SIGKILL this process after the named phase returns")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if *dbURL == "" {
		logger.Error("rocketrides: -database-url or DATABASE_URL is required")
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	o := options{addr: *addr, dbURL: *dbURL, providerURL: *providerURL, natsURL: *natsURL, resumeDelay: *resumeDelay,
		resumeEvery: *resumeEvery, providerTimeout: *providerTimeout, lease: *lease, stream: *stream, prefix: *prefix, crashAfter: *crashAfter}
	if err := serve(ctx, logger, o); err != nil {
		logger.Error("rocketrides: " + err.Error())
		return 1
	}
	return 0
}

type options struct {
	addr, dbURL, providerURL, natsURL string
	resumeDelay, resumeEvery          time.Duration
	providerTimeout, lease            time.Duration
	stream, prefix, crashAfter        string
}

func serve(ctx context.Context, logger *slog.Logger, o options) error {
	natsURL := o.natsURL
	poolCfg, err := pgxpool.ParseConfig(o.dbURL)
	if err != nil {
		return err
	}
	poolCfg.MaxConns = 32 // 50 concurrent clients in the demo; the default is 4 on 2 cores
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, rides.Schema); err != nil {
		return fmt.Errorf("rides schema: %w", err)
	}

	if natsURL == "" {
		embedded, err := rides.StartEmbeddedNATS()
		if err != nil {
			return err
		}
		defer embedded.Stop()
		natsURL = embedded.URL()
		logger.Info("embedded NATS started", "url", natsURL)
	}
	nc, err := nats.Connect(natsURL, nats.MaxReconnects(-1))
	if err != nil {
		return fmt.Errorf("nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	if _, err := rides.EnsureStream(ctx, js, o.stream, o.prefix); err != nil {
		return fmt.Errorf("stream: %w", err)
	}

	provider := rides.Provider{URL: strings.TrimRight(o.providerURL, "/"), Client: &http.Client{Timeout: o.providerTimeout}}
	wf := rides.NewWorkflow(provider, o.crashAfter)
	registry := txn.NewRegistry()
	if err := registry.Register(wf); err != nil {
		return err
	}
	runner, err := txn.New(pool, &txn.Config{Workflows: registry, Logger: logger, LeaseDuration: o.lease})
	if err != nil {
		return err
	}
	mw, err := httpidem.New(runner, &httpidem.Config{Logger: logger, Scope: bearerUser})
	if err != nil {
		return err
	}

	pub, err := natspub.New(js, &natspub.Config{SubjectPrefix: o.prefix, Streams: []string{o.stream}})
	if err != nil {
		return err
	}
	relay, err := outbox.New(pool, pub, &outbox.Config{Logger: logger})
	if err != nil {
		return err
	}
	if err := relay.Start(ctx); err != nil {
		return err
	}
	defer relay.Stop()
	resumer, err := recovery.New(runner, &recovery.Config{ResumeDelay: o.resumeDelay, Interval: o.resumeEvery})
	if err != nil {
		return err
	}
	if err := resumer.Start(ctx); err != nil {
		return err
	}
	defer resumer.Stop()

	srv := &http.Server{Handler: rides.Handler(pool, mw, wf), ReadHeaderTimeout: 5 * time.Second}
	ln, err := net.Listen("tcp", o.addr)
	if err != nil {
		return err
	}
	logger.Info("rocketrides listening", "addr", ln.Addr().String(), "provider_url", o.providerURL)
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

// bearerUser takes the user from "Authorization: Bearer <user>": the
// example's stand-in for real authentication. The user is the key's scope.
func bearerUser(r *http.Request) (string, error) {
	user, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || user == "" || len(user) > 100 {
		return "", errors.New("missing bearer user")
	}
	return user, nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
