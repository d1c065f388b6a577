package main

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/failure"
	"github.com/atomicphase/atomicphase/txn"
)

// maxKeyMessages is how many of a key's outbox messages keys show lists.
const maxKeyMessages = 100

// maxReasonBytes bounds the reason an operator gives to keys fail.
const maxReasonBytes = 500

// scopeAndKey checks the SCOPE KEY arguments as the library does, before
// any SQL.
func scopeAndKey(args []string) (string, string, error) {
	if len(args) != 2 {
		return "", "", fmt.Errorf("%w: want SCOPE KEY, got %d arguments (an empty scope is '')", errUsage, len(args))
	}
	if err := txn.ValidateScope(args[0]); err != nil {
		return "", "", fmt.Errorf("%w: %w", errUsage, err)
	}
	if err := txn.ValidateKey(args[1]); err != nil {
		return "", "", fmt.Errorf("%w: %w", errUsage, err)
	}
	return args[0], args[1], nil
}

// errKeyNotFound: no key of that scope and name.
type errKeyNotFound struct{ scope, key string }

func (e errKeyNotFound) Error() string {
	return fmt.Sprintf("no key %q in scope %q (it never existed, or cleanup deleted it after its TTL)", e.key, e.scope)
}

var keysShow = &command{
	name:    "keys show",
	args:    "SCOPE KEY",
	summary: "a key's timeline: created, phases with results, attempts, lease, response",
	define:  func(*flag.FlagSet) func(e *env, args []string) error { return showKey },
}

func showKey(e *env, args []string) error {
	scope, key, err := scopeAndKey(args)
	if err != nil {
		return err
	}
	if err := e.connect(); err != nil {
		return err
	}
	q := db.New(e.pool)
	row, err := q.KeyDetail(e.ctx, db.KeyDetailParams{Scope: scope, Key: key})
	if errors.Is(err, pgx.ErrNoRows) {
		return errKeyNotFound{scope, key}
	}
	if err != nil {
		return err
	}
	msgs, err := q.KeyMessages(e.ctx, db.KeyMessagesParams{
		IdempotencyKeyID: pgtype.Int8{Int64: row.ID, Valid: true}, MaxRows: maxKeyMessages})
	if err != nil {
		return err
	}
	v, err := newKeyView(row, msgs)
	if err != nil {
		return err
	}
	if e.json {
		return e.printJSON(v)
	}
	v.print(e.stdout)
	return nil
}

// keyView is what keys show prints; its JSON form is for scripts.
type keyView struct {
	ID            int64           `json:"id"`
	Scope         string          `json:"scope"`
	Key           string          `json:"key"`
	Method        string          `json:"request_method"`
	Path          string          `json:"request_path"`
	Params        json.RawMessage `json:"request_params"`
	Fingerprint   string          `json:"fingerprint"`
	Workflow      string          `json:"workflow"`
	Status        string          `json:"status"`
	RecoveryPoint string          `json:"recovery_point"`
	Attempts      int32           `json:"attempts"`
	Lease         leaseView       `json:"lease"`
	CreatedAt     time.Time       `json:"created_at"`
	LastRunAt     time.Time       `json:"last_run_at"`
	FinishedAt    *time.Time      `json:"finished_at"`
	Phases        []phaseView     `json:"phases"`
	Response      *responseView   `json:"response"`
	FailureReason *string         `json:"failure_reason"`
	Messages      []messageView   `json:"outbox_messages"`
	ReadAt        time.Time       `json:"read_at"`
}

type leaseView struct {
	Held             bool       `json:"held"`
	Live             bool       `json:"live"`
	Until            *time.Time `json:"until"`
	RemainingSeconds float64    `json:"remaining_seconds"`
}

type phaseView struct {
	Name   string          `json:"name"`
	Result json.RawMessage `json:"result"`
}

type responseView struct {
	Status     int32               `json:"status"`
	Headers    map[string][]string `json:"headers"`
	Body       *string             `json:"body,omitempty"`        // when it is UTF-8 text
	BodyBase64 *string             `json:"body_base64,omitempty"` // otherwise
}

type messageView struct {
	RowID       int64      `json:"row_id"`
	MessageID   string     `json:"message_id"`
	Topic       string     `json:"topic"`
	State       string     `json:"state"`
	Attempts    int32      `json:"attempts"`
	LastError   string     `json:"last_error,omitempty"`
	CreatedAt   time.Time  `json:"created_at"`
	PublishedAt *time.Time `json:"published_at,omitempty"`
	DeadAt      *time.Time `json:"dead_at,omitempty"`
}

