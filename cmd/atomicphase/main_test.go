package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type result struct {
	code           int
	stdout, stderr string
}

// ap runs the command in-process with stdin as standard input.
func ap(t *testing.T, stdin string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, args, strings.NewReader(stdin), &stdout, &stderr)
	return result{code, stdout.String(), stderr.String()}
}

// apdb runs the command against d's schema.
func apdb(t *testing.T, d *pgtest.DB, stdin string, args ...string) result {
	t.Helper()
	return ap(t, stdin, append([]string{"--database-url", d.ConnString(t)}, args...)...)
}

// requireError checks a failure: the exit code, and one line on standard
// error that contains want.
func requireError(t *testing.T, r result, code int, want string) {
	t.Helper()
	require.Equal(t, code, r.code, "stdout: %s\nstderr: %s", r.stdout, r.stderr)
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(r.stderr, "\n"), "\n") {
		if !strings.HasSuffix(l, "[y/N] ") { // a confirmation question
			lines = append(lines, l)
		}
	}
	if code == exitUsage {
		require.Len(t, lines, 2, r.stderr)
		require.Equal(t, "Run 'atomicphase help' for usage.", lines[1])
	} else {
		require.Len(t, lines, 1, r.stderr)
	}
	require.True(t, strings.HasPrefix(lines[0], "atomicphase: "), r.stderr)
	require.Contains(t, lines[0], want)
}

// auditLines returns the audit lines written on standard error.
func auditLines(t *testing.T, stderr string) []map[string]any {
	t.Helper()
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(stderr))
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil && m["msg"] == "atomicphase audit" {
			out = append(out, m)
		}
	}
	return out
}

func TestUsageErrorsExitTwoWithOneLine(t *testing.T) {
	t.Parallel()
	db := "--database-url=postgres://nobody@127.0.0.1:1/none"
	for name, c := range map[string]struct {
		args []string
		want string
	}{
		"no command":         {[]string{}, "no command given"},
		"unknown command":    {[]string{"frobnicate"}, `unknown command "frobnicate"`},
		"no subcommand":      {[]string{"keys"}, "keys needs a subcommand: show, stalled, fail"},
		"unknown subcommand": {[]string{"outbox", "purge"}, `unknown command "outbox purge"`},
		"unknown flag":       {[]string{db, "outbox", "status", "--bogus"}, "flag provided but not defined: -bogus"},
		"stray argument":     {[]string{db, "outbox", "status", "now"}, `unexpected argument "now"`},
		"no database":        {[]string{"--database-url=", "outbox", "status"}, "no database: set --database-url or DATABASE_URL"},
		"bad database url":   {[]string{"--database-url=postgres://x:secret@[::1", "outbox", "status"}, "invalid database URL"},
		"bad duration":       {[]string{db, "keys", "stalled", "--after", "soon"}, `invalid value "soon"`},
		"limit out of range": {[]string{db, "outbox", "dead", "--limit", "0"}, "--limit must be from 1 to 1000"},
	} {
		r := ap(t, "", c.args...)
		requireError(t, r, exitUsage, c.want)
		require.NotContains(t, r.stderr, "secret", name)
	}
}

func TestHelpExitsZero(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"help"}, {"-h"}, {"keys", "fail", "-h"}} {
		r := ap(t, "", args...)
		require.Equal(t, exitOK, r.code, "%v: %s", args, r.stderr)
		require.Contains(t, r.stdout, "Usage: atomicphase")
	}
	r := ap(t, "", "help")
	for _, c := range commands {
		require.Contains(t, r.stdout, c.name+" "+c.args)
	}
	require.Contains(t, ap(t, "", "keys", "fail", "-h").stdout, "-yes")
}

// Every command that reads the database says, in one line and with exit
// status 1, that it cannot reach it, and never prints the password.
func TestUnreachableDatabaseExitsOneWithOneLine(t *testing.T) {
	t.Parallel()
	url := "--database-url=postgres://postgres:secret@127.0.0.1:1/test?connect_timeout=5"
	for _, args := range [][]string{
		{"keys", "show", "acct", "k"},
		{"keys", "stalled"},
		{"keys", "fail", "acct", "k", "--reason", "stuck", "--yes"},
		{"outbox", "status"},
		{"outbox", "dead"},
		{"outbox", "redrive", "1", "--yes"},
	} {
		r := ap(t, "", append([]string{url}, args...)...)
		requireError(t, r, exitFailure, "cannot connect to the database")
		require.NotContains(t, r.stderr, "secret")
	}
}

// The built command reads DATABASE_URL and exits with the codes run
// returns.
func TestCommandProcessExitCodes(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	bin := filepath.Join(t.TempDir(), "atomicphase")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	exitCode := func(args ...string) (int, string, string) {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+d.ConnString(t))
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode(), stdout.String(), stderr.String()
		}
		require.NoError(t, err)
		return 0, stdout.String(), stderr.String()
	}
	code, stdout, stderr := exitCode("outbox", "status")
	require.Equal(t, exitOK, code, stderr)
	require.Contains(t, stdout, "pending       0")
	code, _, stderr = exitCode("keys", "show", "acct", "missing")
	require.Equal(t, exitFailure, code)
	require.Equal(t, 1, strings.Count(stderr, "\n"), stderr)
	code, _, _ = exitCode("outbox", "redrive", "not-an-id", "--yes")
	require.Equal(t, exitUsage, code)
}
