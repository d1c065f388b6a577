package natsin_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/inbox/natsin"
	"github.com/atomicphase/atomicphase/internal/outboxtest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// Consume a JetStream stream exactly once: each message's handler runs in
// the inbox's transaction, and the message is acknowledged after the
// commit. The consumer must acknowledge explicitly and bound MaxDeliver,
// so that the inbox's Retention covers every redelivery.
func Example() {
	db, done := pgtest.Example(true) // a migrated schema of its own
	defer done()
	natsURL, stop := outboxtest.ExampleNATS() // a JetStream server of its own
	defer stop()
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE receipts (message_id text NOT NULL, body text NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	nc, err := nats.Connect(natsURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: "RIDES", Subjects: []string{"ride.>"}, Duplicates: 15 * time.Minute,
	}); err != nil {
		log.Fatal(err)
	}
	if _, err := js.CreateOrUpdateConsumer(ctx, "RIDES", jetstream.ConsumerConfig{
		Durable: "receipts", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second, MaxDeliver: 10,
	}); err != nil {
		log.Fatal(err)
	}
	// The outbox's NATS publisher sets Nats-Msg-Id to the message's id.
	m := nats.NewMsg("ride.receipt")
	m.Header.Set(jetstream.MsgIDHeader, "0193b1c2-7d3e-7a10-8b2c-1f2e3d4c5b6a")
	m.Data = []byte(`{"ride_id":42}`)
	if _, err := js.PublishMsg(ctx, m); err != nil {
		log.Fatal(err)
	}

	in, err := inbox.New(db.Pool, &inbox.Config{Consumer: "receipts"})
	if err != nil {
		log.Fatal(err)
	}
	consumer, err := natsin.New(in, js, func(ctx context.Context, tx pgx.Tx, msg natsin.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO receipts (message_id, body) VALUES ($1, $2)`, msg.ID, msg.Data)
		return err
	}, &natsin.Config{Stream: "RIDES", Consumer: "receipts", FetchWait: time.Second})
	if err != nil {
		log.Fatal(err)
	}
	// A service runs consumer.Start(ctx) and, on shutdown, consumer.Stop().
	n, err := consumer.RunOnce(ctx)
	fmt.Println("received:", n, err)
	fmt.Printf("%+v\n", consumer.Stats())

	var body string
	if err := db.Pool.QueryRow(ctx, `SELECT body FROM receipts`).Scan(&body); err != nil {
		log.Fatal(err)
	}
	fmt.Println(body)
	// Output:
	// received: 1 <nil>
	// {Acked:1 Duplicates:0 Failed:0 DeadLettered:0 Rejected:0 AckErrors:0 Unavailable:0}
	// {"ride_id":42}
}
