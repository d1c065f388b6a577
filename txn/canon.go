package txn

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"unicode/utf16"
	"unicode/utf8"
)

const maxJSONDepth = 128

var errNUL = errors.New(`contains \u0000, which PostgreSQL's jsonb cannot hold`)

// canonicalJSON returns in with object keys sorted (by bytes), insignificant
// whitespace removed and strings re-escaped uniformly. Numbers keep their
// literal text: 1.0 and 1 differ, because rounding money through float64
// would be worse. Duplicate object keys, invalid UTF-8 and trailing data are
// rejected, and so is what PostgreSQL's jsonb cannot hold (\u0000, numbers
// outside numeric's range), so that stored params are always valid jsonb.
//
// Every stored fingerprint was computed over this form, so it must never
// change: strings are decoded as encoding/json decodes them (an unpaired
// UTF-16 surrogate escape becomes U+FFFD) and escaped as its encoder
// escapes them with HTML escaping off. The parser makes one pass over in,
// with pooled scratch space: the result is its only allocation when the
// pool has room ready.
func canonicalJSON(in []byte) ([]byte, error) {
	if !utf8.Valid(in) {
		return nil, errors.New("not valid UTF-8")
	}
	s := canonPool.Get().(*canonScratch)
	defer s.release()
	p := canonParser{in: in, s: s}
	out, err := p.value(reserve(s.out, len(in)), 0)
	if err != nil {
		return nil, err
	}
	s.out = out
	p.skipSpace()
	if p.pos != len(in) {
		return nil, errors.New("trailing data after the JSON value")
	}
	return append(make([]byte, 0, len(out)), out...), nil
}

// canonScratch is the working space of one canonicalJSON call.
type canonScratch struct {
	out     []byte        // the canonical form being built
	keys    []byte        // the decoded keys of the objects being parsed
	members []canonMember // the members of the objects being parsed
	tmp     []byte        // an object's members while they are reordered
	str     []byte        // a decoded string value
}

// canonMember is one object member: its decoded key in keys[k0:k1], its
// canonical `"key":value` text in out[m0:m1].
type canonMember struct{ k0, k1, m0, m1 int }

var canonPool = sync.Pool{New: func() any { return new(canonScratch) }}

// canonScratchMax bounds the scratch space kept for reuse; a call on larger
// params allocates its own.
const canonScratchMax = 64 << 10

func (s *canonScratch) release() {
	if cap(s.out)+cap(s.keys)+cap(s.tmp)+cap(s.str) > canonScratchMax || cap(s.members) > canonScratchMax/32 {
		return
	}
	s.out, s.keys, s.members, s.tmp, s.str = s.out[:0], s.keys[:0], s.members[:0], s.tmp[:0], s.str[:0]
	canonPool.Put(s)
}

// reserve returns b emptied, with room for n bytes: the scratch space of a
// call is allocated at most once, at its first use.
func reserve(b []byte, n int) []byte {
	if cap(b) < n {
		return make([]byte, 0, n)
	}
	return b[:0]
}

type canonParser struct {
	in  []byte
	pos int
	s   *canonScratch
}

