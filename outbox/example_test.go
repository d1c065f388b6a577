package outbox_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strconv"
	"time"

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

// Deliver to a partner's HTTPS endpoint, signed with a shared secret.
func ExampleNewWebhookPublisher() {
	pub, err := outbox.NewWebhookPublisher(outbox.WebhookConfig{
		URL:     "https://partner.example/hooks/orders",
		Secret:  []byte(os.Getenv("WEBHOOK_SECRET")),
		Timeout: 5 * time.Second,
	})
	if err != nil {
		log.Fatal(err)
	}
	_ = pub // pass to outbox.New
}

// A receiver checks the signature over the raw body before trusting it, and
// deduplicates on Idempotency-Key.
func ExampleVerifyWebhookSignature() {
	secret := []byte("whsec_example")
	handler := func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err != nil {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		ts := r.Header.Get(outbox.HeaderWebhookTimestamp)
		if err := outbox.VerifyWebhookSignature(secret, ts, body, r.Header.Get(outbox.HeaderWebhookSignature)); err != nil {
			http.Error(w, "bad signature", http.StatusUnauthorized) // 4xx: the sender dead-letters
			return
		}
		if sent, err := strconv.ParseInt(ts, 10, 64); err != nil || time.Since(time.Unix(sent, 0)).Abs() > 5*time.Minute {
			http.Error(w, "stale", http.StatusBadRequest)
			return
		}
		// Process once per r.Header.Get(outbox.HeaderIdempotencyKey).
		w.WriteHeader(http.StatusNoContent)
	}
	_ = handler

	// What the publisher sends, computed by hand:
	body := []byte(`{"id":"ord_1"}`)
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte("1700000000." + string(body)))
	header := "v1=" + hex.EncodeToString(mac.Sum(nil))
	fmt.Println(outbox.VerifyWebhookSignature(secret, "1700000000", body, header))
	fmt.Println(outbox.VerifyWebhookSignature(secret, "1700000000", []byte(`{"id":"ord_2"}`), header))
	// Output:
	// <nil>
	// outbox: invalid webhook signature: signature does not match
}

// An in-process publisher, for tests or for handing messages to code in the
// same process.
func ExamplePublisherFunc() {
	pub := outbox.PublisherFunc(func(ctx context.Context, msg outbox.Envelope) error {
		fmt.Printf("message %d on %s, attempt %d\n", msg.ID, msg.Topic, msg.Attempt)
		return nil
	})
	errs := pub.Publish(context.Background(), []outbox.Envelope{{ID: 7, Topic: "orders.created", Attempt: 1}})
	fmt.Println(errs)
	// Output:
	// message 7 on orders.created, attempt 1
	// [<nil>]
}
