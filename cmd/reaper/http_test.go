package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"image/png"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/opstest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// screenshot, when set, is where the status page test also writes its
// screenshot (the README's docs/status-page.png):
//
//	go test ./cmd/reaper -run StatusPage -args -screenshot=$PWD/docs/status-page.png
var screenshot = flag.String("screenshot", "", "write the status page's screenshot to this PNG file")

var (
	reaperOnce sync.Once
	reaperBin  string
	reaperErr  error
)

// sharedReaper builds the command once for the package's tests.
func sharedReaper(t *testing.T) string {
	t.Helper()
	reaperOnce.Do(func() {
		dir, err := os.MkdirTemp("", "reaper-bin-")
		if err != nil {
			reaperErr = err
			return
		}
		pgtest.AtExit(func() { _ = os.RemoveAll(dir) })
		reaperBin = filepath.Join(dir, "reaper")
		out, err := exec.Command("go", "build", "-o", reaperBin, ".").CombinedOutput()
		if err != nil {
			reaperErr = fmt.Errorf("go build: %v: %s", err, out)
		}
	})
	require.NoError(t, reaperErr)
	return reaperBin
}

// daemon is a reaper process running in interval mode.
type daemon struct {
	cmd  *exec.Cmd
	mu   sync.Mutex
	log  bytes.Buffer
	done chan error
}

func startDaemon(t *testing.T, bin, databaseURL string, args ...string) *daemon {
	t.Helper()
	d := &daemon{cmd: exec.Command(bin, args...), done: make(chan error, 1)}
	d.cmd.Env = append(os.Environ(), "DATABASE_URL="+databaseURL)
	stderr, err := d.cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, d.cmd.Start())
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			d.mu.Lock()
			d.log.WriteString(sc.Text() + "\n")
			d.mu.Unlock()
		}
		_, _ = io.Copy(io.Discard, stderr)
		d.done <- d.cmd.Wait()
	}()
	t.Cleanup(func() {
		if d.cmd.ProcessState == nil {
			_ = d.cmd.Process.Kill()
			<-d.done
		}
	})
	return d
}

func (d *daemon) lines(t *testing.T) []map[string]any {
	d.mu.Lock()
	defer d.mu.Unlock()
	return parseLines(t, d.log.String())
}

