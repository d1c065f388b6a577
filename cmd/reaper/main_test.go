package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/cleanup"
	"github.com/atomicphase/atomicphase/internal/connstr"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestRunRejectsBadCommandLinesWithExitTwo(t *testing.T) {
	t.Parallel()
	db := "-database-url=postgres://nobody@127.0.0.1:1/none"
	for name, args := range map[string][]string{
		"unknown flag":              {db, "-once", "-bogus"},
		"bad duration":              {db, "-interval", "soon"},
		"neither once nor interval": {db},
		"both once and interval":    {db, "-once", "-interval", "1m"},
		"negative interval":         {db, "-interval", "-1m"},
		"ttl under the window":      {db, "-once", "-ttl", "1h"},
		"ttl over the window":       {db, "-once", "-ttl", "200h"},
		"max age of a day":          {db, "-once", "-max-age", "24h"},
		"bad log level":             {db, "-once", "-log-level", "loud"},
		"negative cleanup pause":    {db, "-once", "-cleanup-pause", "-1s"},
		"cleanup pause over max":    {db, "-once", "-cleanup-pause", "2m"},
		"no database":               {"-database-url=", "-once"},
		"stray argument":            {db, "-once", "now"},
		"bad database url":          {"-database-url=postgres://x:y@[::1", "-once"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), args, &stdout, &stderr)
		require.Equal(t, exitUsage, code, "%s: %s", name, stderr.String())
		require.Contains(t, stderr.String(), "reaper: usage error", name)
		require.NotContains(t, stderr.String(), "y@", "%s: no password printed", name)
	}
}

func TestRunHelpPrintsUsageAndExitsZero(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-help"}, &stdout, &stderr))
	for _, f := range []string{"-once", "-interval", "-dry-run", "-ttl", "-outbox-retention", "-tombstone-retention", "-resume-delay",
		"-max-attempts", "-max-age", "-batch-size", "-cleanup-pause", "-database-url", "-log-level", "$DATABASE_URL", "$REAPER_TTL",
		"$REAPER_CLEANUP_PAUSE"} {
		require.Contains(t, stdout.String(), f)
	}
	require.Empty(t, stderr.String())
}

// schemaURL returns the test server's connection string, in whichever form
// it has (a URL, or keyword/value pairs for a throwaway cluster), with
// search_path set to schema.
func schemaURL(t *testing.T, server, schema string) string {
	t.Helper()
	s, err := connstr.WithSearchPath(server, schema)
	require.NoError(t, err)
	return s
}

// buildReaper builds the command into dir.
func buildReaper(t *testing.T, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "reaper")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

type result struct {
	code   int
	stderr string
	lines  []map[string]any // JSON log lines
}

func (r result) summary(t *testing.T) map[string]any {
	t.Helper()
	for _, l := range r.lines {
		if l["msg"] == "reaper round" || l["msg"] == "reaper dry run" {
			return l
		}
	}
	t.Fatalf("no summary line in:\n%s", r.stderr)
	return nil
}

func parseLines(t *testing.T, stderr string) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for l := range strings.Lines(stderr) {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil {
			lines = append(lines, m)
		}
	}
	return lines
}

func runReaper(t *testing.T, bin, databaseURL string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+databaseURL)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return result{code: code, stderr: stderr.String(), lines: parseLines(t, stderr.String())}
}

// seed leaves one row of every kind the reaper acts on or must leave alone.
func seed(t *testing.T, d *pgtest.DB) {
	t.Helper()
	_, err := d.Pool.Exec(context.Background(), `
		INSERT INTO idempotency_keys (key, fingerprint, request_method, request_path, workflow, status,
			recovery_point, attempts, created_at, last_run_at, finished_at, response_status, response_headers, response_body)
		VALUES
			('stalled-old', decode(repeat('ab', 32), 'hex'), 'POST', '/rides', 'create_ride', 'running',
				'ride_created', 1, now() - interval '2 hours', now() - interval '2 hours', NULL, NULL, NULL, NULL),
			('stalled-young', decode(repeat('ab', 32), 'hex'), 'POST', '/rides', 'create_ride', 'running',
				'started', 1, now() - interval '10 minutes', now() - interval '10 minutes', NULL, NULL, NULL, NULL),
			('expired', decode(repeat('ab', 32), 'hex'), 'POST', '/rides', '', 'finished',
				'finished', 1, now() - interval '3 days', now() - interval '3 days', now() - interval '25 hours', 201, '{}', '\x7b7d'),
			('kept', decode(repeat('ab', 32), 'hex'), 'POST', '/rides', '', 'finished',
				'finished', 1, now() - interval '3 hours', now() - interval '3 hours', now() - interval '3 hours', 201, '{}', '\x7b7d')`)
	require.NoError(t, err)
	_, err = d.Pool.Exec(context.Background(), `
		INSERT INTO outbox_messages (topic, payload, published_at) VALUES
			('receipts', '\x00', now() - interval '8 days'),
			('receipts', '\x00', now() - interval '1 day'),
			('receipts', '\x00', NULL)`)
	require.NoError(t, err)
}