func (p *canonParser) skipSpace() {
	for p.pos < len(p.in) {
		switch p.in[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

func (p *canonParser) syntaxError(looking string) error {
	if p.pos >= len(p.in) {
		return fmt.Errorf("not valid JSON: unexpected end of input, looking for %s", looking)
	}
	r, _ := utf8.DecodeRune(p.in[p.pos:])
	return fmt.Errorf("not valid JSON: invalid character %q at offset %d, looking for %s", r, p.pos, looking)
}

// value appends the canonical form of the value at p.pos to out.
func (p *canonParser) value(out []byte, depth int) ([]byte, error) {
	if depth > maxJSONDepth {
		return nil, fmt.Errorf("nested deeper than %d", maxJSONDepth)
	}
	p.skipSpace()
	if p.pos >= len(p.in) {
		return nil, p.syntaxError("a value")
	}
	switch c := p.in[p.pos]; {
	case c == '{':
		return p.object(out, depth)
	case c == '[':
		return p.array(out, depth)
	case c == '"':
		p.pos++
		str, err := p.string(reserve(p.s.str, len(p.in)-p.pos))
		p.s.str = str
		if err != nil {
			return nil, err
		}
		if bytes.IndexByte(str, 0) >= 0 {
			return nil, errNUL
		}
		return appendJSONString(out, str), nil
	case c == '-' || ('0' <= c && c <= '9'):
		start := p.pos
		if err := p.number(); err != nil {
			return nil, err
		}
		lit := p.in[start:p.pos]
		if err := checkNumeric(string(lit)); err != nil {
			return nil, err
		}
		return append(out, lit...), nil
	}
	for _, lit := range [...]string{"true", "false", "null"} {
		if len(p.in)-p.pos >= len(lit) && string(p.in[p.pos:p.pos+len(lit)]) == lit {
			p.pos += len(lit)
			return append(out, lit...), nil
		}
	}
	return nil, p.syntaxError("a value")
}

func (p *canonParser) array(out []byte, depth int) ([]byte, error) {
	p.pos++ // [
	out = append(out, '[')
	p.skipSpace()
	if p.pos < len(p.in) && p.in[p.pos] == ']' {
		p.pos++
		return append(out, ']'), nil
	}
	for {
		var err error
		if out, err = p.value(out, depth+1); err != nil {
			return nil, err
		}
		p.skipSpace()
		if p.pos >= len(p.in) {
			return nil, p.syntaxError("',' or ']'")
		}
		switch p.in[p.pos] {
		case ',':
			p.pos++
			out = append(out, ',')
		case ']':
			p.pos++
			return append(out, ']'), nil
		default:
			return nil, p.syntaxError("',' or ']'")
		}
	}
}

// object writes the members in input order, each as `"key":value`, then,
// unless they already were in key order, rewrites them sorted.
func (p *canonParser) object(out []byte, depth int) ([]byte, error) {
	p.pos++ // {
	out = append(out, '{')
	p.skipSpace()
	if p.pos < len(p.in) && p.in[p.pos] == '}' {
		p.pos++
		return append(out, '}'), nil
	}
	s := p.s
	start, keys0, members0 := len(out), len(s.keys), len(s.members)
	if keys0 == 0 { // the outermost object: room for all the keys below it
		s.keys = reserve(s.keys, len(p.in)-p.pos)
	}
	if cap(s.members) == 0 {
		s.members = make([]canonMember, 0, 16)
	}
	// Nested objects use the scratch after this object's entries and
	// give it back.
	defer func() { s.keys, s.members = s.keys[:keys0], s.members[:members0] }()
	for {
		p.skipSpace()
		if p.pos >= len(p.in) || p.in[p.pos] != '"' {
			return nil, p.syntaxError("a string (an object key)")
		}
		p.pos++
		k0 := len(s.keys)
		var err error
		if s.keys, err = p.string(s.keys); err != nil {
			return nil, err
		}
		k1 := len(s.keys)
		key := s.keys[k0:k1]
		if bytes.IndexByte(key, 0) >= 0 {
			return nil, errNUL
		}
		p.skipSpace()
		if p.pos >= len(p.in) || p.in[p.pos] != ':' {
			return nil, p.syntaxError("':' after an object key")
		}
		p.pos++
		m0 := len(out)
		out = appendJSONString(out, key)
		out = append(out, ':')
		if out, err = p.value(out, depth+1); err != nil {
			return nil, err
		}
		s.members = append(s.members, canonMember{k0, k1, m0, len(out)})
		p.skipSpace()
		if p.pos >= len(p.in) {
			return nil, p.syntaxError("',' or '}'")
		}
		if c := p.in[p.pos]; c == ',' {
			p.pos++
			out = append(out, ',')
			continue
		} else if c != '}' {
			return nil, p.syntaxError("',' or '}'")
		}
		p.pos++
		break
	}
	members := s.members[members0:]
	cmp := func(a, b canonMember) int { return bytes.Compare(s.keys[a.k0:a.k1], s.keys[b.k0:b.k1]) }
	sorted := slices.IsSortedFunc(members, cmp)
	if !sorted {
		slices.SortFunc(members, cmp)
	}
	for i := 1; i < len(members); i++ {
		if cmp(members[i-1], members[i]) == 0 {
			k := members[i]
			return nil, fmt.Errorf("duplicate object key %q", truncate(string(s.keys[k.k0:k.k1]), 64))
		}
	}
	if !sorted {
		s.tmp = append(s.tmp[:0], out[start:]...)
		out = out[:start]
		for i, m := range members {
			if i > 0 {
				out = append(out, ',')
			}
			out = append(out, s.tmp[m.m0-start:m.m1-start]...)
		}
	}
	return append(out, '}'), nil
}

// string decodes the string literal whose opening quote was just read,
// appending its text to dst, as encoding/json decodes it: an unpaired UTF-16
// surrogate escape becomes U+FFFD. in is known to be valid UTF-8.
func (p *canonParser) string(dst []byte) ([]byte, error) {
	for p.pos < len(p.in) {
		c := p.in[p.pos]
		switch {
		case c == '"':
			p.pos++
			return dst, nil
		case c < 0x20:
			return dst, p.syntaxError("a character in a string (control characters must be escaped)")
		case c != '\\':
			p.pos++
			dst = append(dst, c)
			continue
		}
		if p.pos+1 >= len(p.in) {
			p.pos++
			return dst, p.syntaxError("an escape")
		}
		switch e := p.in[p.pos+1]; e {
		case '"', '\\', '/':
			dst = append(dst, e)
		case 'b':
			dst = append(dst, '\b')
		case 'f':
			dst = append(dst, '\f')
		case 'n':
			dst = append(dst, '\n')
		case 'r':
			dst = append(dst, '\r')
		case 't':
			dst = append(dst, '\t')
		case 'u':
			r := hex4(p.in[p.pos:])
			if r < 0 {
				p.pos += 2
				return dst, p.syntaxError("four hexadecimal digits after \\u")
			}
			p.pos += 6
			if utf16.IsSurrogate(r) {
				// A pair is consumed whole; anything else leaves the
				// next escape to be read on its own.
				if dec := utf16.DecodeRune(r, hex4(p.in[p.pos:])); dec != utf8.RuneError {
					p.pos += 6
					r = dec
				} else {
					r = utf8.RuneError
				}
			}
			dst = utf8.AppendRune(dst, r)
			continue
		default:
			p.pos++
			return dst, p.syntaxError("an escape")
		}
		p.pos += 2
	}
	return dst, p.syntaxError(`the closing '"' of a string`)
}

// hex4 returns the rune of the escape \uXXXX at the start of b, or -1.
func hex4(b []byte) rune {
	if len(b) < 6 || b[0] != '\\' || b[1] != 'u' {
		return -1
	}
	var r rune
	for _, c := range b[2:6] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			c = c - 'A' + 10
		default:
			return -1
		}
		r = r*16 + rune(c)
	}
	return r
}

// number reads a JSON number: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (p *canonParser) number() error {
	digits := func() int {
		n := 0
		for p.pos < len(p.in) && '0' <= p.in[p.pos] && p.in[p.pos] <= '9' {
			p.pos++
			n++
		}
		return n
	}
	if p.in[p.pos] == '-' {
		p.pos++
	}
	switch {
	case p.pos < len(p.in) && p.in[p.pos] == '0':
		p.pos++
	case digits() == 0:
		return p.syntaxError("a digit")
	}
	if p.pos < len(p.in) && p.in[p.pos] == '.' {
		p.pos++
		if digits() == 0 {
			return p.syntaxError("a digit after the decimal point")
		}
	}
	if p.pos < len(p.in) && (p.in[p.pos] == 'e' || p.in[p.pos] == 'E') {
		p.pos++
		if p.pos < len(p.in) && (p.in[p.pos] == '+' || p.in[p.pos] == '-') {
			p.pos++
		}
		if digits() == 0 {
			return p.syntaxError("a digit in the exponent")
		}
	}
	return nil
}

