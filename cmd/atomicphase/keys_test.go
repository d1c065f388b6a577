package main

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/opstest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// seedKeys writes a running workflow key two phases in, with an expired
// lease and three messages; a finished single-phase key; and a key whose
// scope carries a terminal escape sequence.
func seedKeys(t *testing.T, d *pgtest.DB) int64 {
	t.Helper()
	id := opstest.InsertKey(t, d.Pool, opstest.Key{Scope: "acct_1", Key: "ride-42", Workflow: "create_ride",
		RecoveryPoint: "charge_created", Attempts: 2, Age: 20 * time.Minute, Idle: 5 * time.Minute, Lease: -4 * time.Minute,
		Params:       `{"amount_cents":1200,"origin":"Ebersberg"}`,
		PhaseResults: `{"ride_created":{"ride_id":17},"charge_created":{"charge_id":"ch_3NqL","amount":1200}}`})
	opstest.InsertMessage(t, d.Pool, opstest.Message{KeyID: id, Topic: "receipts", State: "published", Attempts: 1})
	opstest.InsertMessage(t, d.Pool, opstest.Message{KeyID: id, Topic: "rides.events", State: "dead", Attempts: 10, LastError: "410 Gone"})
	opstest.InsertMessage(t, d.Pool, opstest.Message{KeyID: id, Topic: "audit"})
	opstest.InsertKey(t, d.Pool, opstest.Key{Scope: "acct_1", Key: "order-7", Status: "finished", Age: time.Hour,
		ResponseStatus: 201, ResponseBody: "{\"order\":7,\n\"note\":\"\x1b[2Jcleared\"}"})
	opstest.InsertKey(t, d.Pool, opstest.Key{Scope: "acct_\x1b[31mred", Key: "k", Status: "finished", Age: time.Hour})
	return id
}

func TestKeysShowPrintsTheTimeline(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seedKeys(t, d)

	r := apdb(t, d, "", "keys", "show", "acct_1", "ride-42")
	require.Equal(t, exitOK, r.code, r.stderr)
	out := r.stdout
	for _, want := range []string{
		"key        ride-42", "scope      acct_1", "request    POST /rides", `"origin":"Ebersberg"`,
		"workflow   create_ride", "status     running, at charge_created", "attempts   2",
		"lease      expired 4m", "free to take over",
		"outbox messages (3)", "410 Gone", "rides.events", "dead", "published", "pending",
	} {
		require.Contains(t, out, want)
	}
	// The phases in commit order, with their results, between the creation
	// and the last run.
	require.Regexp(t, regexp.MustCompile(`(?s)created \(20m\d+s ago\).*phase ride_created  \{"ride_id":17\}.*`+
		`phase charge_created  \{"charge_id":"ch_3NqL","amount":1200\}.*last run, attempt 2 \(5m\d+s ago\); next step after charge_created`), out)

	r = apdb(t, d, "", "--json", "keys", "show", "acct_1", "ride-42")
	require.Equal(t, exitOK, r.code, r.stderr)
	var v keyView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	require.Equal(t, []string{"ride_created", "charge_created"}, []string{v.Phases[0].Name, v.Phases[1].Name})
	require.JSONEq(t, `{"charge_id":"ch_3NqL","amount":1200}`, string(v.Phases[1].Result))
	require.JSONEq(t, `{"amount_cents":1200,"origin":"Ebersberg"}`, string(v.Params))
	require.True(t, v.Lease.Held)
	require.False(t, v.Lease.Live)
	require.Nil(t, v.Response)
	require.Len(t, v.Messages, 3)
	require.Equal(t, "dead", v.Messages[1].State)
}

// A finished key shows its stored response; stored text cannot drive the
// terminal: escape sequences come out escaped.
func TestKeysShowPrintsTheResponseAndEscapesStoredText(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seedKeys(t, d)

	r := apdb(t, d, "", "keys", "show", "acct_1", "order-7")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, "status     finished")
	require.Contains(t, r.stdout, "response   201")
	require.Contains(t, r.stdout, "Content-Type: application/json")
	require.Contains(t, r.stdout, `"note":"\x1b[2Jcleared"`)
	require.Contains(t, r.stdout, "finished -> 201")
	require.NotContains(t, r.stdout, "\x1b")

	r = apdb(t, d, "", "keys", "show", "acct_\x1b[31mred", "k")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, `scope      acct_\x1b[31mred`)
	require.NotContains(t, r.stdout, "\x1b")
}

func TestKeysShowRejectsBadInputBeforeAnySQL(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	requireError(t, apdb(t, d, "", "keys", "show", "acct_1", "missing"), exitFailure, `no key "missing" in scope "acct_1"`)
	requireError(t, apdb(t, d, "", "keys", "show", "acct_1"), exitUsage, "want SCOPE KEY, got 1 arguments")
	requireError(t, apdb(t, d, "", "keys", "show", "acct_1", "bad\x01key"), exitUsage, "invalid")
	requireError(t, apdb(t, d, "", "keys", "show", "acct_1", strings.Repeat("k", 256)), exitUsage, "invalid")
	requireError(t, apdb(t, d, "", "keys", "show", "acct_1", ""), exitUsage, "invalid")
	// A scope starting with a dash comes after "--".
	r := apdb(t, d, "", "keys", "show", "--", "-acct", "k")
	requireError(t, r, exitFailure, `no key "k" in scope "-acct"`)
}