func newKeyView(r db.KeyDetailRow, msgs []db.KeyMessagesRow) (*keyView, error) {
	v := &keyView{
		ID: r.ID, Scope: r.Scope, Key: r.Key, Method: r.RequestMethod, Path: r.RequestPath,
		Fingerprint: hex.EncodeToString(r.Fingerprint), Workflow: r.Workflow, Status: r.Status,
		RecoveryPoint: r.RecoveryPoint, Attempts: r.Attempts, CreatedAt: r.CreatedAt, LastRunAt: r.LastRunAt,
		FinishedAt: r.FinishedAt, ReadAt: r.ReadAt, Phases: []phaseView{}, Messages: []messageView{},
		Lease: leaseView{Held: r.LeaseToken.Valid, Live: r.LeaseLive, Until: r.LeasedUntil, RemainingSeconds: r.LeaseRemainingSeconds},
	}
	if json.Valid(r.RequestParams) {
		v.Params = json.RawMessage(r.RequestParams)
	} else {
		s, _ := json.Marshal(string(r.RequestParams))
		v.Params = s
	}
	if r.FailureReason.Valid {
		v.FailureReason = &r.FailureReason.String
	}
	// Phases committed before lossless storage are in the jsonb column;
	// later ones in phase_results_raw, in commit order.
	for _, raw := range [][]byte{r.PhaseResults, r.PhaseResultsRaw} {
		phases, err := orderedMembers(raw)
		if err != nil {
			return nil, fmt.Errorf("key %d: stored phase results: %w", r.ID, err)
		}
		v.Phases = append(v.Phases, phases...)
	}
	if r.ResponseStatus.Valid {
		resp := &responseView{Status: r.ResponseStatus.Int32, Headers: map[string][]string{}}
		if len(r.ResponseHeaders) > 0 {
			_ = json.Unmarshal(r.ResponseHeaders, &resp.Headers)
		}
		if utf8.Valid(r.ResponseBody) {
			s := string(r.ResponseBody)
			resp.Body = &s
		} else {
			s := base64.StdEncoding.EncodeToString(r.ResponseBody)
			resp.BodyBase64 = &s
		}
		v.Response = resp
	}
	for _, m := range msgs {
		mv := messageView{RowID: m.ID, Topic: m.Topic, Attempts: m.Attempts, LastError: m.LastError,
			CreatedAt: m.CreatedAt, PublishedAt: m.PublishedAt, DeadAt: m.DeadAt, State: "pending"}
		if m.MessageID.Valid {
			mv.MessageID = m.MessageID.UUID.String()
		}
		switch {
		case m.PublishedAt != nil:
			mv.State = "published"
		case m.DeadAt != nil:
			mv.State = "dead"
		}
		v.Messages = append(v.Messages, mv)
	}
	return v, nil
}

// orderedMembers returns the members of a JSON object in the order they
// are written.
func orderedMembers(raw []byte) ([]phaseView, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "{}" || string(raw) == "null" {
		return nil, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil, fmt.Errorf("not a JSON object")
	}
	var out []phaseView
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil, err
		}
		name, _ := t.(string)
		var value json.RawMessage
		if err := dec.Decode(&value); err != nil {
			return nil, err
		}
		out = append(out, phaseView{Name: name, Result: value})
	}
	return out, nil
}

