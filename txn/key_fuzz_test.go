package txn

import (
	"bytes"
	"encoding/json"
	"testing"
)

func FuzzValidateKey(f *testing.F) {
	for _, s := range []string{"", "a", "order-1", " ", "~", "\x7f", "\x1f", "é", string(bytes.Repeat([]byte("k"), 256))} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		err := ValidateKey(s)
		ok := len(s) >= 1 && len(s) <= MaxKeyLength
		for i := 0; i < len(s); i++ {
			if s[i] < 0x20 || s[i] > 0x7e {
				ok = false
			}
		}
		if ok != (err == nil) {
			t.Fatalf("ValidateKey(%q) = %v, want ok=%v", s, err, ok)
		}
	})
}

func FuzzCanonicalJSON(f *testing.F) {
	for _, s := range []string{`{}`, `[]`, `null`, `{"b":1,"a":[true,false,null]}`, `{"a":"\u00e9\/\"","b":1.50e3}`,
		`{"a":{"c":1,"b":2}}`, `{"a":1,"a":2}`, `[1,2`, `"x"`, `1e400`, `{"":0}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		canon, err := canonicalJSON(in)
		if err != nil {
			return
		}
		// The canonical form is valid JSON that means the same as the input.
		if !json.Valid(canon) {
			t.Fatalf("canonical form %q of %q is not valid JSON", canon, in)
		}
		var a, b any
		da, db := json.NewDecoder(bytes.NewReader(in)), json.NewDecoder(bytes.NewReader(canon))
		da.UseNumber()
		db.UseNumber()
		if da.Decode(&a) != nil || db.Decode(&b) != nil {
			t.Fatalf("decode failed for %q / %q", in, canon)
		}
		ja, _ := json.Marshal(a)
		jb, _ := json.Marshal(b)
		if !bytes.Equal(ja, jb) {
			t.Fatalf("meaning changed: %q -> %q", in, canon)
		}
		// Canonicalizing is idempotent, and re-indenting the input (an
		// equivalent text) gives the same canonical form.
		again, err := canonicalJSON(canon)
		if err != nil || !bytes.Equal(again, canon) {
			t.Fatalf("not idempotent: %q -> %q (%v)", canon, again, err)
		}
		var indented bytes.Buffer
		if json.Indent(&indented, in, "", "  ") == nil {
			c2, err := canonicalJSON(indented.Bytes())
			if err != nil || !bytes.Equal(c2, canon) {
				t.Fatalf("whitespace changed the canonical form: %q vs %q (%v)", c2, canon, err)
			}
		}
		if !bytes.Equal(fingerprint("POST", "/p", canon), fingerprint("POST", "/p", again)) {
			t.Fatal("fingerprint differs for equal canonical forms")
		}
		if bytes.Equal(fingerprint("POST", "/p", canon), fingerprint("PUT", "/p", canon)) {
			t.Fatal("fingerprint ignores the method")
		}
	})
}
