package webhook

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Signatures follow the Standard Webhooks specification
// (https://www.standardwebhooks.com): a call carries webhook-id,
// webhook-timestamp and webhook-signature, and the signature is
//
//	v1,<base64(HMAC-SHA256(key, webhook-id + "." + webhook-timestamp + "." + body))>
//
// keyed with the secret's bytes. A secret is written "whsec_" followed by
// the standard base64 of 24 to 64 random bytes. Any Standard Webhooks
// verifier (its libraries exist for most languages) checks our calls.

const (
	// SecretPrefix starts every secret.
	SecretPrefix = "whsec_"

	// Tolerance is how far a call's timestamp may be from the receiver's
	// clock for Verify to accept it, as the specification recommends.
	Tolerance = 5 * time.Minute

	minSecretBytes = 24
	maxSecretBytes = 64
)

// NewSecret returns a new random secret, "whsec_" and the base64 of 32
// random bytes, to share with a receiver.
func NewSecret() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // never fails: crypto/rand aborts the process instead
	return SecretPrefix + base64.StdEncoding.EncodeToString(b)
}

// parseSecret returns the key bytes of a "whsec_<base64>" secret.
func parseSecret(secret string) ([]byte, error) {
	enc, ok := strings.CutPrefix(secret, SecretPrefix)
	if !ok {
		return nil, fmt.Errorf("secret does not start with %q", SecretPrefix)
	}
	key, err := base64.StdEncoding.DecodeString(enc)
	if err != nil {
		return nil, fmt.Errorf("secret is not %q and standard base64", SecretPrefix)
	}
	if len(key) < minSecretBytes || len(key) > maxSecretBytes {
		return nil, fmt.Errorf("secret holds %d bytes, not %d to %d", len(key), minSecretBytes, maxSecretBytes)
	}
	return key, nil
}

// signature returns the v1 signature of a call, without the "v1," prefix.
func signature(key []byte, id, timestamp string, body []byte) string {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(id))
	mac.Write([]byte{'.'})
	mac.Write([]byte(timestamp))
	mac.Write([]byte{'.'})
	mac.Write(body)
	return base64.StdEncoding.EncodeToString(mac.Sum(nil))
}

// signatureHeader returns the webhook-signature value: one v1 signature per
// key, separated by spaces, so that a receiver that knows any of the
// secrets (old or new, while they are rotated) accepts the call.
func signatureHeader(keys [][]byte, id, timestamp string, body []byte) string {
	sigs := make([]string, len(keys))
	for i, key := range keys {
		sigs[i] = "v1," + signature(key, id, timestamp, body)
	}
	return strings.Join(sigs, " ")
}

// Verify checks a webhook call for a receiver, as the Standard Webhooks
// specification describes. header holds the call's headers, body its raw
// body, now the receiver's clock, and secrets the "whsec_" secrets it
// accepts (several while one is rotated). Verify returns nil when
// webhook-signature holds a v1 signature of webhook-id, webhook-timestamp
// and body made with one of the secrets, and the timestamp is within
// Tolerance of now; otherwise an error matching ErrInvalidSignature. A
// malformed secret is an error matching ErrInvalidConfig. Signatures are
// compared in constant time.
//
// The signature proves the sender knows a secret and that the id,
// timestamp and body are unchanged; the timestamp check limits replays.
// Receivers still deduplicate on webhook-id (equally, Idempotency-Key),
// which repeats when a message is delivered again.
func Verify(header http.Header, body []byte, now time.Time, secrets ...string) error {
	if len(secrets) == 0 {
		return fmt.Errorf("%w: no secret", ErrInvalidConfig)
	}
	keys := make([][]byte, len(secrets))
	for i, s := range secrets {
		key, err := parseSecret(s)
		if err != nil {
			return fmt.Errorf("%w: secret %d: %w", ErrInvalidConfig, i, err)
		}
		keys[i] = key
	}
	id := header.Get(HeaderWebhookID)
	timestamp := header.Get(HeaderWebhookTimestamp)
	sigs := header.Get(HeaderWebhookSignature)
	if id == "" || timestamp == "" || sigs == "" {
		return fmt.Errorf("%w: missing %s, %s or %s", ErrInvalidSignature,
			HeaderWebhookID, HeaderWebhookTimestamp, HeaderWebhookSignature)
	}
	sent, err := strconv.ParseInt(timestamp, 10, 64)
	if err != nil {
		return fmt.Errorf("%w: timestamp %q is not Unix seconds", ErrInvalidSignature, timestamp)
	}
	if skew := now.Sub(time.Unix(sent, 0)); skew > Tolerance || skew < -Tolerance {
		return fmt.Errorf("%w: timestamp %d is %v from now, more than %v", ErrInvalidSignature, sent, skew.Round(time.Second), Tolerance)
	}
	found := false
	for _, field := range strings.Fields(sigs) {
		sig, ok := strings.CutPrefix(field, "v1,")
		if !ok {
			continue
		}
		found = true
		for _, key := range keys {
			if hmac.Equal([]byte(sig), []byte(signature(key, id, timestamp, body))) {
				return nil
			}
		}
	}
	if !found {
		return fmt.Errorf("%w: no v1 signature", ErrInvalidSignature)
	}
	return fmt.Errorf("%w: no signature matches", ErrInvalidSignature)
}