// waitLine waits for a log line with message msg and returns it.
func (d *daemon) waitLine(t *testing.T, msg string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		for _, l := range d.lines(t) {
			if l["msg"] == msg {
				return l
			}
		}
		select {
		case err := <-d.done:
			d.done <- err
			t.Fatalf("reaper exited (%v) before logging %q:\n%s", err, msg, d.log.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
	t.Fatalf("no %q line in:\n%s", msg, d.log.String())
	return nil
}

// stop sends SIGTERM and requires a clean exit.
func (d *daemon) stop(t *testing.T) {
	t.Helper()
	require.NoError(t, d.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-d.done:
		require.NoError(t, err, "exit status 0:\n%s", d.log.String())
	case <-time.After(20 * time.Second):
		t.Fatalf("still running 20s after SIGTERM:\n%s", d.log.String())
	}
}

// The <script> key and the other hostile strings the page must show as
// text.
const (
	scriptKey   = `<script>document.body.setAttribute('data-pwned','1')</script>`
	imgError    = `<img src=x onerror="document.body.setAttribute('data-pwned','2')"> 502 from upstream`
	markupScope = `acct_<b>bold</b>`
)

// seedStatus writes what the status page shows: a backlog on two topics,
// three dead letters, three failed keys (one with a <script> key) and two
// stalled keys, younger than the reaper's unknown-workflow delay so that
// its first round leaves them.
func seedStatus(t *testing.T, d *pgtest.DB) {
	t.Helper()
	p := d.Pool
	for i, age := range []time.Duration{252 * time.Second, 200 * time.Second, 95 * time.Second, 40 * time.Second, 12 * time.Second, 3 * time.Second, time.Second} {
		opstest.InsertMessage(t, p, opstest.Message{Topic: "receipts", Age: age, Attempts: i % 3, OrderingKey: fmt.Sprintf("ride:%d", 4100+i)})
	}
	opstest.InsertMessage(t, p, opstest.Message{Topic: "rides.completed", Age: 30 * time.Second})
	opstest.InsertMessage(t, p, opstest.Message{Topic: "rides.completed", Age: 2 * time.Second})
	for range 5 {
		opstest.InsertMessage(t, p, opstest.Message{Topic: "receipts", State: "published", Age: time.Hour})
	}
	opstest.InsertMessage(t, p, opstest.Message{Topic: "receipts", State: "dead", Age: 3 * time.Hour, DoneAgo: 2*time.Hour + 14*time.Minute,
		Attempts: 10, OrderingKey: "ride:4017", LastError: "nats: timeout waiting for the stream's acknowledgement"})
	opstest.InsertMessage(t, p, opstest.Message{Topic: "webhooks.partner", State: "dead", Age: 50 * time.Minute, DoneAgo: 47 * time.Minute,
		Attempts: 1, LastError: "permanent: POST https://partner.example.com/hooks: 410 Gone"})
	opstest.InsertMessage(t, p, opstest.Message{Topic: "webhooks.partner", State: "dead", Age: 20 * time.Minute, DoneAgo: 6 * time.Minute,
		Attempts: 10, LastError: imgError})

	opstest.InsertKey(t, p, opstest.Key{Scope: "acct_1MqLx2", Key: "ride-7f3a91c2", Workflow: "create_ride", Status: "failed",
		RecoveryPoint: "charge_created", Attempts: 10, Age: 5 * time.Hour, FinishedAgo: 3 * time.Hour, FailureReason: "max_attempts"})
	opstest.InsertKey(t, p, opstest.Key{Scope: markupScope, Key: scriptKey, Workflow: "create_ride", Status: "failed",
		RecoveryPoint: "ride_created", Attempts: 2, Age: 14 * time.Hour, FinishedAgo: 2 * time.Hour, FailureReason: "max_age"})
	opstest.InsertKey(t, p, opstest.Key{Scope: "acct_9ZrT04", Key: "refund-2024-118", Workflow: "refund_ride", Status: "failed",
		RecoveryPoint: "started", Attempts: 1, Age: 26 * time.Hour, FinishedAgo: 25 * time.Minute, FailureReason: "unknown_workflow"})
	opstest.InsertKey(t, p, opstest.Key{Scope: "acct_1MqLx2", Key: "ride-a04be611", Workflow: "create_ride",
		RecoveryPoint: "ride_created", Attempts: 2, Age: 12 * time.Minute, Idle: 9 * time.Minute, Lease: -8 * time.Minute})
	opstest.InsertKey(t, p, opstest.Key{Scope: "acct_77Hq0P", Key: "ride-5513ee0d", Workflow: "create_ride",
		RecoveryPoint: "charge_created", Attempts: 1, Age: 4 * time.Minute, Idle: 3 * time.Minute})
	opstest.InsertKey(t, p, opstest.Key{Scope: "acct_77Hq0P", Key: "ride-in-flight", Workflow: "create_ride",
		Age: 2 * time.Second, Lease: 88 * time.Second})
}

// requireOldestAge checks a reported age of the oldest pending message,
// which seedStatus staged 252 s in the past some time after seeded: it is at
// least that (less a second of rounding) and grew by no more than the wall
// time since. A fixed tolerance fails on a loaded machine, where the
// daemon's first round can come a minute or more after seeding.
func requireOldestAge(t *testing.T, age time.Duration, seeded time.Time) {
	t.Helper()
	const staged = 252 * time.Second
	require.GreaterOrEqual(t, age, staged-time.Second, "oldest pending age")
	require.LessOrEqual(t, age, staged+time.Since(seeded)+time.Second, "oldest pending age")
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	client := &http.Client{Timeout: 30 * time.Second}
	resp, err := client.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// metric returns the value of the single sample of name (labels aside)
// in a Prometheus text exposition, failing if there is none.
func metric(t *testing.T, exposition, name, labels string) string {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\{([^}]*)\} (\S+)$`)
	for _, m := range re.FindAllStringSubmatch(exposition, -1) {
		if strings.Contains(m[1], labels) {
			return m[2]
		}
	}
	t.Fatalf("no sample of %s{%s} in:\n%s", name, labels, exposition)
	return ""
}

func TestReaperServesMetricsHealthAndStatusPage(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seeded := time.Now()
	seedStatus(t, d)
	p := startDaemon(t, sharedReaper(t), d.ConnString(t), "-interval", "1h", "-http", "127.0.0.1:0")
	addr, _ := p.waitLine(t, "reaper http listening")["addr"].(string)
	require.NotEmpty(t, addr)
	base := "http://" + addr
	round := p.waitLine(t, "reaper round")

	t.Run("the_round_summary_ends_with_the_outbox_backlog", func(t *testing.T) {
		require.Equal(t, 9.0, round["outbox_pending"], "nine pending messages: %v", round)
		age, ok := round["outbox_oldest_pending_age"].(float64) // a time.Duration, in nanoseconds
		require.True(t, ok, "%v", round)
		requireOldestAge(t, time.Duration(age), seeded)
	})

	t.Run("metrics_has_the_gauges_and_the_rounds_counts", func(t *testing.T) {
		code, body := get(t, base+"/metrics")
		require.Equal(t, http.StatusOK, code)
		require.Equal(t, "9", metric(t, body, "atomicphase_outbox_pending", ""))
		require.Equal(t, "3", metric(t, body, "atomicphase_outbox_dead", ""))
		require.Equal(t, "2", metric(t, body, "atomicphase_keys_stalled", ""))
		age, err := strconv.ParseFloat(metric(t, body, "atomicphase_outbox_oldest_pending_age_seconds", ""), 64)
		require.NoError(t, err)
		requireOldestAge(t, time.Duration(age*float64(time.Second)), seeded)
		require.Equal(t, "0", metric(t, body, "atomicphase_recovery_resumed_total", ""))
		require.Equal(t, "0", metric(t, body, "atomicphase_recovery_failed_stalled_total", `atomicphase_failure_reason="unknown_workflow"`))
		require.Equal(t, "0", metric(t, body, "atomicphase_cleanup_keys_deleted_total", ""))
		require.Equal(t, "0", metric(t, body, "atomicphase_cleanup_skipped_total", ""))
		require.Contains(t, body, "\ngo_goroutines ", "Go runtime metrics")
		require.Contains(t, body, `service_name="atomicphase-reaper"`)
	})

	t.Run("healthz_is_200_with_the_database_reachable_and_the_schema_current", func(t *testing.T) {
		code, body := get(t, base+"/healthz")
		require.Equal(t, http.StatusOK, code, body)
		require.JSONEq(t, `{"status":"ok","database":"reachable","schema":"current"}`, body)
	})

	t.Run("the_status_page_renders_the_seeded_figures_and_stored_text_inert", func(t *testing.T) {
		code, html := get(t, base+"/")
		require.Equal(t, http.StatusOK, code)
		require.NotContains(t, html, "<script", "the page has no script of its own, and stored text is escaped")
		dom := chromiumDOM(t, base+"/")

		for id, value := range map[string]string{
			"outbox-pending": "9", "outbox-dead": "3", "keys-stalled": "2", "keys-running": "3", "keys-failed": "3",
		} {
			re := regexp.MustCompile(`id="` + id + `"[^>]*>\s*<div class="label">[^<]*</div>\s*<div class="value">` + value + `</div>`)
			require.Regexp(t, re, dom, "card %s shows %s", id, value)
		}
		shown := regexp.MustCompile(`id="oldest-pending-age">(\d+m\d+s)<`).FindStringSubmatch(dom)
		require.Len(t, shown, 2, "the oldest pending age is shown as minutes and seconds")
		age, err := time.ParseDuration(shown[1])
		require.NoError(t, err)
		requireOldestAge(t, age, seeded)
		for _, text := range []string{
			"ride-7f3a91c2", "refund-2024-118", "max_attempts", "unknown_workflow", "charge_created",
			"webhooks.partner", "nats: timeout waiting for the stream's acknowledgement",
			"permanent: POST https://partner.example.com/hooks: 410 Gone", "ride:4017", "rides.completed",
		} {
			require.Contains(t, dom, text)
		}
		// Hostile stored text is shown as text, and ran nothing.
		require.Contains(t, dom, "&lt;script&gt;document.body.setAttribute('data-pwned','1')&lt;/script&gt;")
		require.Contains(t, dom, "acct_&lt;b&gt;bold&lt;/b&gt;")
		require.Contains(t, dom, "&lt;img src=x onerror=")
		require.NotContains(t, dom, "data-pwned=")
		require.NotRegexp(t, `<(script|img)[\s>]`, dom, "no element came from stored text")
		require.NotContains(t, dom, "<b>bold")

		png := chromiumScreenshot(t, base+"/")
		if *screenshot != "" {
			require.NoError(t, os.WriteFile(*screenshot, png, 0o644))
			t.Logf("wrote %s", *screenshot)
		}
	})

	t.Run("unknown_paths_are_404", func(t *testing.T) {
		code, _ := get(t, base+"/nothing-here")
		require.Equal(t, http.StatusNotFound, code)
	})

	t.Run("healthz_is_503_when_the_schema_falls_behind", func(t *testing.T) {
		_, err := d.Pool.Exec(context.Background(),
			`DELETE FROM atomicphase_goose_db_version WHERE version_id = (SELECT max(version_id) FROM atomicphase_goose_db_version)`)
		require.NoError(t, err)
		code, body := get(t, base+"/healthz")
		require.Equal(t, http.StatusServiceUnavailable, code, body)
		var h map[string]string
		require.NoError(t, json.Unmarshal([]byte(body), &h))
		require.Equal(t, "unavailable", h["status"])
		require.Equal(t, "behind", h["schema"])
		require.Contains(t, h["error"], "is not applied")
	})

	p.stop(t)
}

func TestHTTPNeedsIntervalMode(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"-database-url=postgres://nobody@127.0.0.1:1/none", "-once", "-http", ":0"}, &stdout, &stderr)
	require.Equal(t, exitUsage, code)
	require.Contains(t, stderr.String(), "-http serves while the reaper runs: use it with -interval")
}

func TestHTTPAddressInUseExitsOne(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	first := startDaemon(t, sharedReaper(t), d.ConnString(t), "-interval", "1h", "-http", "127.0.0.1:0")
	addr, _ := first.waitLine(t, "reaper http listening")["addr"].(string)
	r := runReaper(t, sharedReaper(t), d.ConnString(t), "-interval", "1h", "-http", addr)
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "cannot serve http")
	first.stop(t)
}

// chromium returns the headless browser the page tests use. Without one,
// the test is skipped on a developer's machine and fails under CI (CI
// set), whose script installs it.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "" {
		t.Skip("no chromium installed; CI runs this test")
	}
	t.Fatal("no chromium installed: install the Debian package chromium")
	return ""
}

func runChromium(t *testing.T, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	base := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
		"--no-first-run", "--disable-extensions", "--user-data-dir=" + t.TempDir()}
	cmd := exec.CommandContext(ctx, chromium(t), append(base, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatalf("chromium %v: %v\n%s", args, err, stderr.String())
	}
	require.NoError(t, ctx.Err(), "chromium timed out: %s", stderr.String())
	return out
}

// chromiumDOM loads url in headless Chromium and returns the DOM as
// rendered, after any script would have run.
func chromiumDOM(t *testing.T, url string) string {
	t.Helper()
	return string(runChromium(t, "--dump-dom", url))
}

// chromiumScreenshot returns a PNG of url as Chromium renders it.
func chromiumScreenshot(t *testing.T, url string) []byte {
	t.Helper()
	path := filepath.Join(t.TempDir(), "status.png")
	runChromium(t, "--hide-scrollbars", "--window-size=1280,960", "--screenshot="+path, url)
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	img, err := png.Decode(bytes.NewReader(b))
	require.NoError(t, err)
	require.Equal(t, 1280, img.Bounds().Dx())
	return b
}