func (v *keyView) print(w io.Writer) {
	since := func(t time.Time) string { return human(v.ReadAt.Sub(t)) + " ago" }
	p := func(label, value string) { fmt.Fprintf(w, "%-10s %s\n", label, value) }
	p("key", safe(v.Key))
	p("scope", safe(v.Scope))
	p("id", strconv.FormatInt(v.ID, 10))
	p("request", safe(v.Method+" "+v.Path))
	p("params", safe(clip(300, string(v.Params))))
	if v.Workflow == "" {
		p("workflow", "(single phase)")
	} else {
		p("workflow", safe(v.Workflow))
	}
	status := v.Status
	switch {
	case v.Status == "running":
		status += ", at " + safe(v.RecoveryPoint)
	case v.FailureReason != nil:
		status += ": " + safe(*v.FailureReason)
	}
	p("status", status)
	p("attempts", strconv.Itoa(int(v.Attempts)))
	switch {
	case v.Lease.Live:
		p("lease", fmt.Sprintf("held by a live attempt for %s more (until %s)", ago(v.Lease.RemainingSeconds), stamp(*v.Lease.Until)))
	case v.Lease.Held:
		p("lease", fmt.Sprintf("expired %s (at %s): free to take over", since(*v.Lease.Until), stamp(*v.Lease.Until)))
	default:
		p("lease", "free")
	}

	fmt.Fprintln(w, "\ntimeline")
	line := func(at, what string) { fmt.Fprintf(w, "  %-21s %s\n", at, what) }
	line(stamp(v.CreatedAt), "created ("+since(v.CreatedAt)+")")
	for _, ph := range v.Phases {
		line("", "phase "+safe(ph.Name)+"  "+safe(clip(200, string(ph.Result))))
	}
	if v.Status == "running" {
		line(stamp(v.LastRunAt), fmt.Sprintf("last run, attempt %d (%s); next step after %s", v.Attempts, since(v.LastRunAt), safe(v.RecoveryPoint)))
	}
	if v.FinishedAt != nil {
		what := "finished"
		if v.Status == "failed" {
			what = "failed"
			if v.FailureReason != nil {
				what += ": " + safe(*v.FailureReason)
			}
		}
		if v.Response != nil {
			what += fmt.Sprintf(" -> %d", v.Response.Status)
		}
		line(stamp(*v.FinishedAt), what+" ("+since(*v.FinishedAt)+")")
	}

	if v.Response != nil {
		fmt.Fprintf(w, "\nresponse   %d\n", v.Response.Status)
		names := make([]string, 0, len(v.Response.Headers))
		for name := range v.Response.Headers {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			for _, value := range v.Response.Headers[name] {
				fmt.Fprintf(w, "  %s: %s\n", safe(name), safe(value))
			}
		}
		switch {
		case v.Response.Body != nil:
			fmt.Fprintf(w, "  %s\n", strings.ReplaceAll(safeText(clip(2000, *v.Response.Body)), "\n", "\n  "))
		case v.Response.BodyBase64 != nil:
			fmt.Fprintf(w, "  (binary, base64) %s\n", clip(2000, *v.Response.BodyBase64))
		}
	}

	if len(v.Messages) > 0 {
		fmt.Fprintf(w, "\noutbox messages (%d)\n", len(v.Messages))
		t := &table{tw: newTabWriter(w)}
		t.row("ROW", "MESSAGE ID", "TOPIC", "STATE", "ATTEMPTS", "STAGED", "LAST ERROR")
		for _, m := range v.Messages {
			t.row(strconv.FormatInt(m.RowID, 10), m.MessageID, m.Topic, m.State, strconv.Itoa(int(m.Attempts)),
				since(m.CreatedAt), clip(80, m.LastError))
		}
		t.flush()
	}
}

var keysStalled = &command{
	name:    "keys stalled",
	args:    "[--after D] [--limit N]",
	summary: "keys a Resumer would resume or fail: running, lease free or expired, idle over --after",
	define: func(fs *flag.FlagSet) func(e *env, args []string) error {
		stalledAfter := fs.Duration("after", time.Minute, "stalled this long after the last run (the Resumer's ResumeDelay)")
		limit := fs.Int("limit", 100, "list at most this many, oldest first (at most 10000)")
		return func(e *env, args []string) error { return listStalled(e, args, *stalledAfter, *limit) }
	},
}

func listStalled(e *env, args []string, stalledAfter time.Duration, stalledLimit int) error {
	if len(args) != 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, args[0])
	}
	if stalledAfter < 0 || stalledLimit < 1 || stalledLimit > 10000 {
		return fmt.Errorf("%w: --after must be positive and --limit from 1 to 10000", errUsage)
	}
	if err := e.connect(); err != nil {
		return err
	}
	rows, err := db.New(e.pool).ListStalledKeys(e.ctx, db.ListStalledKeysParams{
		StalledAfterSeconds: stalledAfter.Seconds(), MaxRows: int32(stalledLimit)})
	if err != nil {
		return err
	}
	if e.json {
		type stalled struct {
			ID            int64     `json:"id"`
			Scope         string    `json:"scope"`
			Key           string    `json:"key"`
			Workflow      string    `json:"workflow"`
			RecoveryPoint string    `json:"recovery_point"`
			Attempts      int32     `json:"attempts"`
			CreatedAt     time.Time `json:"created_at"`
			LastRunAt     time.Time `json:"last_run_at"`
		}
		out := []stalled{}
		for _, r := range rows {
			out = append(out, stalled{r.ID, r.Scope, r.Key, r.Workflow, r.RecoveryPoint, r.Attempts, r.CreatedAt, r.LastRunAt})
		}
		return e.printJSON(out)
	}
	if len(rows) == 0 {
		fmt.Fprintf(e.stdout, "no stalled keys (running, lease free or expired, idle over %v)\n", stalledAfter)
		return nil
	}
	t := e.table("SCOPE", "KEY", "WORKFLOW", "AT", "ATTEMPTS", "AGE", "IDLE")
	for _, r := range rows {
		t.row(r.Scope, r.Key, r.Workflow, r.RecoveryPoint, strconv.Itoa(int(r.Attempts)), ago(r.AgeSeconds), ago(r.IdleSeconds))
	}
	t.flush()
	more := ""
	if len(rows) == stalledLimit {
		more = " (the oldest; --limit for more)"
	}
	fmt.Fprintf(e.stdout, "\n%s%s: running, lease free or expired, idle over %v\n", count(int64(len(rows)), "stalled key", "stalled keys"), more, stalledAfter)
	return nil
}

