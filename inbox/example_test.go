package inbox_test

import (
	"context"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// Handle a message once, however often it is delivered: the message's id
// is recorded with the handler's writes, in one transaction, and a
// redelivery finds it. Acknowledge the message to the broker when Handle
// returns nil, whatever the outcome.
func ExampleInbox_Handle() {
	db, done := pgtest.Example(true) // a migrated schema of its own
	defer done()
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE receipts (ride_id bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	in, err := inbox.New(db.Pool, &inbox.Config{Consumer: "receipts"})
	if err != nil {
		log.Fatal(err)
	}
	writeReceipt := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO receipts (ride_id) VALUES (42)`)
		return err // an error rolls back, and the redelivery is handled
	}
	// The same message, delivered twice (the first acknowledgement was lost).
	for range 2 {
		out, err := in.Handle(ctx, "0193b1c2-7d3e-7a10-8b2c-1f2e3d4c5b6a", writeReceipt)
		fmt.Println(out, err)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM receipts`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("receipts:", n)

	_, err = in.Handle(ctx, "", writeReceipt)
	fmt.Println(err)
	// Output:
	// handled <nil>
	// duplicate <nil>
	// receipts: 1
	// inbox: handle: invalid message id: empty
}
