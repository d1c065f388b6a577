package rides

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
)

// StreamName is the default JetStream stream receipts are published to.
const StreamName = "RIDES"

// DuplicateWindow is the receipts stream's duplicate window: longer than
// the republish interval of a relay with the default settings
// (RetryMaxDelay 10m + 2 x PublishTimeout 10s + PollInterval 1s = 10m21s),
// so that every republish of a receipt (same Nats-Msg-Id) is dropped. The
// relay's publisher refuses to start with a shorter one.
const DuplicateWindow = 15 * time.Minute

// EnsureStream creates (or updates) the receipts stream for subjects
// prefix + "ride.>", with a duplicate window that makes republishes of the
// same outbox message (same Nats-Msg-Id) land once.
func EnsureStream(ctx context.Context, js jetstream.JetStream, name, prefix string) (jetstream.Stream, error) {
	return js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:       name,
		Subjects:   []string{prefix + "ride.>"},
		Storage:    jetstream.FileStorage,
		Duplicates: DuplicateWindow,
	})
}

// EmbeddedNATS is an in-process NATS server with JetStream, for running the
// example without a NATS installation.
type EmbeddedNATS struct {
	srv *server.Server
	dir string
}

// StartEmbeddedNATS starts a NATS server with JetStream on a random loopback port.
func StartEmbeddedNATS() (*EmbeddedNATS, error) {
	dir, err := os.MkdirTemp("", "rocketrides-nats")
	if err != nil {
		return nil, err
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoSigs: true})
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("rides: embedded nats: %w", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		_ = os.RemoveAll(dir)
		return nil, errors.New("rides: embedded nats did not start")
	}
	return &EmbeddedNATS{srv: srv, dir: dir}, nil
}

// URL is the server's client URL.
func (e *EmbeddedNATS) URL() string { return e.srv.ClientURL() }

// Stop shuts the server down and removes its store.
func (e *EmbeddedNATS) Stop() {
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
	_ = os.RemoveAll(e.dir)
}
