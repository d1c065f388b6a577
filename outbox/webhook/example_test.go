package webhook_test

import (
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

	"github.com/atomicphase/atomicphase/outbox/webhook"
)

// Deliver to a partner's HTTPS endpoint, signed with a shared secret.
func ExampleNew() {
	pub, err := webhook.New(webhook.Config{
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
func ExampleVerifySignature() {
	secret := []byte("whsec_example")
	handler := func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err != nil {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		ts := r.Header.Get(webhook.HeaderWebhookTimestamp)
		if err := webhook.VerifySignature(secret, ts, body, r.Header.Get(webhook.HeaderWebhookSignature)); err != nil {
			http.Error(w, "bad signature", http.StatusUnauthorized) // 4xx: the sender dead-letters
			return
		}
		if sent, err := strconv.ParseInt(ts, 10, 64); err != nil || time.Since(time.Unix(sent, 0)).Abs() > 5*time.Minute {
			http.Error(w, "stale", http.StatusBadRequest)
			return
		}
		// Process once per r.Header.Get(webhook.HeaderIdempotencyKey).
		w.WriteHeader(http.StatusNoContent)
	}
	_ = handler

	// What the publisher sends, computed by hand:
	body := []byte(`{"id":"ord_1"}`)
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte("1700000000." + string(body)))
	header := "v1=" + hex.EncodeToString(mac.Sum(nil))
	fmt.Println(webhook.VerifySignature(secret, "1700000000", body, header))
	fmt.Println(webhook.VerifySignature(secret, "1700000000", []byte(`{"id":"ord_2"}`), header))
	// Output:
	// <nil>
	// webhook: invalid signature: signature does not match
}
