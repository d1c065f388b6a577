package webhook_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/atomicphase/atomicphase/outbox/webhook"
)

// Deliver to a partner's HTTPS endpoint, signed with a shared secret
// ("whsec_..."; webhook.NewSecret makes one).
func ExampleNew() {
	pub, err := webhook.New(webhook.Config{
		URL:     "https://partner.example/hooks/orders",
		Secrets: []string{os.Getenv("WEBHOOK_SECRET")},
	})
	if err != nil {
		log.Fatal(err)
	}
	_ = pub // pass to outbox.New
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
