package outbox_test

import (
	"context"
	"fmt"
	"log"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
)

// Stage a message in the transaction that records the order: it is
// published if and only if the order commits. A relay then hands it to a
// publisher, here one in the same process.
func ExampleEnqueue() {
	db, done := pgtest.Example(true) // a migrated schema of its own
	defer done()
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, total_cents bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	placeOrder := func(id string, cents int64) error {
		return pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO orders (id, total_cents) VALUES ($1, $2)", id, cents); err != nil {
				return err
			}
			return outbox.Enqueue(ctx, tx, outbox.Message{
				Topic:       "orders.created",
				OrderingKey: "order:" + id, // this order's messages stay in commit order
				Payload:     fmt.Appendf(nil, `{"id":%q,"total_cents":%d}`, id, cents),
				Headers:     map[string]string{"Content-Type": "application/json"},
			})
		})
	}
	if err := placeOrder("ord_1", 4200); err != nil {
		log.Fatal(err)
	}
	// The same order again fails on its primary key: the transaction rolls
	// back, and its message with it.
	fmt.Println("duplicate order refused:", placeOrder("ord_1", 4200) != nil)

	relay, err := outbox.New(db.Pool, outbox.PublisherFunc(func(ctx context.Context, msg outbox.Envelope) error {
		fmt.Printf("publish %s %s (attempt %d)\n", msg.Topic, msg.Payload, msg.Attempt)
		return nil // acknowledged: marked published
	}), nil)
	if err != nil {
		log.Fatal(err)
	}
	for range 2 { // a service runs relay.Start(ctx) instead
		n, err := relay.RunOnce(ctx)
		fmt.Println("published:", n, err)
	}
	// Output:
	// duplicate order refused: true
	// publish orders.created {"id":"ord_1","total_cents":4200} (attempt 1)
	// published: 1 <nil>
	// published: 0 <nil>
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
