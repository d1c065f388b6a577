package natspub_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/internal/outboxtest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/natspub"
)

// Relay the outbox into NATS JetStream. The stream must exist and cover the
// subjects (a message's subject is its topic), and its duplicate window
// makes republishes after a crash harmless: Nats-Msg-Id is the message's
// UUID.
func Example() {
	db, done := pgtest.Example(true) // a migrated schema of its own
	defer done()
	natsURL, stop := outboxtest.ExampleNATS() // a JetStream server of its own
	defer stop()
	ctx := context.Background()

	nc, err := nats.Connect(natsURL)
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
	// defaults. The relay refuses to run with a shorter one.
	stream, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:       "ORDERS",
		Subjects:   []string{"orders.>"},
		Duplicates: 15 * time.Minute,
	})
	if err != nil {
		log.Fatal(err)
	}
	pub, err := natspub.New(js, &natspub.Config{Streams: []string{"ORDERS"}})
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.New(db.Pool, pub, nil)
	if err != nil {
		log.Fatal(err)
	}

	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, outbox.Message{Topic: "orders.created", Payload: []byte(`{"id":"ord_1"}`)})
	}); err != nil {
		log.Fatal(err)
	}
	// A service runs relay.Start(ctx) and, on shutdown, relay.Stop(), which
	// sends nothing more and records what was acknowledged.
	n, err := relay.RunOnce(ctx)
	fmt.Println("published:", n, err)

	msg, err := stream.GetLastMsgForSubject(ctx, "orders.created")
	if err != nil {
		log.Fatal(err)
	}
	var id uuid.UUID
	if err := db.Pool.QueryRow(ctx, `SELECT message_id FROM outbox_messages`).Scan(&id); err != nil {
		log.Fatal(err)
	}
	fmt.Println(msg.Subject, string(msg.Data), "Nats-Msg-Id is the message id:", msg.Header.Get(jetstream.MsgIDHeader) == id.String())
	// Output:
	// published: 1 <nil>
	// orders.created {"id":"ord_1"} Nats-Msg-Id is the message id: true
}
