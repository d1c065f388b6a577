package httpidem

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseKey(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		`"8e03978e-40d5-43e8-bc93-6894a57f9324"`: "8e03978e-40d5-43e8-bc93-6894a57f9324",
		`8e03978e-40d5-43e8-bc93-6894a57f9324`:   "8e03978e-40d5-43e8-bc93-6894a57f9324",
		` "with space" `:                         "with space",
		`"esc\"aped\\"`:                          `esc"aped\`,
		`order:1/2`:                              "order:1/2",
	} {
		got, err := ParseKey(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{"", `""`, `"open`, `"a"b`, `a b`, `"\n"`, `"\x"`, "é", strings.Repeat("k", 256)} {
		_, err := ParseKey(in)
		require.ErrorIs(t, err, ErrInvalidHeader, in)
	}
}

func FuzzParseKey(f *testing.F) {
	for _, s := range []string{`"abc"`, `abc`, `"a\"b"`, `""`, `"`, `a b`, ` x `, `"\\"`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		key, err := ParseKey(in)
		if err != nil {
			if !errors.Is(err, ErrInvalidHeader) {
				t.Fatalf("error does not wrap ErrInvalidHeader: %v", err)
			}
			return
		}
		// A parsed key re-serialized as an sf-string parses to itself.
		quoted := `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
		again, err := ParseKey(quoted)
		if err != nil || again != key {
			t.Fatalf("round trip of %q via %q gave %q, %v", key, quoted, again, err)
		}
	})
}