var keysFail = &command{
	name:    "keys fail",
	args:    "SCOPE KEY --reason TEXT",
	summary: "fail a running key: every retry then gets a stored 500 problem response",
	writes:  true,
	define: func(fs *flag.FlagSet) func(e *env, args []string) error {
		reason := fs.String("reason", "", "why (required; stored in failure_reason as \"operator: TEXT\", not sent to clients)")
		return func(e *env, args []string) error { return failKey(e, args, *reason) }
	},
}

func failKey(e *env, args []string, failReason string) error {
	scope, key, err := scopeAndKey(args)
	if err != nil {
		return err
	}
	reason := strings.TrimSpace(failReason)
	switch {
	case reason == "":
		return fmt.Errorf("%w: --reason is required", errUsage)
	case len(reason) > maxReasonBytes || !utf8.ValidString(reason) || safe(reason) != reason:
		return fmt.Errorf("%w: --reason must be one line of at most %d bytes of UTF-8 text", errUsage, maxReasonBytes)
	}
	if err := e.connect(); err != nil {
		return err
	}
	q := db.New(e.pool)
	row, err := q.KeyDetail(e.ctx, db.KeyDetailParams{Scope: scope, Key: key})
	if errors.Is(err, pgx.ErrNoRows) {
		return errKeyNotFound{scope, key}
	}
	if err != nil {
		return err
	}
	if err := failable(row); err != nil {
		return err
	}
	if err := e.confirm(fmt.Sprintf("Fail key %s in scope %s (workflow %s at %s, %d attempts, created %s ago)? Every retry will get a stored 500.",
		safe(strconv.Quote(key)), safe(strconv.Quote(scope)), safe(row.Workflow), safe(row.RecoveryPoint), row.Attempts,
		human(row.ReadAt.Sub(row.CreatedAt)))); err != nil {
		return err
	}
	stored := "operator: " + reason
	done, err := q.FailKeyByOperator(e.ctx, db.FailKeyByOperatorParams{
		FailureReason: stored, ResponseStatus: failure.Status, ResponseHeaders: failure.Header,
		ResponseBody: failure.Body(failure.ReasonOperator, "it was stopped by an operator"),
		Scope:        scope, Key: key,
	})
	if errors.Is(err, pgx.ErrNoRows) {
		// Taken or finished since it was read: say which.
		now, err := q.KeyDetail(e.ctx, db.KeyDetailParams{Scope: scope, Key: key})
		if err != nil {
			return fmt.Errorf("the key changed meanwhile; nothing changed here: %w", err)
		}
		if err := failable(now); err != nil {
			return fmt.Errorf("the key changed meanwhile: %w", err)
		}
		return errors.New("the key changed meanwhile; nothing changed: run the command again")
	}
	if err != nil {
		return err
	}
	e.audit("keys fail", "key_id", done.ID, "scope", scope, "key", key, "workflow", row.Workflow,
		"recovery_point", row.RecoveryPoint, "attempts", row.Attempts, "failure_reason", stored)
	if e.json {
		return e.printJSON(map[string]any{"id": done.ID, "scope": scope, "key": key, "status": "failed",
			"failure_reason": stored, "failed_at": done.FinishedAt, "response_status": failure.Status})
	}
	fmt.Fprintf(e.stdout, "failed key %s in scope %s (id %d): retries now get %d application/problem+json\n",
		safe(strconv.Quote(key)), safe(strconv.Quote(scope)), done.ID, failure.Status)
	return nil
}

// failable says why keys fail cannot fail row, or nil.
func failable(row db.KeyDetailRow) error {
	switch {
	case row.Status != "running":
		return fmt.Errorf("key %q in scope %q is already %s; nothing changed", row.Key, row.Scope, row.Status)
	case row.LeaseLive:
		return fmt.Errorf("key %q in scope %q is held by a live attempt for %s more; nothing changed: try again once its lease ends",
			row.Key, row.Scope, ago(row.LeaseRemainingSeconds))
	}
	return nil
}
