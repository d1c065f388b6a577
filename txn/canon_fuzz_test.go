package txn

import (
	"bytes"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// canonSeeds are inputs at the edges of the grammar and of what the
// canonical form must preserve: every input of the key tests, numbers at
// PostgreSQL's limits, escapes and surrogates, invalid UTF-8, duplicate
// keys, nesting at the depth limit, whitespace and trailing data.
func canonSeeds() []string {
	r := strings.Repeat
	return []string{
		// The key tests' inputs.
		`{"amount": 1`, `{"a":1} {"b":2}`, `{"a":1,"a":2}`, `{"a":"x\u0000y"}`, "{\"a\":\"\xff\"}",
		`{"a":"` + r("x", 2000) + `"}`, `{"b":[1,{"y":2,"x":"é"}],"a":"\u00e9\/"}`, `{"a":"é/","b":[1,{"x":"é","y":2}]}`,
		"{ \"b\" : [ 1 , { \"x\" : \"\\u00e9\", \"y\" : 2 } ] ,\n \"a\" : \"é\\/\" }", `{"a":"é/","b":[1,{"x":"é","y":3}]}`,
		`{"a":"é/","b":[{"x":"é","y":2},1]}`, `{"a":"é/","b":[1,{"x":"é","y":2.0}]}`, `{"a":"é/","b":[1,{"x":"é","y":2}],"c":null}`,
		`{"amount":1e1000000}`, `[1e-20000]`, `{"a":"\u0000"}`, `{"amount":100,"currency":"usd"}`,
		`{}`, `[]`, `null`, `{"b":1,"a":[true,false,null]}`, `{"a":"\u00e9\/\"","b":1.50e3}`,
		`{"a":{"c":1,"b":2}}`, `[1,2`, `"x"`, `1e400`, `{"":0}`,
		// Numbers.
		`0`, `-0`, `-0.0`, `-0.0e+00`, `0e0`, `1E400`, `1E+2`, `12.5E-3`, `1e-16383`, `1e-16384`, `1e131071`, `1e131072`,
		`9999e131068`, `99999e131067`, `0e1073741823`, `1e-1073741823`, `123456789012345678901234567890.123456789`,
		"0." + r("0", 16383), "0." + r("0", 16384), "1" + r("0", 200), `[` + r("9", 400) + `]`,
		`[01]`, `[-]`, `[1.]`, `[1e]`, `[1e+]`, `[.5]`, `[+1]`, `[-01]`, `[1.5e3.2]`, `[0x10]`, `[Infinity]`, `[NaN]`, `1x`, `-`,
		// Literals.
		`true`, `false`, `[tru]`, `[truex]`, `[nul]`, `nulll`, `truefalse`, `[true false]`, `True`,
		// Strings, escapes, surrogates, UTF-8.
		`""`, `"\ud83d\ude00"`, `"\uD83D\uDE00"`, `"\ud800"`, `"\udc00"`, `"\ud800\u0041"`, `"\ud800\ud800\udc00"`,
		`"\udc00\ud800"`, `"\ud800x"`, `"\ud800\"`, `"\ud800\u"`, `"\ud800\udc0"`, `{"\ud800":1,"\udbff":2}`,
		`"\uZZZZ"`, `"\u12"`, `"\x"`, `"\'"`, `"a\u0000b"`, `{"\u0000":1}`, "\"\x01\"", "\"\x7f\"",
		`"\b\f\n\r\t\u0001\u001f\u007f\u0008\u000c"`, "\"\u2028\u2029 \x7f é \"", `"\u2028\u2029\u202a"`, `"<>&"`,
		`"\u003c\u003e\u0026"`, `"\ufffd"`, "\"\ufffd\"", "\"\U0001F600\"", `"\/\\\""`, `"unterminated`, `"\`, "[\"\x00\"]",
		"\xff", "\"\xed\xa0\x80\"", "\"\xc0\xaf\"", "\xef\xbb\xbf{}",
		// Objects: order, duplicates, nesting.
		`{"b":{"z":[{"y":1,"x":2}]},"a":[]}`, `{"é":1,"e":2,"E":3,"":4}`, `{"\t":1,"\n":2}`, `{"a":1,"\u0061":2}`,
		`{"b":{"d":1,"c":2},"a":{"f":{"h":1,"g":2},"e":3}}`, `{"b":1,"a":2,"b":3}`, `{"a":{"x":1,"x":2}}`,
		`{"z":1,"y":{"b":[{"d":1,"c":2}],"a":0},"x":[{"q":1,"p":2},{"p":3,"o":4}]}`, `{"ab":1,"a":2,"abc":3,"b":4}`,
		`{"a":1,}`, `{"a" 1}`, `{,}`, `{"a"}`, `{"a":}`, `{1:2}`, `{"a":1 "b":2}`, `{"a":1]`, `[1}`, `{]`, `[}`,
		`[,1]`, `[1,]`, `[1 2]`, `{"a"::1}`, `[:1]`, `{"a":1,"b"}`,
		// Whitespace and trailing data.
		``, ` `, "\t{ \"a\" :\r\n 1 }\n", " [ 1 , 2 ] ", "\v1", "1\f", "\u00a01", `{"a":1}x`, `1 2`, `[][]`, `{}{}`, `"a""b"`,
		// Depth: 128 levels below the top are allowed, 129 are not.
		r("[", 128) + r("]", 128), r("[", 129) + r("]", 129), r("[", 130) + r("]", 130),
		r("[", 129) + "1" + r("]", 129), r("[", 128) + "1" + r("]", 128),
		r(`{"a":`, 128) + "1" + r("}", 128), r(`{"a":`, 129) + "1" + r("}", 129), r(`{"a":`, 128) + "{}" + r("}", 128),
		r(`{"a":`, 129) + "{}" + r("}", 129), r("[", 10000), r("[", 200) + r("]", 200),
	}
}

// The single-pass parser produces the canonical form the encoding/json
// tokenizer produced before it, byte for byte, and accepts and rejects the
// same inputs: a key stored before the change must keep matching its
// retries, and what was refused stays refused.
func FuzzCanonicalJSONMatchesReference(f *testing.F) {
	for _, s := range canonSeeds() {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		want, werr := canonicalJSONReference(in)
		got, err := canonicalJSON(in)
		if (err == nil) != (werr == nil) {
			t.Fatalf("%q: error %v, the reference's %v", in, err, werr)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%q: canonical form %q, the reference's %q", in, got, want)
		}
		if err != nil {
			return
		}
		// The result is the caller's: a later call, which reuses the
		// scratch space, does not change it.
		if _, err := canonicalJSON([]byte(`{"z":"` + strings.Repeat("w", len(in)) + `","y":[{"b":1,"a":2}]}`)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%q: canonical form changed to %q by a later call", in, got)
		}
		if !bytes.Equal(fingerprint("POST", "/p", got), fingerprint("POST", "/p", want)) {
			t.Fatal("fingerprints differ")
		}
	})
}

// writeString (phase names in stored results) escapes as the encoding/json
// encoder did, invalid UTF-8 included.
func FuzzWriteStringMatchesReference(f *testing.F) {
	for _, s := range []string{"", "a", "é", "\u2028", "\u2029", "\x7f", "\x01", "\b\f\n\r\t", "\"\\", "\xff", "\xed\xa0\x80",
		"a\xc3", "<&>", "phase_1", "a\x00b", "\U0001F600"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		var got, want bytes.Buffer
		err := writeString(&got, s)
		werr := writeStringReference(&want, s)
		if (err == nil) != (werr == nil) || got.String() != want.String() {
			t.Fatalf("%q: %q (%v), the reference's %q (%v)", s, got.String(), err, want.String(), werr)
		}
	})
}

// Generated documents reach deeper into the grammar than byte mutations
// do: nested unsorted objects, escapes of every kind, surrogates paired or
// not, numbers of every shape, random whitespace, and sometimes a fault
// (a duplicate key, a stray byte, a truncation). Both parsers must agree on
// every one.
func TestCanonicalJSONMatchesReferenceOnGeneratedDocuments(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(7, 11))
	ws := func() string { return []string{"", "", "", " ", "\n\t", "\r\n  "}[r.IntN(6)] }
	str := func() string {
		parts := []string{"a", "b", "é", "\U0001F600", "\u2028", "\u2029", "\x7f", `\"`, `\\`, `\/`, `\b`, `\f`, `\n`,
			`\r`, `\t`, `\u0001`, `\u001F`, `\u00e9`, `\u2028`, `\uD83D\uDE00`, `\ud800`, `\udc00`, `\ud800\u0041`,
			`\udbff\udfff`, `\ud800\ud800`, `\u0000`, "<", "&", `\u003c`, "\t", "\x01", `\x`, `\u12`}
		var b strings.Builder
		b.WriteByte('"')
		for range r.IntN(4) {
			p := parts[r.IntN(len(parts))]
			if (p == "\t" || p == "\x01" || p == `\x` || p == `\u12` || p == `\u0000`) && r.IntN(8) != 0 {
				p = "z" // mostly valid
			}
			b.WriteString(p)
		}
		b.WriteByte('"')
		return b.String()
	}
	num := func() string {
		return []string{"0", "-0", "1", "-12", "3.14", "1.0", "1e3", "1E+3", "2.5e-7", "-0.0e0", "1e131072", "1e-16384",
			"100", "0.000", "12345678901234567890", "01", "1.", ".5", "-", "1e"}[r.IntN(20)]
	}
	var value func(depth int) string
	value = func(depth int) string {
		k := r.IntN(10)
		if depth > 4 {
			k = r.IntN(5)
		}
		switch k {
		case 0:
			return num()
		case 1:
			return str()
		case 2:
			return []string{"true", "false", "null"}[r.IntN(3)]
		case 3, 4:
			return num()
		case 5, 6:
			var b strings.Builder
			b.WriteString("[" + ws())
			for i := range r.IntN(4) {
				if i > 0 {
					b.WriteString(ws() + "," + ws())
				}
				b.WriteString(value(depth + 1))
			}
			b.WriteString(ws() + "]")
			return b.String()
		default:
			var b strings.Builder
			b.WriteString("{" + ws())
			keys := []string{`"a"`, `"b"`, `"c"`, `"ab"`, `""`, `"é"`, `"\u0061"`, `"\ud800"`, `"\udbff"`, `"Z"`, `"\n"`}
			for i := range r.IntN(5) {
				if i > 0 {
					b.WriteString(ws() + "," + ws())
				}
				key := keys[r.IntN(len(keys))]
				if r.IntN(3) == 0 {
					key = str()
				}
				b.WriteString(key + ws() + ":" + ws() + value(depth+1))
			}
			b.WriteString(ws() + "}")
			return b.String()
		}
	}
	accepted := 0
	const n = 20000
	for range n {
		doc := ws() + value(0) + ws()
		if r.IntN(10) == 0 { // a fault
			switch i := r.IntN(len(doc) + 1); r.IntN(3) {
			case 0:
				doc = doc[:i]
			case 1:
				doc = doc[:i] + string(",:]}x\"\\"[r.IntN(7)]) + doc[i:]
			default:
				doc += " " + value(0)
			}
		}
		want, werr := canonicalJSONReference([]byte(doc))
		got, err := canonicalJSON([]byte(doc))
		require.Equal(t, werr == nil, err == nil, "%q: error %v, the reference's %v", doc, err, werr)
		require.Equal(t, string(want), string(got), doc)
		if err == nil {
			accepted++
		}
	}
	require.Greater(t, accepted, n/4, "most documents are valid")
	require.Less(t, accepted, n-n/10, "some are not")
}
