package txn

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math"
	"strings"
	"unicode/utf8"
)

// MaxKeyLength is the longest idempotency key (and scope), in bytes.
const MaxKeyLength = 255

// Key names one operation: who asks (Scope), under which idempotency key
// (Value), and what the request is (Method, Path, Params). Two calls with the
// same Scope and Value are the same operation; their fingerprints must match.
type Key struct {
	// Scope is the owner of the key: account, user or tenant. Keys are only
	// unique within a scope, so one client never sees another's response.
	// May be empty; at most 255 bytes of valid UTF-8 without NUL.
	Scope string
	// Value is the client's idempotency key: 1 to 255 bytes of printable
	// ASCII (0x20 to 0x7E).
	Value string
	// Method is the request's method (e.g. "POST"); part of the fingerprint.
	Method string
	// Path is the request's route (e.g. "/rides"); part of the fingerprint.
	Path string
	// Params is the request's body as JSON; nil or empty means JSON null.
	// It is fingerprinted in canonical form (object keys sorted, insignificant
	// whitespace removed), so a retry that reorders keys still matches, and
	// it is stored so that recovery can resume the operation without the client.
	Params []byte
}

// ValidateKey checks an idempotency key value: 1 to 255 bytes of printable
// ASCII. It returns a *RequestError wrapping ErrInvalidKey.
func ValidateKey(value string) error {
	if value == "" {
		return &RequestError{Err: ErrInvalidKey, Field: "key", Reason: "empty"}
	}
	if len(value) > MaxKeyLength {
		return &RequestError{Err: ErrInvalidKey, Field: "key",
			Reason: fmt.Sprintf("%d bytes, at most %d allowed", len(value), MaxKeyLength)}
	}
	for i := 0; i < len(value); i++ {
		if c := value[i]; c < 0x20 || c > 0x7e {
			return &RequestError{Err: ErrInvalidKey, Field: "key",
				Reason: fmt.Sprintf("byte %d is 0x%02x, only printable ASCII is allowed", i, c)}
		}
	}
	return nil
}

// ValidateScope checks a key's scope: at most 255 bytes of valid UTF-8
// without NUL (it may be empty). It returns a *RequestError wrapping
// ErrInvalidKey.
func ValidateScope(scope string) error {
	switch {
	case len(scope) > MaxKeyLength:
		return &RequestError{Err: ErrInvalidKey, Field: "scope",
			Reason: fmt.Sprintf("%d bytes, at most %d allowed", len(scope), MaxKeyLength)}
	case !utf8.ValidString(scope):
		return &RequestError{Err: ErrInvalidKey, Field: "scope", Reason: "not valid UTF-8"}
	case strings.IndexByte(scope, 0) >= 0:
		return &RequestError{Err: ErrInvalidKey, Field: "scope", Reason: "contains NUL"}
	}
	return nil
}

// request is a validated Key with its canonical params and fingerprint.
type request struct {
	key         Key
	params      []byte // canonical JSON
	fingerprint []byte // sha256, 32 bytes
}

func prepare(k Key, maxParams int) (request, error) {
	if err := ValidateKey(k.Value); err != nil {
		return request{}, err
	}
	if err := ValidateScope(k.Scope); err != nil {
		return request{}, err
	}
	for _, f := range []struct{ name, v string }{{"method", k.Method}, {"path", k.Path}} {
		if len(f.v) > 2048 || !utf8.ValidString(f.v) || strings.IndexByte(f.v, 0) >= 0 {
			return request{}, &RequestError{Err: ErrInvalidRequest, Field: f.name,
				Reason: "must be at most 2048 bytes of UTF-8 without NUL"}
		}
	}
	if len(k.Params) > maxParams {
		return request{}, &RequestError{Err: ErrRequestTooLarge, Field: "params",
			Reason: fmt.Sprintf("%d bytes, at most %d allowed", len(k.Params), maxParams)}
	}
	params := k.Params
	if len(bytes.TrimSpace(params)) == 0 {
		params = []byte("null")
	}
	canon, err := canonicalJSON(params)
	if err != nil {
		return request{}, &RequestError{Err: ErrInvalidRequest, Field: "params", Reason: err.Error()}
	}
	return request{key: k, params: canon, fingerprint: fingerprint(k.Method, k.Path, canon)}, nil
}

// fingerprint hashes method, path and canonical params, each length-prefixed
// so that no two different triples hash the same input.
func fingerprint(method, path string, canonParams []byte) []byte {
	h := sha256.New()
	h.Write([]byte("atomicphase/fingerprint/v1\x00"))
	for _, part := range [][]byte{[]byte(method), []byte(path), canonParams} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	return h.Sum(nil)
}

// Limits of PostgreSQL's numeric type, in which jsonb stores numbers: a
// value is base-10000 digits with an int16 weight (the power of 10000 of
// its first digit) and at most 16383 decimal digits after the point.
const (
	numericWeightMax = 32767
	numericWeightMin = -32768
	numericDscaleMax = 0x3FFF
	// numeric_in refuses exponents this large before looking at the value.
	numericExponentMax = math.MaxInt32/2 - 1
)

// checkNumeric reports whether PostgreSQL's numeric (and so jsonb) can hold
// the JSON number literal lit, following numeric_in: the display scale is
// the digits after the point minus the exponent (at least 0), and the
// weight is that of the first non-zero base-10000 digit. lit is known to be
// a valid JSON number. It keeps no reference to lit (error messages hold a
// copy), so a caller's []byte to string conversion can stay on the stack.
func checkNumeric(lit string) error {
	mant, exp := lit, int64(0)
	if i := strings.IndexAny(lit, "eE"); i >= 0 {
		mant = lit[:i]
		e := lit[i+1:]
		neg := false
		if e != "" && (e[0] == '+' || e[0] == '-') {
			neg = e[0] == '-'
			e = e[1:]
		}
		for j := 0; j < len(e); j++ {
			exp = exp*10 + int64(e[j]-'0')
			if exp > numericExponentMax {
				return fmt.Errorf("number %s is out of PostgreSQL's numeric range", truncate(strings.Clone(lit), 40))
			}
		}
		if neg {
			exp = -exp
		}
	}
	mant = strings.TrimPrefix(mant, "-")
	intPart, frac, _ := strings.Cut(mant, ".")
	dscale := max(int64(len(frac))-exp, 0)
	if dscale > numericDscaleMax {
		return fmt.Errorf("number %s has more than %d digits after the decimal point, PostgreSQL's numeric limit",
			truncate(strings.Clone(lit), 40), numericDscaleMax)
	}
	digits := intPart + frac
	first := strings.IndexFunc(digits, func(r rune) bool { return r != '0' })
	if first < 0 {
		return nil // zero: any weight
	}
	// The decimal exponent of the first non-zero digit, and the power of
	// 10000 holding it (floor division).
	e10 := int64(len(intPart)-1-first) + exp
	weight := e10 / 4
	if e10 < 0 && e10%4 != 0 {
		weight--
	}
	if weight > numericWeightMax || weight < numericWeightMin {
		return fmt.Errorf("number %s is out of PostgreSQL's numeric range", truncate(strings.Clone(lit), 40))
	}
	return nil
}

// truncate shortens s for an error message.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}