// appendJSONString appends s as a JSON string, escaped as encoding/json's
// encoder escapes it with HTML escaping off: `"` and `\` with a backslash;
// \b, \f, \n, \r and \t short; other bytes below 0x20, U+2028 and U+2029 as
// \u00XX and \u202X (lower-case hex); invalid UTF-8 as \ufffd.
func appendJSONString[S []byte | string](dst []byte, s S) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		b := s[i]
		if b < utf8.RuneSelf {
			if b >= 0x20 && b != '"' && b != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch b {
			case '\\', '"':
				dst = append(dst, '\\', b)
			case '\b':
				dst = append(dst, '\\', 'b')
			case '\f':
				dst = append(dst, '\\', 'f')
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hex[b>>4], hex[b&0xF])
			}
			i++
			start = i
			continue
		}
		n := min(len(s)-i, utf8.UTFMax) // a short conversion, on the stack
		c, size := utf8.DecodeRuneInString(string(s[i : i+n]))
		if c == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i++
			start = i
			continue
		}
		if c == '\u2028' || c == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hex[c&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}

// writeString appends s to out as a JSON string, as appendJSONString does;
// it refuses a string holding NUL, which PostgreSQL's jsonb cannot hold.
func writeString(out *bytes.Buffer, s string) error {
	if strings.IndexByte(s, 0) >= 0 {
		return errNUL
	}
	out.Write(appendJSONString(out.AvailableBuffer(), s))
	return nil
}
