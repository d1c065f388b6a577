package main

import (
	"bytes"
	"context"
	_ "embed"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/db"
)

// statusRows is how many failed keys and dead letters the page lists.
const statusRows = 20

//go:embed status.html
var statusHTML string

// statusTemplate renders the page. html/template escapes every value by
// its context (text, attribute): stored text (keys, scopes, errors) can
// never become markup.
var statusTemplate = template.Must(template.New("status").Funcs(template.FuncMap{
	"age":      age,
	"clip":     clip,
	"nonzero":  func(n int64) bool { return n != 0 },
	"datetime": func(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05Z") },
}).Parse(statusHTML))

// statusPage serves the read-only status page.
type statusPage struct {
	pool   *pgxpool.Pool
	reaper *reaper
	log    *slog.Logger
}

// statusData is what the template shows.
type statusData struct {
	Database, Schema string
	ReadAt           time.Time
	Snapshot         db.SnapshotRow
	StalledAfter     time.Duration
	Topics           []db.TopicBacklogRow
	FailedKeys       []db.RecentFailedKeysRow
	DeadLetters      []db.RecentDeadLettersRow
	Round            *roundResult
	Interval         time.Duration
}

func (p *statusPage) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	ctx, cancel := context.WithTimeout(req.Context(), requestTimeout)
	defer cancel()
	data, err := p.read(ctx)
	if err != nil {
		p.log.Warn("reaper: status page: cannot read the database", "error", err.Error())
		http.Error(w, "cannot read the database: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	var buf bytes.Buffer
	if err := statusTemplate.Execute(&buf, data); err != nil {
		p.log.Error("reaper: status page: render", "error", err.Error())
		http.Error(w, "cannot render the status page", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_, _ = buf.WriteTo(w)
}

// read takes every figure from one snapshot of the database (a read-only
// REPEATABLE READ transaction), so the sections agree with each other.
func (p *statusPage) read(ctx context.Context) (statusData, error) {
	d := statusData{StalledAfter: p.reaper.stalledAfter, Round: p.reaper.lastRound(), Interval: p.reaper.interval}
	err := pgx.BeginTxFunc(ctx, p.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		q := db.New(tx)
		id, err := q.DatabaseIdentity(ctx)
		if err != nil {
			return err
		}
		d.Database, d.Schema, d.ReadAt = id.Database, id.Schema, id.Now
		if d.Snapshot, err = q.Snapshot(ctx, p.reaper.stalledAfter.Seconds()); err != nil {
			return err
		}
		if d.Topics, err = q.TopicBacklog(ctx); err != nil {
			return err
		}
		if d.FailedKeys, err = q.RecentFailedKeys(ctx, statusRows); err != nil {
			return err
		}
		d.DeadLetters, err = q.RecentDeadLetters(ctx, db.RecentDeadLettersParams{MaxRows: statusRows})
		return err
	})
	return d, err
}

// age renders a number of seconds, or a duration, for people: 42s, 4m2s,
// 3h12m, 2d4h.
func age(v any) string {
	var d time.Duration
	switch x := v.(type) {
	case float64:
		d = time.Duration(x * float64(time.Second))
	case time.Duration:
		d = x
	default:
		return fmt.Sprint(v)
	}
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

// clip shortens s to n runes, marking the cut.
func clip(n int, s string) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n]) + "…"
}