func snapshot(t *testing.T, d *pgtest.DB) string {
	t.Helper()
	var s string
	require.NoError(t, d.Pool.QueryRow(context.Background(), `
		SELECT coalesce(md5(string_agg(k::text, '|' ORDER BY id)), '') ||
		       (SELECT coalesce(md5(string_agg(m::text, '|' ORDER BY id)), '') FROM outbox_messages m)
		FROM idempotency_keys k`).Scan(&s))
	return s
}

func TestReaperProcess(t *testing.T) {
	t.Parallel()
	bin := buildReaper(t, t.TempDir())

	t.Run("once_fails_unresumable_keys_deletes_expired_rows_and_logs_a_summary", func(t *testing.T) {
		t.Parallel()
		d := pgtest.New(t)
		seed(t, d)
		r := runReaper(t, bin, schemaURL(t, d.URL, d.Schema), "-once")
		require.Equal(t, exitOK, r.code, r.stderr)
		s := r.summary(t)
		require.Equal(t, "INFO", s["level"])
		require.Equal(t, map[string]any{"failed_unknown_workflow": 1.0, "left": 1.0, "keys_deleted": 1.0,
			"outbox_deleted": 1.0, "resumed": 0.0, "failed_max_attempts": 0.0, "failed_max_age": 0.0,
			"dry_run": false, "cleanup_skipped": false},
			pick(s, "failed_unknown_workflow", "left", "keys_deleted", "outbox_deleted", "resumed",
				"failed_max_attempts", "failed_max_age", "dry_run", "cleanup_skipped"))

		require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_keys
			WHERE key = 'stalled-old' AND status = 'failed' AND failure_reason = 'unknown_workflow' AND response_status = 500`))
		require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'stalled-young' AND status = 'running'`))
		require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'expired'`))
		require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'kept'`))
		require.Equal(t, 2, d.Count(t, `SELECT count(*) FROM outbox_messages`))
	})

	t.Run("dry_run_reports_and_changes_nothing", func(t *testing.T) {
		t.Parallel()
		d := pgtest.New(t)
		seed(t, d)
		before := snapshot(t, d)
		r := runReaper(t, bin, schemaURL(t, d.URL, d.Schema), "-once", "-dry-run")
		require.Equal(t, exitOK, r.code, r.stderr)
		s := r.summary(t)
		require.Equal(t, "reaper dry run", s["msg"])
		require.Equal(t, map[string]any{"failed_unknown_workflow": 1.0, "left": 1.0, "keys_deleted": 1.0,
			"outbox_deleted": 1.0, "dry_run": true},
			pick(s, "failed_unknown_workflow", "left", "keys_deleted", "outbox_deleted", "dry_run"))
		require.Equal(t, before, snapshot(t, d))
	})

	t.Run("bad_flags_exit_2", func(t *testing.T) {
		t.Parallel()
		for _, args := range [][]string{{"-once", "-bogus"}, {"-interval", "soon"}, {}} {
			r := runReaper(t, bin, "postgres://nobody@127.0.0.1:1/none", args...)
			require.Equal(t, exitUsage, r.code, "%v: %s", args, r.stderr)
			require.Contains(t, r.stderr, "usage error")
		}
	})

	t.Run("unreachable_database_exits_1_with_a_clear_message", func(t *testing.T) {
		t.Parallel()
		r := runReaper(t, bin, "postgres://postgres:secret@127.0.0.1:1/test?connect_timeout=5", "-once")
		require.Equal(t, exitFailure, r.code, r.stderr)
		require.Len(t, r.lines, 1, r.stderr)
		require.Equal(t, "ERROR", r.lines[0]["level"])
		require.Contains(t, r.lines[0]["msg"], "cannot connect to the database")
		require.NotContains(t, r.stderr, "secret")
	})

	t.Run("schema_behind_exits_1_naming_the_missing_migration", func(t *testing.T) {
		t.Parallel()
		server := pgtest.ServerURL(t)
		schema := freshSchema(t, server)
		r := runReaper(t, bin, schemaURL(t, server, schema), "-once")
		require.Equal(t, exitFailure, r.code, r.stderr)
		require.Contains(t, r.stderr, "schema is behind")
		require.Contains(t, r.stderr, "00001_idempotency_keys.sql")
	})

	t.Run("sigterm_during_interval_exits_0_promptly", func(t *testing.T) {
		t.Parallel()
		d := pgtest.New(t)
		seed(t, d)
		cmd := exec.Command(bin, "-interval", "1h")
		cmd.Env = append(os.Environ(), "DATABASE_URL="+schemaURL(t, d.URL, d.Schema))
		stderr, err := cmd.StderrPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		var log bytes.Buffer
		sc := bufio.NewScanner(io.TeeReader(stderr, &log))
		for sc.Scan() && !strings.Contains(sc.Text(), `"msg":"reaper round"`) {
		}
		require.Contains(t, log.String(), `"msg":"reaper round"`, "first round ran at once")
		require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
		sent := time.Now()
		done := make(chan error, 1)
		go func() {
			_, _ = io.Copy(&log, stderr)
			done <- cmd.Wait()
		}()
		select {
		case err := <-done:
			require.NoError(t, err, "exit status 0: %s", log.String())
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			t.Fatalf("still running 10s after SIGTERM: %s", log.String())
		}
		t.Logf("exited %v after SIGTERM", time.Since(sent))
		require.Less(t, time.Since(sent), 5*time.Second)
		require.Contains(t, log.String(), `"msg":"reaper stopped"`)
	})
}

