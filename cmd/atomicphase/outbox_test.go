package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/opstest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
)

type dead struct {
	row int64
	id  uuid.UUID
}

// seedOutbox writes 3 pending messages (2 receipts, the oldest 3 minutes
// old; 1 webhook), 3 dead letters (2 webhooks, 1 receipts, one with an
// ordering key) and 2 published ones.
func seedOutbox(t *testing.T, d *pgtest.DB) []dead {
	t.Helper()
	p := d.Pool
	opstest.InsertMessage(t, p, opstest.Message{Topic: "receipts", Age: 3 * time.Minute})
	opstest.InsertMessage(t, p, opstest.Message{Topic: "receipts", Age: time.Second})
	opstest.InsertMessage(t, p, opstest.Message{Topic: "webhooks", Age: 10 * time.Second})
	var out []dead
	for _, m := range []opstest.Message{
		{Topic: "webhooks", State: "dead", Age: time.Hour, DoneAgo: 50 * time.Minute, Attempts: 10, LastError: "timeout after 10s"},
		{Topic: "webhooks", State: "dead", Age: time.Hour, DoneAgo: 20 * time.Minute, Attempts: 1, LastError: "permanent: 410 Gone"},
		{Topic: "receipts", State: "dead", Age: time.Hour, DoneAgo: 5 * time.Minute, Attempts: 10, OrderingKey: "ride:9",
			LastError: "nats: \x1b[31mno responders"},
	} {
		row, id := opstest.InsertMessage(t, p, m)
		out = append(out, dead{row, id})
	}
	opstest.InsertMessage(t, p, opstest.Message{Topic: "receipts", State: "published"})
	opstest.InsertMessage(t, p, opstest.Message{Topic: "receipts", State: "published"})
	return out
}

func TestOutboxStatusShowsTheBacklogPerTopic(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seedOutbox(t, d)
	opstest.InsertKey(t, d.Pool, opstest.Key{Key: "stalled", Workflow: "w", Age: time.Hour, Idle: 10 * time.Minute})

	r := apdb(t, d, "", "outbox", "status")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Regexp(t, `pending       3, the oldest staged 3m\d+s ago`, r.stdout)
	require.Contains(t, r.stdout, "dead letters  3")
	require.Contains(t, r.stdout, "stalled keys  1 (running, lease free or expired, idle over 1m0s)")
	require.Regexp(t, `(?m)^receipts\s+2\s+3m\d+s\s+1$`, r.stdout)
	require.Regexp(t, `(?m)^webhooks\s+1\s+1\ds\s+2$`, r.stdout)

	r = apdb(t, d, "", "outbox", "status", "--json", "--stalled-after", "1h")
	require.Equal(t, exitOK, r.code, r.stderr)
	var s struct {
		P       int64   `json:"pending"`
		D       int64   `json:"dead"`
		Stalled int64   `json:"keys_stalled"`
		Age     float64 `json:"oldest_pending_age_seconds"`
		Topics  []struct {
			Topic   string `json:"topic"`
			Pending int64  `json:"pending"`
			Dead    int64  `json:"dead"`
		} `json:"topics"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &s))
	require.Equal(t, int64(3), s.P)
	require.Equal(t, int64(3), s.D)
	require.Zero(t, s.Stalled, "idle 10 minutes is not stalled after an hour")
	require.InDelta(t, 180, s.Age, 60)
	require.Len(t, s.Topics, 2)
}

func TestOutboxDeadListsTheNewestWithTheirErrors(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ds := seedOutbox(t, d)

	r := apdb(t, d, "", "outbox", "dead")
	require.Equal(t, exitOK, r.code, r.stderr)
	lines := strings.Split(r.stdout, "\n")
	require.Regexp(t, `^ROW\s+MESSAGE ID\s+TOPIC\s+ORDERING KEY\s+ATTEMPTS\s+DEAD FOR\s+LAST ERROR`, lines[0])
	require.Regexp(t, `^`+strconv.FormatInt(ds[2].row, 10)+`\s+`+ds[2].id.String()+`\s+receipts\s+ride:9\s+10\s+5m\d+s\s+nats: \\x1b\[31mno responders`, lines[1],
		"newest first, the escape sequence escaped")
	require.NotContains(t, r.stdout, "\x1b")
	require.Contains(t, r.stdout, "3 dead letters; redrive with: atomicphase outbox redrive ROW...")

	r = apdb(t, d, "", "outbox", "dead", "--topic", "webhooks", "--limit", "1", "--json")
	require.Equal(t, exitOK, r.code, r.stderr)
	var rows []map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rows))
	require.Len(t, rows, 1)
	require.Equal(t, "permanent: 410 Gone", rows[0]["last_error"])
	require.Equal(t, ds[1].id.String(), rows[0]["message_id"])

	r = apdb(t, d, "", "outbox", "dead", "--topic", "webhooks", "--limit", "1")
	require.Contains(t, r.stdout, `2 dead letters of topic "webhooks" (the newest 1; --limit for more)`)
	r = apdb(t, d, "", "outbox", "dead", "--topic", "nothing")
	require.Contains(t, r.stdout, `no dead letters of topic "nothing"`)
}

func TestOutboxRedriveByIDWritesAnAuditLine(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ds := seedOutbox(t, d)

	// A row id and a message id, after a confirmation.
	r := apdb(t, d, "y\n", "outbox", "redrive", strconv.FormatInt(ds[0].row, 10), ds[2].id.String())
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stderr, "Redrive 2 dead letters ("+strconv.FormatInt(ds[0].row, 10)+", "+ds[2].id.String()+") to pending, attempts reset to 0? [y/N]")
	require.Contains(t, r.stdout, "redrove 2 messages: pending again, attempts from 0, due now")
	require.Contains(t, r.stdout, "note: 1 of them have an ordering key")
	require.Equal(t, 2, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE id = ANY($1) AND dead_at IS NULL AND attempts = 0`,
		[]int64{ds[0].row, ds[2].row}))
	audit := auditLines(t, r.stderr)
	require.Len(t, audit, 1)
	require.Equal(t, "outbox redrive", audit[0]["action"])
	require.Equal(t, 2.0, audit[0]["count"])
	require.Equal(t, []any{float64(ds[0].row), float64(ds[2].row)}, audit[0]["row_ids"])
	msgs := audit[0]["messages"].([]any)
	require.Equal(t, "timeout after 10s", msgs[0].(map[string]any)["last_error"], "what it was before")
	require.Equal(t, 10.0, msgs[0].(map[string]any)["previous_attempts"])

	// JSON for scripts.
	r = apdb(t, d, "", "--json", "outbox", "redrive", ds[1].id.String(), "--yes")
	require.Equal(t, exitOK, r.code, r.stderr)
	var got []map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &got))
	require.Equal(t, "permanent: 410 Gone", got[0]["last_error"])
	require.Zero(t, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL`))
}

func TestOutboxRedriveAllOfATopic(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seedOutbox(t, d)
	r := apdb(t, d, "y\n", "outbox", "redrive", "--all", "--topic", "webhooks")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stderr, `Redrive all 2 dead letters of topic "webhooks" to pending`)
	require.Contains(t, r.stdout, "redrove 2 messages")
	require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL AND topic = 'receipts'`))
	r = apdb(t, d, "", "outbox", "redrive", "--all", "--topic", "webhooks")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, "no dead letters to redrive")
}

