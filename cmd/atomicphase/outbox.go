package main

import (
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/monitor"
	"github.com/atomicphase/atomicphase/outbox"
)

var outboxStatus = &command{
	name:    "outbox status",
	args:    "[--stalled-after D]",
	summary: "pending and dead-lettered messages, per topic, and stalled keys",
	define: func(fs *flag.FlagSet) func(e *env, args []string) error {
		stalledAfter := fs.Duration("stalled-after", monitor.StalledAfterDefault, "count keys idle this long as stalled (the Resumer's ResumeDelay)")
		return func(e *env, args []string) error { return showOutboxStatus(e, args, *stalledAfter) }
	},
}

func showOutboxStatus(e *env, args []string, stalledAfter time.Duration) error {
	if len(args) != 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, args[0])
	}
	if stalledAfter < 0 {
		return fmt.Errorf("%w: --stalled-after must be positive", errUsage)
	}
	if err := e.connect(); err != nil {
		return err
	}
	s, err := monitor.Read(e.ctx, e.pool, &monitor.Config{StalledAfter: stalledAfter})
	if err != nil {
		return err
	}
	topics, err := db.New(e.pool).TopicBacklog(e.ctx)
	if err != nil {
		return err
	}
	if e.json {
		type topic struct {
			Topic                   string  `json:"topic"`
			Pending                 int64   `json:"pending"`
			OldestPendingAgeSeconds float64 `json:"oldest_pending_age_seconds"`
			Dead                    int64   `json:"dead"`
		}
		out := struct {
			ReadAt                  time.Time `json:"read_at"`
			Pending                 int64     `json:"pending"`
			OldestPendingAgeSeconds float64   `json:"oldest_pending_age_seconds"`
			Dead                    int64     `json:"dead"`
			KeysStalled             int64     `json:"keys_stalled"`
			KeysRunning             int64     `json:"keys_running"`
			KeysFailed              int64     `json:"keys_failed"`
			Topics                  []topic   `json:"topics"`
		}{s.At, s.OutboxPending, s.OldestPendingAge.Seconds(), s.OutboxDead, s.KeysStalled, s.KeysRunning, s.KeysFailed, []topic{}}
		for _, t := range topics {
			out.Topics = append(out.Topics, topic{t.Topic, t.Pending, t.OldestPendingAgeSeconds, t.Dead})
		}
		return e.printJSON(out)
	}
	w := e.stdout
	fmt.Fprintf(w, "pending       %d", s.OutboxPending)
	if s.OutboxPending > 0 {
		fmt.Fprintf(w, ", the oldest staged %s ago", human(s.OldestPendingAge))
	}
	fmt.Fprintf(w, "\ndead letters  %d\n", s.OutboxDead)
	fmt.Fprintf(w, "stalled keys  %d (running, lease free or expired, idle over %v)\n", s.KeysStalled, stalledAfter)
	fmt.Fprintf(w, "running keys  %d\nfailed keys   %d\n", s.KeysRunning, s.KeysFailed)
	if len(topics) > 0 {
		fmt.Fprintln(w)
		t := e.table("TOPIC", "PENDING", "OLDEST", "DEAD")
		for _, r := range topics {
			oldest := ""
			if r.Pending > 0 {
				oldest = ago(r.OldestPendingAgeSeconds)
			}
			t.row(r.Topic, strconv.FormatInt(r.Pending, 10), oldest, strconv.FormatInt(r.Dead, 10))
		}
		t.flush()
	}
	return nil
}

var outboxDead = &command{
	name:    "outbox dead",
	args:    "[--topic T] [--limit N]",
	summary: "the newest dead letters, with their last errors",
	define: func(fs *flag.FlagSet) func(e *env, args []string) error {
		topic := fs.String("topic", "", "only this topic's")
		limit := fs.Int("limit", 50, "list at most this many, newest first (at most 1000)")
		return func(e *env, args []string) error { return listDead(e, args, *topic, *limit) }
	},
}

