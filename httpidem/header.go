package httpidem

import (
	"errors"
	"fmt"
	"strings"

	"github.com/atomicphase/atomicphase/txn"
)

// HeaderName is the request header carrying the idempotency key.
const HeaderName = "Idempotency-Key"

// ReplayedHeader marks a response replayed from storage.
const ReplayedHeader = "Idempotent-Replayed"

// ParseKey parses an Idempotency-Key header value: an RFC 8941 sf-string
// ("8e03978e-40d5-43e8-bc93-6894a57f9324", with \" and \\ escapes) or a bare
// token (tchar, ":" and "/"), surrounded by optional whitespace. The key
// must then satisfy txn.ValidateKey. Errors wrap ErrInvalidHeader.
func ParseKey(v string) (string, error) {
	v = strings.Trim(v, " \t")
	if v == "" {
		return "", fmt.Errorf("%w: empty", ErrInvalidHeader)
	}
	var key string
	if v[0] == '"' {
		var b strings.Builder
		i := 1
		for ; i < len(v); i++ {
			c := v[i]
			if c == '\\' {
				i++
				if i == len(v) || (v[i] != '"' && v[i] != '\\') {
					return "", fmt.Errorf("%w: bad escape in sf-string", ErrInvalidHeader)
				}
				b.WriteByte(v[i])
				continue
			}
			if c == '"' {
				break
			}
			if c < 0x20 || c > 0x7e {
				return "", fmt.Errorf("%w: byte 0x%02x in sf-string", ErrInvalidHeader, c)
			}
			b.WriteByte(c)
		}
		if i != len(v)-1 {
			return "", fmt.Errorf("%w: sf-string not closed, or data after it", ErrInvalidHeader)
		}
		key = b.String()
	} else {
		for i := 0; i < len(v); i++ {
			if !isTokenChar(v[i]) {
				return "", fmt.Errorf("%w: byte %q not allowed in a bare key (quote it as an sf-string)", ErrInvalidHeader, v[i])
			}
		}
		key = v
	}
	var reqErr *txn.RequestError
	if err := txn.ValidateKey(key); errors.As(err, &reqErr) {
		return "", fmt.Errorf("%w: the key is %s", ErrInvalidHeader, reqErr.Reason)
	}
	return key, nil
}

// isTokenChar reports RFC 9110 tchar plus ":" and "/", as sf-token allows.
func isTokenChar(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~:/", c) >= 0
}
