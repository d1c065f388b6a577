package natspub_test

import (
	"context"
	"log"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/natspub"
)

// Run a relay into NATS JetStream as a background service. The stream must
// exist and cover the subjects; its duplicate window makes republishes after
// a crash harmless.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	nc, err := nats.Connect(os.Getenv("NATS_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	// The duplicate window must cover the relay's republish interval:
	// RetryMaxDelay + 2 x PublishTimeout + PollInterval, 10m21s with the
	// defaults. Start refuses a shorter one.
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:       "ORDERS",
		Subjects:   []string{"orders.>"},
		Duplicates: 15 * time.Minute,
	}); err != nil {
		log.Fatal(err)
	}

	// Subject = topic, Nats-Msg-Id = the message's UUID.
	pub, err := natspub.New(js, &natspub.Config{Streams: []string{"ORDERS"}})
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.New(pool, pub, &outbox.Config{Logger: slog.Default()})
	if err != nil {
		log.Fatal(err)
	}
	if err := relay.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer relay.Stop() // on shutdown: sends nothing more, records what was acknowledged

	// ... serve requests ...
}