func listDead(e *env, args []string, topic string, limit int) error {
	if len(args) != 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, args[0])
	}
	if limit < 1 || limit > 1000 {
		return fmt.Errorf("%w: --limit must be from 1 to 1000", errUsage)
	}
	if err := e.connect(); err != nil {
		return err
	}
	q := db.New(e.pool)
	rows, err := q.RecentDeadLetters(e.ctx, db.RecentDeadLettersParams{Topic: topic, MaxRows: int32(limit)})
	if err != nil {
		return err
	}
	total, err := q.CountDeadLetters(e.ctx, topic)
	if err != nil {
		return err
	}
	if e.json {
		type dead struct {
			RowID       int64      `json:"row_id"`
			MessageID   string     `json:"message_id"`
			Topic       string     `json:"topic"`
			OrderingKey string     `json:"ordering_key,omitempty"`
			Attempts    int32      `json:"attempts"`
			LastError   string     `json:"last_error"`
			CreatedAt   time.Time  `json:"created_at"`
			DeadAt      *time.Time `json:"dead_at"`
		}
		out := []dead{}
		for _, r := range rows {
			d := dead{RowID: r.ID, Topic: r.Topic, OrderingKey: r.OrderingKey, Attempts: r.Attempts,
				LastError: r.LastError, CreatedAt: r.CreatedAt, DeadAt: r.DeadAt}
			if r.MessageID.Valid {
				d.MessageID = r.MessageID.UUID.String()
			}
			out = append(out, d)
		}
		return e.printJSON(out)
	}
	of := ""
	if topic != "" {
		of = " of topic " + safe(strconv.Quote(topic))
	}
	if len(rows) == 0 {
		fmt.Fprintf(e.stdout, "no dead letters%s\n", of)
		return nil
	}
	t := e.table("ROW", "MESSAGE ID", "TOPIC", "ORDERING KEY", "ATTEMPTS", "DEAD FOR", "LAST ERROR")
	for _, r := range rows {
		id := ""
		if r.MessageID.Valid {
			id = r.MessageID.UUID.String()
		}
		t.row(strconv.FormatInt(r.ID, 10), id, r.Topic, r.OrderingKey, strconv.Itoa(int(r.Attempts)),
			ago(r.DeadSecondsAgo), clip(100, r.LastError))
	}
	t.flush()
	fmt.Fprintf(e.stdout, "\n%s%s", count(total, "dead letter", "dead letters"), of)
	if int64(len(rows)) < total {
		fmt.Fprintf(e.stdout, " (the newest %d; --limit for more)", len(rows))
	}
	fmt.Fprintln(e.stdout, "; redrive with: atomicphase outbox redrive ROW...")
	return nil
}

var outboxRedrive = &command{
	name:    "outbox redrive",
	args:    "ID... | --all [--topic T]",
	summary: "dead letters back to pending, attempts reset (IDs: row ids or message ids)",
	writes:  true,
	define: func(fs *flag.FlagSet) func(e *env, args []string) error {
		all := fs.Bool("all", false, "every dead letter (of --topic, when given)")
		topic := fs.String("topic", "", "with --all: only this topic's")
		return func(e *env, args []string) error { return redrive(e, args, *all, *topic) }
	},
}