func TestKeysStalledListsWhatAResumerWouldTake(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seedKeys(t, d)
	opstest.InsertKey(t, d.Pool, opstest.Key{Scope: "acct_2", Key: "older", Workflow: "refund", Age: time.Hour, Idle: 2 * time.Minute})
	opstest.InsertKey(t, d.Pool, opstest.Key{Scope: "acct_2", Key: "leased", Workflow: "refund", Age: time.Hour, Idle: time.Hour, Lease: time.Minute})
	opstest.InsertKey(t, d.Pool, opstest.Key{Scope: "acct_2", Key: "busy", Workflow: "refund", Age: time.Second})

	r := apdb(t, d, "", "keys", "stalled")
	require.Equal(t, exitOK, r.code, r.stderr)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	require.Regexp(t, `^SCOPE\s+KEY\s+WORKFLOW\s+AT\s+ATTEMPTS\s+AGE\s+IDLE$`, lines[0])
	require.Regexp(t, `^acct_2\s+older\s+refund\s+started\s+1\s+1h[01]m\s+2m\d+s$`, lines[1], "oldest first")
	require.Regexp(t, `^acct_1\s+ride-42\s+create_ride\s+charge_created\s+2\s+20m\d+s\s+5m\d+s$`, lines[2])
	require.Contains(t, r.stdout, "2 stalled keys: running, lease free or expired, idle over 1m0s")

	r = apdb(t, d, "", "keys", "stalled", "--after", "3m", "--json")
	require.Equal(t, exitOK, r.code, r.stderr)
	var rows []map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rows))
	require.Len(t, rows, 1)
	require.Equal(t, "ride-42", rows[0]["key"])

	r = apdb(t, d, "", "keys", "stalled", "--limit", "1")
	require.Contains(t, r.stdout, "1 stalled key (the oldest; --limit for more)")
	r = apdb(t, d, "", "keys", "stalled", "--after", "2h")
	require.Contains(t, r.stdout, "no stalled keys")
}

func TestKeysFailStoresATerminalResponseAfterConfirmation(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seedKeys(t, d)
	status := func() (string, string) {
		var s, reason string
		require.NoError(t, d.Pool.QueryRow(context.Background(),
			`SELECT status, coalesce(failure_reason, '') FROM idempotency_keys WHERE scope = 'acct_1' AND key = 'ride-42'`).Scan(&s, &reason))
		return s, reason
	}

	// Declined, or no answer: nothing changes.
	for _, answer := range []string{"n\n", "", "maybe\n"} {
		r := apdb(t, d, answer, "keys", "fail", "acct_1", "ride-42", "--reason", "provider confirmed the charge failed")
		require.Equal(t, exitFailure, r.code)
		require.Contains(t, r.stderr, `Fail key "ride-42" in scope "acct_1" (workflow create_ride at charge_created, 2 attempts, created 20m`)
		require.Contains(t, r.stderr, "not confirmed; nothing changed")
		require.Empty(t, auditLines(t, r.stderr))
		s, _ := status()
		require.Equal(t, "running", s)
	}

	r := apdb(t, d, "yes\n", "keys", "fail", "acct_1", "ride-42", "--reason", "provider confirmed the charge failed")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, `failed key "ride-42" in scope "acct_1"`)
	s, reason := status()
	require.Equal(t, "failed", s)
	require.Equal(t, "operator: provider confirmed the charge failed", reason)
	var code int
	var body []byte
	var live bool
	require.NoError(t, d.Pool.QueryRow(context.Background(), `SELECT response_status, response_body, lease_token IS NOT NULL
		FROM idempotency_keys WHERE key = 'ride-42'`).Scan(&code, &body, &live))
	require.Equal(t, 500, code)
	require.False(t, live)
	var problem map[string]any
	require.NoError(t, json.Unmarshal(body, &problem))
	require.Equal(t, "operator", problem["reason"])
	require.NotContains(t, string(body), "provider confirmed", "the operator's words stay out of the client's response")
	audit := auditLines(t, r.stderr)
	require.Len(t, audit, 1)
	require.Equal(t, "keys fail", audit[0]["action"])
	require.Equal(t, "ride-42", audit[0]["key"])
	require.Equal(t, "charge_created", audit[0]["recovery_point"])
	require.NotEmpty(t, audit[0]["user"])
	require.NotEmpty(t, audit[0]["host"])

	// Once failed, it is terminal.
	requireError(t, apdb(t, d, "", "keys", "fail", "acct_1", "ride-42", "--reason", "again", "--yes"), exitFailure,
		`key "ride-42" in scope "acct_1" is already failed; nothing changed`)
}

func TestKeysFailRefusesWhatItMustNotTouch(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seedKeys(t, d)
	opstest.InsertKey(t, d.Pool, opstest.Key{Scope: "acct_2", Key: "live", Workflow: "refund", Age: time.Minute, Lease: 80 * time.Second})
	snapshot := func() string {
		var s string
		require.NoError(t, d.Pool.QueryRow(context.Background(),
			`SELECT md5(string_agg(k::text, '|' ORDER BY id)) FROM idempotency_keys k`).Scan(&s))
		return s
	}
	before := snapshot()
	requireError(t, apdb(t, d, "", "keys", "fail", "acct_2", "live", "--reason", "stuck", "--yes"), exitFailure,
		`key "live" in scope "acct_2" is held by a live attempt for 1m`)
	requireError(t, apdb(t, d, "", "keys", "fail", "acct_1", "order-7", "--reason", "stuck", "--yes"), exitFailure,
		"is already finished; nothing changed")
	requireError(t, apdb(t, d, "", "keys", "fail", "acct_1", "missing", "--reason", "stuck", "--yes"), exitFailure,
		`no key "missing" in scope "acct_1"`)
	requireError(t, apdb(t, d, "", "keys", "fail", "acct_1", "ride-42", "--yes"), exitUsage, "--reason is required")
	requireError(t, apdb(t, d, "", "keys", "fail", "acct_1", "ride-42", "--reason", "two\nlines", "--yes"), exitUsage,
		"--reason must be one line")
	require.Equal(t, before, snapshot(), "nothing changed")
}