func TestOutboxRedriveRefusesBadIDsAndChangesNothing(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ds := seedOutbox(t, d)
	pendingRow, _ := opstest.InsertMessage(t, d.Pool, opstest.Message{})
	deadNow := func() int { return d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL`) }

	requireError(t, apdb(t, d, "", "outbox", "redrive", "12x", "--yes"), exitUsage,
		`malformed id "12x": give a row id (a positive integer) or a message id (a UUID)`)
	requireError(t, apdb(t, d, "", "outbox", "redrive", "-5", "--yes"), exitUsage, "flag provided but not defined")
	requireError(t, apdb(t, d, "", "outbox", "redrive", "--", "-5", "--yes"), exitUsage, `malformed id "-5"`)
	requireError(t, apdb(t, d, "", "outbox", "redrive", "0", "--yes"), exitUsage, `malformed id "0"`)
	requireError(t, apdb(t, d, "", "outbox", "redrive", "--yes"), exitUsage, "give the ids of the messages to redrive, or --all")
	requireError(t, apdb(t, d, "", "outbox", "redrive", "1", "--all", "--yes"), exitUsage, "give ids or --all, not both")
	requireError(t, apdb(t, d, "", "outbox", "redrive", "1", "--topic", "x", "--yes"), exitUsage, "--topic goes with --all")
	require.Equal(t, 3, deadNow())

	// One id that is not a dead letter: nothing is redriven.
	unknown := uuid.New()
	r := apdb(t, d, "", "outbox", "redrive", strconv.FormatInt(ds[0].row, 10), strconv.FormatInt(pendingRow, 10), unknown.String(), "--yes")
	requireError(t, r, exitFailure, "outbox redrive: not dead-lettered: "+strconv.FormatInt(pendingRow, 10)+", "+unknown.String())
	require.Empty(t, auditLines(t, r.stderr))
	require.Equal(t, 3, deadNow())

	// Not confirmed.
	requireError(t, apdb(t, d, "no\n", "outbox", "redrive", "--all"), exitFailure, "not confirmed; nothing changed")
	require.Equal(t, 3, deadNow())
}

// The exported files are the embedded migrations, byte for byte; a second
// export into the same directory changes nothing, and a directory holding
// another file of the same name is refused before anything is written.
func TestMigrationsExportWritesTheEmbeddedFiles(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "db", "atomicphase")
	r := ap(t, "", "migrations", "export", dir)
	require.Equal(t, exitOK, r.code, r.stderr)
	entries, err := migrations.FS.ReadDir(".")
	require.NoError(t, err)
	got, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, got, len(entries))
	for _, e := range entries {
		want, err := migrations.FS.ReadFile(e.Name())
		require.NoError(t, err)
		have, err := os.ReadFile(filepath.Join(dir, e.Name()))
		require.NoError(t, err)
		require.Equal(t, want, have, e.Name())
		require.Contains(t, r.stdout, "written   "+filepath.Join(dir, e.Name()))
	}
	require.Contains(t, r.stdout, "goose -dir \""+dir+"\" -table atomicphase_goose_db_version postgres \"$DATABASE_URL\" up")

	r = ap(t, "", "--json", "migrations", "export", dir)
	require.Equal(t, exitOK, r.code, r.stderr)
	var files []map[string]string
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &files))
	for _, f := range files {
		require.Equal(t, "unchanged", f["status"])
	}

	other := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(other, entries[1].Name()), []byte("-- edited\n"), 0o644))
	requireError(t, ap(t, "", "migrations", "export", other), exitFailure, "exists with other content; nothing written")
	left, err := os.ReadDir(other)
	require.NoError(t, err)
	require.Len(t, left, 1)

	requireError(t, ap(t, "", "migrations", "export"), exitUsage, "want DIR")
}
