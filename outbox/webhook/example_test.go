package webhook_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/webhook"
)

// Deliver each outbox message to a partner's endpoint as a signed POST. The
// partner here is a test server that checks the signature with Verify.
func ExampleNew() {
	db, done := pgtest.Example(true) // a migrated schema of its own
	defer done()
	ctx := context.Background()
	secret := webhook.NewSecret() // "whsec_...", shared with the partner
	partner := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if err := webhook.Verify(r.Header, body, time.Now(), secret); err != nil {
			http.Error(w, "bad signature", http.StatusUnauthorized)
			return
		}
		fmt.Printf("partner got %s %s\n", r.Header.Get(webhook.HeaderWebhookTopic), body)
		w.WriteHeader(http.StatusNoContent)
	}))
	defer partner.Close()

	pub, err := webhook.New(webhook.Config{URL: partner.URL + "/hooks/orders", Secrets: []string{secret}})
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.New(db.Pool, pub, nil) // a service runs relay.Start(ctx)
	if err != nil {
		log.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, outbox.Message{Topic: "orders.created", Payload: []byte(`{"id":"ord_1"}`)})
	}); err != nil {
		log.Fatal(err)
	}
	n, err := relay.RunOnce(ctx)
	fmt.Println("published:", n, err)
	// Output:
	// partner got orders.created {"id":"ord_1"}
	// published: 1 <nil>
}

// A receiver checks the signature over the raw body before trusting the
// call, and processes each webhook-id once.
func ExampleVerify() {
	secret := os.Getenv("WEBHOOK_SECRET")
	handler := func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err != nil {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		if err := webhook.Verify(r.Header, body, time.Now(), secret); err != nil {
			http.Error(w, "bad signature", http.StatusUnauthorized) // 4xx: the sender dead-letters
			return
		}
		// Process once per r.Header.Get(webhook.HeaderWebhookID): record the
		// id in the transaction that applies the call's effects.
		w.WriteHeader(http.StatusNoContent)
	}
	_ = handler

	// The Standard Webhooks specification's example call.
	h := http.Header{}
	h.Set("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek")
	h.Set("webhook-timestamp", "1614265330")
	h.Set("webhook-signature", "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=")
	sent := time.Unix(1614265330, 0)
	fmt.Println(webhook.Verify(h, []byte(`{"test": 2432232314}`), sent, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"))
	fmt.Println(webhook.Verify(h, []byte(`{"test": 1}`), sent, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"))
	// Output:
	// <nil>
	// webhook: invalid signature: no signature matches
}

// A receiver without this package verifies a call with the standard
// library alone: the README's ten-line verifier.
func ExampleVerify_standardLibrary() {
	verify := func(h http.Header, body []byte, secret string, now time.Time) bool {
		key, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
		ts, err := strconv.ParseInt(h.Get("webhook-timestamp"), 10, 64)
		if err != nil || now.Sub(time.Unix(ts, 0)).Abs() > 5*time.Minute {
			return false // not a timestamp, or a replay
		}
		mac := hmac.New(sha256.New, key)
		fmt.Fprintf(mac, "%s.%s.%s", h.Get("webhook-id"), h.Get("webhook-timestamp"), body)
		want := "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil))
		for _, sig := range strings.Fields(h.Get("webhook-signature")) { // one per secret
			if hmac.Equal([]byte(sig), []byte(want)) {
				return true
			}
		}
		return false
	}

	h := http.Header{}
	h.Set("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek")
	h.Set("webhook-timestamp", "1614265330")
	h.Set("webhook-signature", "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=")
	sent := time.Unix(1614265330, 0)
	fmt.Println(verify(h, []byte(`{"test": 2432232314}`), "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", sent))
	fmt.Println(verify(h, []byte(`{"test": 2432232314}`), "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", sent.Add(time.Hour)))
	// Output:
	// true
	// false
}
