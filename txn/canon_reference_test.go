package txn

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"unicode/utf8"
)

// The canonical form as it was computed before the single-pass parser, on
// encoding/json's tokenizer, kept verbatim (names suffixed Reference):
// every stored fingerprint was computed over it, so the single-pass parser
// must produce the same bytes and accept and reject the same inputs
// (FuzzCanonicalJSONMatchesReference).

// canonicalJSONReference returns in with object keys sorted (by bytes), insignificant
// whitespace removed and strings re-escaped uniformly. Numbers keep their
// literal text: 1.0 and 1 differ, because rounding money through float64
// would be worse. Duplicate object keys, invalid UTF-8 and trailing data are
// rejected, and so is what PostgreSQL's jsonb cannot hold (\u0000, numbers
// outside numeric's range), so that stored params are always valid jsonb.
func canonicalJSONReference(in []byte) ([]byte, error) {
	if !utf8.Valid(in) {
		return nil, errors.New("not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(in))
	dec.UseNumber()
	var out bytes.Buffer
	out.Grow(len(in))
	if err := canonValueReference(dec, &out, 0); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("trailing data after the JSON value")
	}
	return out.Bytes(), nil
}

func canonValueReference(dec *json.Decoder, out *bytes.Buffer, depth int) error {
	if depth > maxJSONDepth {
		return fmt.Errorf("nested deeper than %d", maxJSONDepth)
	}
	tok, err := dec.Token()
	if err != nil {
		return fmt.Errorf("not valid JSON: %w", err)
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '{':
			return canonObjectReference(dec, out, depth)
		case '[':
			out.WriteByte('[')
			for i := 0; dec.More(); i++ {
				if i > 0 {
					out.WriteByte(',')
				}
				if err := canonValueReference(dec, out, depth+1); err != nil {
					return err
				}
			}
			if _, err := dec.Token(); err != nil {
				return fmt.Errorf("not valid JSON: %w", err)
			}
			out.WriteByte(']')
			return nil
		default:
			return fmt.Errorf("not valid JSON: unexpected %q", t)
		}
	case string:
		return writeStringReference(out, t)
	case json.Number:
		if err := checkNumeric(string(t)); err != nil {
			return err
		}
		out.WriteString(string(t))
	case bool:
		if t {
			out.WriteString("true")
		} else {
			out.WriteString("false")
		}
	case nil:
		out.WriteString("null")
	}
	return nil
}

func canonObjectReference(dec *json.Decoder, out *bytes.Buffer, depth int) error {
	type member struct {
		key   string
		value []byte
	}
	var members []member
	seen := make(map[string]struct{})
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return fmt.Errorf("not valid JSON: %w", err)
		}
		k, ok := tok.(string)
		if !ok {
			return errors.New("not valid JSON: object key is not a string")
		}
		if _, dup := seen[k]; dup {
			return fmt.Errorf("duplicate object key %q", truncate(k, 64))
		}
		seen[k] = struct{}{}
		var v bytes.Buffer
		if err := canonValueReference(dec, &v, depth+1); err != nil {
			return err
		}
		members = append(members, member{k, v.Bytes()})
	}
	if _, err := dec.Token(); err != nil {
		return fmt.Errorf("not valid JSON: %w", err)
	}
	sort.Slice(members, func(i, j int) bool { return members[i].key < members[j].key })
	out.WriteByte('{')
	for i, m := range members {
		if i > 0 {
			out.WriteByte(',')
		}
		if err := writeStringReference(out, m.key); err != nil {
			return err
		}
		out.WriteByte(':')
		out.Write(m.value)
	}
	out.WriteByte('}')
	return nil
}

func writeStringReference(out *bytes.Buffer, s string) error {
	if strings.IndexByte(s, 0) >= 0 {
		return errNUL
	}
	enc := json.NewEncoder(out)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(s); err != nil {
		return err
	}
	out.Truncate(out.Len() - 1) // Encode appends a newline
	return nil
}
