package outbox_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/outbox"
)

// Stage a message in the transaction that records the order: it is
// published if and only if the order commits.
func ExampleEnqueue() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO orders (id, total_cents) VALUES ($1, $2)", "ord_1", 4200); err != nil {
			return err
		}
		return outbox.Enqueue(ctx, tx, outbox.Message{
			Topic:       "orders.created",
			OrderingKey: "order:ord_1", // this order's messages stay in commit order
			Payload:     []byte(`{"id":"ord_1","total_cents":4200}`),
			Headers:     map[string]string{"Content-Type": "application/json"},
		})
	})
	if err != nil {
		log.Fatal(err)
	}
}

// An in-process publisher, for tests or for handing messages to code in the
// same process.
func ExamplePublisherFunc() {
	pub := outbox.PublisherFunc(func(ctx context.Context, msg outbox.Envelope) error {
		fmt.Printf("message %s on %s, attempt %d\n", msg.ID, msg.Topic, msg.Attempt)
		return nil
	})
	// A relay calls Publish itself; outside one, Results collects the outcomes.
	res := outbox.NewResults(1)
	id := uuid.MustParse("01935f5e-7a8b-7c3d-9e4f-0123456789ab")
	pub.Publish(context.Background(), []outbox.Envelope{{ID: id, Topic: "orders.created", Attempt: 1}}, res)
	fmt.Println(res.Reported(0), res.Err(0))
	// Output:
	// message 01935f5e-7a8b-7c3d-9e4f-0123456789ab on orders.created, attempt 1
	// true <nil>
}