func redrive(e *env, args []string, all bool, topic string) error {
	var sel outbox.RedriveSelection
	switch {
	case all && len(args) > 0:
		return fmt.Errorf("%w: give ids or --all, not both", errUsage)
	case !all && len(args) == 0:
		return fmt.Errorf("%w: give the ids of the messages to redrive, or --all", errUsage)
	case !all && topic != "":
		return fmt.Errorf("%w: --topic goes with --all", errUsage)
	case len(args) > outbox.MaxRedriveIDs:
		return fmt.Errorf("%w: at most %d ids at once", errUsage, outbox.MaxRedriveIDs)
	}
	for _, a := range args {
		if n, err := strconv.ParseInt(a, 10, 64); err == nil && n > 0 {
			sel.RowIDs = append(sel.RowIDs, n)
		} else if id, err := uuid.Parse(a); err == nil && len(a) == 36 {
			sel.IDs = append(sel.IDs, id)
		} else {
			return fmt.Errorf("%w: malformed id %s: give a row id (a positive integer) or a message id (a UUID)",
				errUsage, safe(strconv.Quote(a)))
		}
	}
	sel.All, sel.Topic = all, topic
	if err := e.connect(); err != nil {
		return err
	}

	var question string
	if all {
		n, err := db.New(e.pool).CountDeadLetters(e.ctx, topic)
		if err != nil {
			return err
		}
		if n == 0 {
			if e.json {
				return e.printJSON([]any{})
			}
			fmt.Fprintln(e.stdout, "no dead letters to redrive")
			return nil
		}
		question = "Redrive the only dead letter"
		if n > 1 {
			question = fmt.Sprintf("Redrive all %d dead letters", n)
		}
		if topic != "" {
			question += " of topic " + safe(strconv.Quote(topic))
		}
	} else {
		question = fmt.Sprintf("Redrive %s (%s)", count(int64(len(args)), "dead letter", "dead letters"), safe(clip(200, strings.Join(args, ", "))))
	}
	if err := e.confirm(question + " to pending, attempts reset to 0?"); err != nil {
		return err
	}
	done, err := outbox.Redrive(e.ctx, e.pool, sel)
	if len(done) > 0 {
		rows := make([]int64, len(done))
		var ordered int
		for i, d := range done {
			rows[i] = d.RowID
			if d.OrderingKey != "" {
				ordered++
			}
		}
		e.audit("outbox redrive", "count", len(done), "all", all, "topic", topic, "row_ids", rows,
			"messages", auditMessages(done))
		if err == nil && !e.json {
			printRedriven(e, done, ordered)
		}
	}
	if errors.Is(err, outbox.ErrNotDeadLettered) {
		return errors.New(strings.TrimPrefix(err.Error(), "outbox: "))
	}
	if err != nil {
		return err
	}
	if e.json {
		return e.printJSON(redrivenJSON(done))
	}
	return nil
}

type redrivenView struct {
	RowID            int64     `json:"row_id"`
	MessageID        string    `json:"message_id"`
	Topic            string    `json:"topic"`
	OrderingKey      string    `json:"ordering_key,omitempty"`
	PreviousAttempts int       `json:"previous_attempts"`
	DeadAt           time.Time `json:"dead_at"`
	LastError        string    `json:"last_error"`
}

func redrivenJSON(done []outbox.Redriven) []redrivenView {
	out := make([]redrivenView, 0, len(done))
	for _, d := range done {
		out = append(out, redrivenView{d.RowID, d.ID.String(), d.Topic, d.OrderingKey, d.Attempts, d.DeadAt, d.LastError})
	}
	return out
}

// auditMessages is what the audit line records of each message: enough to
// tell what it was before (its error is cut at 200 characters).
func auditMessages(done []outbox.Redriven) []redrivenView {
	out := redrivenJSON(done)
	for i := range out {
		out[i].LastError = clip(200, out[i].LastError)
	}
	return out
}

func printRedriven(e *env, done []outbox.Redriven, ordered int) {
	t := e.table("ROW", "MESSAGE ID", "TOPIC", "WAS DEAD FOR", "ATTEMPTS BEFORE", "LAST ERROR")
	for _, d := range done {
		t.row(strconv.FormatInt(d.RowID, 10), d.ID.String(), d.Topic, human(time.Since(d.DeadAt)),
			strconv.Itoa(d.Attempts), clip(80, d.LastError))
	}
	t.flush()
	fmt.Fprintf(e.stdout, "\nredrove %s: pending again, attempts from 0, due now\n", count(int64(len(done)), "message", "messages"))
	if ordered > 0 {
		fmt.Fprintf(e.stdout, "note: %d of them have an ordering key: each goes out before its key's pending messages, "+
			"and after those published while it was dead\n", ordered)
	}
}
