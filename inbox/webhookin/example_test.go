package webhookin_test

import (
	"context"
	"fmt"
	"log"
	"net/http/httptest"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/inbox/webhookin"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/webhook"
)

// Receive signed webhooks exactly once. Here the sender is atomicphase's
// own webhook publisher, delivering one message twice (a retry after a
// lost answer): both calls are answered 2xx, the handler runs once.
func Example() {
	db, done := pgtest.Example(true) // a migrated schema of its own
	defer done()
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE events (id text NOT NULL, topic text NOT NULL, body bytea NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	secret := webhook.NewSecret() // shared with the sender

	in, err := inbox.New(db.Pool, &inbox.Config{Consumer: "webhooks"})
	if err != nil {
		log.Fatal(err)
	}
	h, err := webhookin.New(in, func(ctx context.Context, tx pgx.Tx, req webhookin.Request) error {
		_, err := tx.Exec(ctx, `INSERT INTO events (id, topic, body) VALUES ($1, $2, $3)`, req.ID, req.Topic, req.Body)
		return err
	}, &webhookin.Config{Secrets: []string{secret}})
	if err != nil {
		log.Fatal(err)
	}
	srv := httptest.NewServer(h) // mux.Handle("POST /webhooks", h) in a service
	defer srv.Close()

	pub, err := webhook.New(webhook.Config{URL: srv.URL, Secrets: []string{secret}})
	if err != nil {
		log.Fatal(err)
	}
	msg := outbox.Envelope{ID: uuid.Must(uuid.NewV7()), Topic: "ride.receipt", Payload: []byte(`{"ride_id":42}`), Attempt: 1}
	for range 2 {
		res := outbox.NewResults(1)
		pub.Publish(ctx, []outbox.Envelope{msg}, res)
		fmt.Println("answered 2xx:", res.Reported(0) && res.Err(0) == nil)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM events`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("events:", n)
	fmt.Printf("%+v\n", h.Stats())
	// Output:
	// answered 2xx: true
	// answered 2xx: true
	// events: 1
	// {Handled:1 Duplicates:1 Rejected:0 Failed:0 Unavailable:0}
}
