package pgbouncer_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// sessionState matches SQL that would leave state on a server connection
// beyond its transaction: session advisory locks, a SET that is not SET
// LOCAL, set_config without is_local, LISTEN, PREPARE.
var sessionState = []struct {
	what string
	re   *regexp.Regexp
	// allowed lists the files (relative to the module root) where the
	// match is deliberate.
	allowed []string
}{
	{"session advisory lock", regexp.MustCompile(`(?i)pg_(try_)?advisory_lock(_shared)?\s*\(|pg_advisory_unlock`), []string{"queries/relay_idle.sql"}},
	// A SET statement: at the start of a Go string literal, or (in .sql
	// files, see setStatements) at the start of a statement.
	{"SET that is not SET LOCAL", regexp.MustCompile("[\"`]\\s*SET\\s"), []string{"outbox/idle.go"}},
	{"set_config that is not local to the transaction", regexp.MustCompile(`(?i)set_config\s*\([^)]*,\s*(false|\$\d+)\s*\)`), nil},
	{"LISTEN", regexp.MustCompile(`(?:^|["'\x60]\s*)LISTEN\s`), []string{"outbox/listener.go"}},
	{"PREPARE", regexp.MustCompile(`["'\x60]\s*PREPARE\s`), nil},
}

// The library's SQL (queries, migrations and every SQL string in its
// non-test Go files) leaves no state on a session, so that a
// transaction-pooling PgBouncer can hand the next transaction to any
// client: advisory locks are transaction-scoped, settings are SET LOCAL
// or set_config(..., true), and the only session state is the relay's
// optional listener (Config.DisableNotify turns it off): its LISTEN, and the
// idle lock (with its lock_timeout) it holds on a connection of its own. The
// matrix tests check the behaviour; this check keeps a new statement from
// adding session state on a path they do not cover.
func TestLibrarySQLKeepsNoSessionState(t *testing.T) {
	t.Parallel()
	_, self, _, ok := runtime.Caller(0)
	require.True(t, ok)
	root := filepath.Join(filepath.Dir(self), "..", "..")
	var checked int
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			switch {
			case strings.HasPrefix(d.Name(), "."), rel == "bench", rel == "examples", rel == "internal/db",
				rel == "bin", rel == "sqlc", rel == "docs":
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(rel, "_test.go") || !(strings.HasSuffix(rel, ".go") || strings.HasSuffix(rel, ".sql")) {
			return nil
		}
		text, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		checked++
		for _, rule := range sessionState {
			for _, m := range rule.re.FindAllIndex(text, -1) {
				if strings.Contains(strings.ToUpper(string(text[m[0]:m[1]])), "LOCAL") {
					continue
				}
				if !containsString(rule.allowed, rel) {
					line := 1 + strings.Count(string(text[:m[0]]), "\n")
					t.Errorf("%s:%d: %s: %q", rel, line, rule.what, strings.TrimSpace(string(text[m[0]:m[1]])))
				}
			}
		}
		if strings.HasSuffix(rel, ".sql") {
			for _, stmt := range setStatements(string(text)) {
				t.Errorf("%s: SET that is not SET LOCAL: %q", rel, stmt)
			}
		}
		return nil
	})
	require.NoError(t, err)
	require.Greater(t, checked, 50, "the walk found the library's files")
}

// setStatements returns the statements of a SQL file that are a SET but
// not a SET LOCAL (an UPDATE's SET clause is not a statement of its own).
// It splits at every ';', so text after a ';' inside a string literal is
// looked at as if it began a statement.
func setStatements(sql string) []string {
	var out []string
	for stmt := range strings.SplitSeq(sql, ";") {
		var lines []string
		for line := range strings.Lines(stmt) {
			if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "--") {
				lines = append(lines, l)
			}
		}
		// The library writes SQL keywords in capitals; lower case "set" is
		// prose (in an error message, after a ';' inside a string).
		first := strings.Join(lines, " ")
		if strings.HasPrefix(first, "SET ") && !strings.HasPrefix(first, "SET LOCAL ") {
			out = append(out, first)
		}
	}
	return out
}

func containsString(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
