package scenarios

import (
	"fmt"
	"io"
	"math"
	"strings"
	"time"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
)

// Table is one scenario's results.
type Table struct {
	Title      string
	Unit       string // throughput unit, e.g. "ops/s"
	LatencyCol string // what the latency columns measure
	RatioCol   string // what the ratio column divides by
	LimitCol   string // what the second ratio column divides by; "": no such column
	Rows       []Row
	Notes      []string
	Goals      []Goal
}

// Row is one subject at one concurrency.
type Row struct {
	System     string
	C          int
	Throughput float64
	P50, P99   time.Duration
	Ratio      float64       // NaN: not applicable
	Limit      float64       // the ratio to the hand-written limit; NaN: not applicable
	RoundTrips float64       // 0: not counted
	CPU        time.Duration // machine CPU per op; 0: not measured
	Errors     int
	Note       string
}

// Goal is a performance target and whether this run met it.
type Goal struct {
	Text string
	Met  bool
	Got  string
}

func rowFrom(system string, c int, r harness.Result, ratio float64) Row {
	return Row{
		System: system, C: c, Throughput: r.Throughput(),
		P50: r.Percentile(50), P99: r.Percentile(99),
		Ratio: ratio, Limit: math.NaN(), RoundTrips: r.RoundTrips, CPU: r.CPUPerOp, Errors: r.Errors,
	}
}

// add appends system's row at concurrency c, with its throughput as a
// ratio to the bare baseline's and to the hand-written limit's, and
// returns it.
func (t *Table) add(system string, c int, r harness.Result, bare, limit float64) Row {
	row := rowFrom(system, c, r, ratio(r.Throughput(), bare))
	row.Limit = ratio(r.Throughput(), limit)
	t.Rows = append(t.Rows, row)
	return row
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return math.NaN()
	}
	return a / b
}

// Markdown writes t as a Markdown section.
func (t *Table) Markdown(w io.Writer) {
	fmt.Fprintf(w, "### %s\n\n", t.Title)
	lat := t.LatencyCol
	if lat == "" {
		lat = "latency"
	}
	limitH, limitSep := "", ""
	if t.LimitCol != "" {
		limitH, limitSep = " "+t.LimitCol+" |", "--:|"
	}
	fmt.Fprintf(w, "| system | c | %s | %s p50 ms | %s p99 ms | %s |%s round trips/op | CPU ms/op | errors |\n", t.Unit, lat, lat, t.RatioCol, limitH)
	fmt.Fprintf(w, "|---|--:|--:|--:|--:|--:|%s--:|--:|--:|\n", limitSep)
	for _, r := range t.Rows {
		ratioS := "-"
		if !math.IsNaN(r.Ratio) {
			ratioS = fmt.Sprintf("%.2f", r.Ratio)
		}
		if t.LimitCol != "" {
			limitS := "-"
			if !math.IsNaN(r.Limit) {
				limitS = fmt.Sprintf("%.2f", r.Limit)
			}
			ratioS += " | " + limitS
		}
		rt := "-"
		if r.RoundTrips > 0 {
			rt = fmt.Sprintf("%.1f", r.RoundTrips)
		}
		sys := r.System
		if r.Note != "" {
			sys += " (" + r.Note + ")"
		}
		c := "-"
		if r.C > 0 {
			c = fmt.Sprint(r.C)
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %d |\n",
			sys, c, harness.FormatRate(r.Throughput), harness.FormatMs(r.P50), harness.FormatMs(r.P99), ratioS, rt, harness.FormatMs(r.CPU), r.Errors)
	}
	fmt.Fprintln(w)
	for _, g := range t.Goals {
		mark := "FAIL"
		if g.Met {
			mark = "PASS"
		}
		fmt.Fprintf(w, "- Goal: %s: **%s** (%s)\n", g.Text, mark, g.Got)
	}
	for _, n := range t.Notes {
		fmt.Fprintf(w, "- %s\n", n)
	}
	fmt.Fprintln(w)
}

// Summary lists every goal of every table, one line each.
func Summary(w io.Writer, tables []*Table) {
	fmt.Fprintln(w, "### Goals")
	fmt.Fprintln(w)
	for _, t := range tables {
		for _, g := range t.Goals {
			mark := "FAIL"
			if g.Met {
				mark = "PASS"
			}
			fmt.Fprintf(w, "- %s — %s: **%s** (%s)\n", strings.SplitN(t.Title, ".", 2)[0], g.Text, mark, g.Got)
		}
	}
	fmt.Fprintln(w)
}
