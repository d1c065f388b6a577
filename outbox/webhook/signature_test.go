package webhook_test

import (
	"context"
	"encoding/base64"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/outboxtest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/webhook"
)

// The Standard Webhooks specification's example: this secret, id,
// timestamp and body sign as this v1 signature.
const (
	specSecret    = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	specID        = "msg_p5jXN8AQM9LWM0D4loKWxJek"
	specTimestamp = 1614265330
	specBody      = `{"test": 2432232314}`
	specSignature = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
)

func specHeader(signature string) http.Header {
	h := http.Header{}
	h.Set("webhook-id", specID)
	h.Set("webhook-timestamp", strconv.Itoa(specTimestamp))
	h.Set("webhook-signature", signature)
	return h
}

// Verify accepts the specification's example and exactly the calls signed
// with one of its secrets over this id, timestamp and body, within the
// timestamp tolerance.
func TestVerify(t *testing.T) {
	t.Parallel()
	at := time.Unix(specTimestamp, 0)
	body := []byte(specBody)
	other := webhook.NewSecret()

	require.NoError(t, webhook.Verify(specHeader(specSignature), body, at, specSecret))
	require.NoError(t, webhook.Verify(specHeader(specSignature), body, at.Add(webhook.Tolerance), specSecret), "at the edge of the tolerance")
	require.NoError(t, webhook.Verify(specHeader("v1,AAAA "+specSignature), body, at, specSecret), "any listed signature")
	require.NoError(t, webhook.Verify(specHeader(specSignature), body, at, other, specSecret), "any of the secrets")

	for name, tc := range map[string]struct {
		header http.Header
		body   []byte
		now    time.Time
	}{
		"tampered body":        {specHeader(specSignature), []byte(`{"test": 2432232315}`), at},
		"another id":           {func() http.Header { h := specHeader(specSignature); h.Set("webhook-id", "msg_other"); return h }(), body, at},
		"another timestamp":    {func() http.Header { h := specHeader(specSignature); h.Set("webhook-timestamp", "1614265331"); return h }(), body, at},
		"too old":              {specHeader(specSignature), body, at.Add(webhook.Tolerance + time.Second)},
		"too new":              {specHeader(specSignature), body, at.Add(-webhook.Tolerance - time.Second)},
		"no v1 signature":      {specHeader("v2," + specSignature[3:]), body, at},
		"no signature header":  {func() http.Header { h := specHeader(specSignature); h.Del("webhook-signature"); return h }(), body, at},
		"no id header":         {func() http.Header { h := specHeader(specSignature); h.Del("webhook-id"); return h }(), body, at},
		"timestamp not a unix": {func() http.Header { h := specHeader(specSignature); h.Set("webhook-timestamp", "17e8"); return h }(), body, at},
		"old hex format":       {specHeader("v1=830c4cf52b04f8e3d325b1fed9882ad4b2666513"), body, at},
	} {
		require.ErrorIs(t, webhook.Verify(tc.header, tc.body, tc.now, specSecret), webhook.ErrInvalidSignature, name)
	}
	require.ErrorIs(t, webhook.Verify(specHeader(specSignature), body, at, other), webhook.ErrInvalidSignature, "wrong secret")
	require.ErrorIs(t, webhook.Verify(specHeader(specSignature), body, at, "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), outbox.ErrInvalidConfig, "secret without whsec_")
	require.ErrorIs(t, webhook.Verify(specHeader(specSignature), body, at), outbox.ErrInvalidConfig, "no secret")
}

// NewSecret makes secrets in the specification's form, which the reference
// library reads.
func TestNewSecret(t *testing.T) {
	t.Parallel()
	a, b := webhook.NewSecret(), webhook.NewSecret()
	require.NotEqual(t, a, b)
	key, err := base64.StdEncoding.DecodeString(a[len(webhook.SecretPrefix):])
	require.NoError(t, err)
	require.Len(t, key, 32)
	_, err = standardwebhooks.NewWebhook(a)
	require.NoError(t, err)
}

// While a secret is rotated the publisher signs every call with all of its
// secrets: receivers that know only the old one, only the new one, or both,
// all accept the call, with the reference library and with Verify.
func TestWebhookSignsWithEverySecretDuringRotation(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	oldSecret, newSecret := webhook.NewSecret(), webhook.NewSecret()
	var (
		mu     sync.Mutex
		errs   = map[string]error{}
		header http.Header
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		header = r.Header.Clone()
		for name, secret := range map[string]string{"old": oldSecret, "new": newSecret} {
			reference, err := standardwebhooks.NewWebhook(secret)
			if err != nil {
				errs["reference "+name] = err
				continue
			}
			errs["reference "+name] = reference.Verify(body, r.Header)
			errs["Verify "+name] = webhook.Verify(r.Header, body, time.Now(), secret)
		}
		errs["Verify both"] = webhook.Verify(r.Header, body, time.Now(), newSecret, oldSecret)
		errs["Verify another"] = webhook.Verify(r.Header, body, time.Now(), webhook.NewSecret())
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(srv.Close)
	pub, err := webhook.New(webhook.Config{URL: srv.URL, Secrets: []string{oldSecret, newSecret}})
	require.NoError(t, err)
	outboxtest.Enqueue(t, d.Pool, outbox.Message{Topic: "t", Payload: []byte(`{"rotating":true}`)})
	require.Equal(t, 1, outboxtest.Drain(t, outboxtest.NewRelay(t, d.Pool, pub, outbox.Config{})))

	mu.Lock()
	defer mu.Unlock()
	for _, name := range []string{"reference old", "reference new", "Verify old", "Verify new", "Verify both"} {
		require.NoError(t, errs[name], name)
	}
	require.ErrorIs(t, errs["Verify another"], webhook.ErrInvalidSignature)
	var id string
	require.NoError(t, d.Pool.QueryRow(context.Background(), "SELECT message_id::text FROM outbox_messages").Scan(&id))
	require.Equal(t, id, header.Get("webhook-id"))
	require.Regexp(t, `^v1,[A-Za-z0-9+/]{43}= v1,[A-Za-z0-9+/]{43}=$`, header.Get("webhook-signature"))
	ts, err := strconv.ParseInt(header.Get("webhook-timestamp"), 10, 64)
	require.NoError(t, err)
	require.InDelta(t, time.Now().Unix(), ts, 300)
}
