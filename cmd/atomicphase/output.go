package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/user"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"
)

// printJSON writes v as indented JSON.
func (e *env) printJSON(v any) error {
	enc := json.NewEncoder(e.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// table writes aligned columns; every cell is made safe for a terminal.
type table struct {
	tw *tabwriter.Writer
}

func (e *env) table(header ...string) *table {
	t := &table{tw: newTabWriter(e.stdout)}
	t.row(header...)
	return t
}

func newTabWriter(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
}

func (t *table) row(cells ...string) {
	for i, c := range cells {
		cells[i] = safe(c)
		if cells[i] == "" {
			cells[i] = "-"
		}
	}
	fmt.Fprintln(t.tw, strings.Join(cells, "\t"))
}

func (t *table) flush() { _ = t.tw.Flush() }

// safe returns s for one line of a terminal: control characters (C0, DEL,
// C1, line breaks included), bidirectional overrides and invalid UTF-8 are
// escaped, so that a stored value cannot move the cursor, recolour the
// screen or hide text.
func safe(s string) string {
	return escape(s, false)
}

// safeText is safe for text of several lines: line breaks and tabs stay.
func safeText(s string) string {
	return escape(s, true)
}

func escape(s string, keepLines bool) string {
	clean := true
	for _, r := range s {
		if needsEscape(r, keepLines) {
			clean = false
			break
		}
	}
	if clean && utf8.ValidString(s) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case needsEscape(r, keepLines):
			q := fmt.Sprintf("%+q", string(r))
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteRune(r)
		}
		i += size
	}
	return b.String()
}

func needsEscape(r rune, keepLines bool) bool {
	if keepLines && (r == '\n' || r == '\t') {
		return false
	}
	return unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r) || r == '\u2028' || r == '\u2029'
}

// ago renders a number of seconds for people: 42s, 4m2s, 3h12m, 2d4h.
func ago(secs float64) string {
	return human(time.Duration(secs * float64(time.Second)))
}

func human(d time.Duration) string {
	switch {
	case d <= 0:
		return "0s"
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(time.Second).String()
	case d < time.Hour:
		d = d.Round(time.Second)
		return fmt.Sprintf("%dm%ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		d = d.Round(time.Minute)
		return fmt.Sprintf("%dh%dm", int(d.Hours()), int(d.Minutes())%60)
	default:
		d = d.Round(time.Hour)
		return fmt.Sprintf("%dd%dh", int(d.Hours())/24, int(d.Hours())%24)
	}
}

// stamp renders a time in UTC, to the second.
func stamp(t time.Time) string {
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

// clip shortens s to n runes, marking the cut.
func clip(n int, s string) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n]) + "…"
}

// errNotConfirmed: the operator did not confirm a write.
var errNotConfirmed = errors.New("not confirmed; nothing changed (give --yes to skip the question)")

// confirm asks question on standard error and reads the answer from
// standard input, unless --yes was given. Only "y" or "yes" goes on.
func (e *env) confirm(question string) error {
	if e.yes {
		return nil
	}
	fmt.Fprintf(e.stderr, "%s [y/N] ", question)
	line, err := bufio.NewReader(e.stdin).ReadString('\n')
	if !isTerminal(e.stdin) {
		// A terminal echoed the answer and its newline; a pipe did not.
		fmt.Fprintln(e.stderr)
	}
	if err != nil && err != io.EOF {
		return errNotConfirmed
	}
	switch strings.ToLower(strings.TrimSpace(line)) {
	case "y", "yes":
		return nil
	}
	return errNotConfirmed
}

// isTerminal reports whether r is a terminal (a character device).
func isTerminal(r io.Reader) bool {
	f, ok := r.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// audit writes one audit line (JSON) on standard error: who ran which
// write, from where, and what it changed.
func (e *env) audit(action string, attrs ...any) {
	who := os.Getenv("USER")
	if u, err := user.Current(); err == nil {
		who = u.Username
	}
	host, _ := os.Hostname()
	log := slog.New(slog.NewJSONHandler(e.stderr, nil))
	log.Info("atomicphase audit", append([]any{"action", action, "user", who, "host", host}, attrs...)...)
}

// count renders n things: "1 key", "2 keys".
func count(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.FormatInt(n, 10) + " " + many
}