func pick(m map[string]any, keys ...string) map[string]any {
	out := map[string]any{}
	for _, k := range keys {
		out[k] = m[k]
	}
	return out
}

// freshSchema creates an empty schema, without migrations, dropped at cleanup.
func freshSchema(t *testing.T, server string) string {
	t.Helper()
	ctx := context.Background()
	schema := fmt.Sprintf("reaper_empty_%d", time.Now().UnixNano())
	conn, err := pgx.Connect(ctx, server)
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "CREATE SCHEMA "+schema)
	require.NoError(t, err)
	t.Cleanup(func() {
		conn, err := pgx.Connect(ctx, server)
		if err != nil {
			t.Errorf("drop schema: %v", err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			t.Errorf("drop schema: %v", err)
		}
	})
	return schema
}

// The README's flag table shows the defaults the command really has (the
// recovery, cleanup and txn packages' constants).
func TestReadmeFlagTableShowsTheDefaults(t *testing.T) {
	for _, env := range []string{"REAPER_TTL", "REAPER_OUTBOX_RETENTION", "REAPER_TOMBSTONE_RETENTION", "REAPER_RESUME_DELAY", "REAPER_MAX_ATTEMPTS",
		"REAPER_MAX_AGE", "REAPER_UNKNOWN_WORKFLOW_DELAY", "REAPER_BATCH_SIZE", "REAPER_CLEANUP_PAUSE", "REAPER_LOG_LEVEL"} {
		t.Setenv(env, "") // unset: the built-in default
	}
	o, err := parseArgs([]string{"-once", "-database-url", "postgres://x/y"}, io.Discard)
	require.NoError(t, err)
	actual := map[string]string{
		"-ttl":                    o.ttl.String(),
		"-outbox-retention":       o.outboxRetention.String(),
		"-tombstone-retention":    o.tombstoneRetention.String(),
		"-resume-delay":           o.resumeDelay.String(),
		"-max-attempts":           fmt.Sprint(o.maxAttempts),
		"-max-age":                o.maxAge.String(),
		"-unknown-workflow-delay": o.unknownWorkflowDelay.String(),
		"-batch-size":             fmt.Sprint(o.batchSize),
		"-cleanup-pause":          o.cleanupPause.String(),
		"-log-level":              strings.ToLower(o.logLevel.String()),
	}
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	row := regexp.MustCompile("(?m)^\\| `(-[a-z-]+)` \\| `[A-Z_]+` \\| `([^`]+)`")
	documented := map[string]string{}
	for _, m := range row.FindAllStringSubmatch(string(readme), -1) {
		v := m[2]
		if d, err := time.ParseDuration(v); err == nil {
			v = d.String() // "24h" as the flag package prints it
		}
		documented[m[1]] = v
	}
	require.Equal(t, actual, documented)
}

// -cleanup-pause takes its default from $REAPER_CLEANUP_PAUSE, the flag
// wins over it, and unset it is cleanup.BatchPauseDefault.
func TestCleanupPauseComesFromTheFlagOrTheEnvironment(t *testing.T) {
	args := []string{"-once", "-database-url", "postgres://x/y"}
	t.Setenv("REAPER_CLEANUP_PAUSE", "")
	o, err := parseArgs(args, io.Discard)
	require.NoError(t, err)
	require.Equal(t, cleanup.BatchPauseDefault, o.cleanupPause)

	t.Setenv("REAPER_CLEANUP_PAUSE", "250ms")
	o, err = parseArgs(args, io.Discard)
	require.NoError(t, err)
	require.Equal(t, 250*time.Millisecond, o.cleanupPause)

	o, err = parseArgs(append(args, "-cleanup-pause", "40ms"), io.Discard)
	require.NoError(t, err)
	require.Equal(t, 40*time.Millisecond, o.cleanupPause)

	t.Setenv("REAPER_CLEANUP_PAUSE", "soon")
	_, err = parseArgs(args, io.Discard)
	require.ErrorIs(t, err, errUsage)
	require.ErrorContains(t, err, "REAPER_CLEANUP_PAUSE")
}
