package scenarios

import (
	"fmt"
	"image/color"
	"io"
	"math"
	"strconv"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/atomicphase/atomicphase/bench/internal/harness"
)

// ScaleGoal is the most a latency may grow from the smallest table to the
// largest.
const ScaleGoal = 1.3

// GoalC is the concurrency the goal and the chart are judged at (the
// largest measured if absent).
const GoalC = 8

// Count formats a count the way the report's headings do: 100k, 1M, 10M.
func Count(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return fmt.Sprintf("%dM", n/1_000_000)
	case n >= 1_000 && n%1_000 == 0:
		return fmt.Sprintf("%dk", n/1_000)
	default:
		return fmt.Sprint(n)
	}
}

func (r *ScaleReport) goalC() int {
	c := 0
	for _, x := range r.Concurrency {
		if x == GoalC {
			return x
		}
		c = max(c, x)
	}
	return c
}

func (r *ScaleReport) latencyRatio(op string, c int, p float64, i int) float64 {
	if len(r.Points) == 0 {
		return math.NaN()
	}
	base := r.Points[0].Results[ScaleCell{op, c}]
	res := r.Points[i].Results[ScaleCell{op, c}]
	return ratio(float64(res.Percentile(p)), float64(base.Percentile(p)))
}

// Goal judges the latency goal: the median latency of Run and of the replay
// at c=8 on the largest table within ScaleGoal of the smallest's. The p99
// ratios are reported beside it.
func (r *ScaleReport) Goal() Goal {
	if len(r.Points) < 2 {
		return Goal{Text: "needs two sizes", Got: "-"}
	}
	c, last := r.goalC(), len(r.Points)-1
	first, lastN := Count(r.Points[0].Keys), Count(r.Points[last].Keys)
	met := true
	var got []string
	for _, op := range []string{ScaleRun, ScaleReplay} {
		p50, p99 := r.latencyRatio(op, c, 50, last), r.latencyRatio(op, c, 99, last)
		met = met && p50 <= ScaleGoal
		got = append(got, fmt.Sprintf("%s p50 %.2f×, p99 %.2f×", shortOp(op), p50, p99))
	}
	return Goal{
		Text: fmt.Sprintf("replay and Run latency (p50, c=%d) at %s keys within %.1f× of %s", c, lastN, ScaleGoal, first),
		Met:  met, Got: strings.Join(got, "; "),
	}
}

func shortOp(op string) string {
	switch op {
	case ScaleRun:
		return "Run"
	case ScaleReplay:
		return "replay"
	default:
		return "Resume"
	}
}

// Markdown writes the report's tables, goal and notes.
func (r *ScaleReport) Markdown(w io.Writer) {
	if len(r.Points) > 0 {
		base := Count(r.Points[0].Keys)
		for _, c := range r.Concurrency {
			fmt.Fprintf(w, "### Latency and throughput beside N finished keys, c=%d\n\n", c)
			fmt.Fprint(w, "| keys |")
			for _, op := range ScaleOps {
				s := shortOp(op)
				fmt.Fprintf(w, " %s ops/s | %s p50 ms | %s p99 ms | %s p50, p99 vs %s |", s, s, s, s, base)
			}
			fmt.Fprintln(w)
			fmt.Fprint(w, "|--:|")
			fmt.Fprint(w, strings.Repeat("--:|--:|--:|--:|", len(ScaleOps)))
			fmt.Fprintln(w)
			for i, p := range r.Points {
				fmt.Fprintf(w, "| %s |", Count(p.Keys))
				for _, op := range ScaleOps {
					res := p.Results[ScaleCell{op, c}]
					fmt.Fprintf(w, " %s | %s | %s | %.2f, %.2f |", harness.FormatRate(res.Throughput()),
						harness.FormatMs(res.Percentile(50)), harness.FormatMs(res.Percentile(99)),
						r.latencyRatio(op, c, 50, i), r.latencyRatio(op, c, 99, i))
				}
				fmt.Fprintln(w)
			}
			fmt.Fprintln(w)
		}
		fmt.Fprint(w, "### Filling the key table\n\n")
		fmt.Fprintln(w, "| keys | INSERT s | VACUUM ANALYZE + CHECKPOINT s | table MiB | (scope, key) index MiB | all indexes MiB | errors in the cells |")
		fmt.Fprintln(w, "|--:|--:|--:|--:|--:|--:|--:|")
		for _, p := range r.Points {
			errs := 0
			for _, res := range p.Results {
				errs += res.Errors
			}
			fmt.Fprintf(w, "| %s | %.1f | %.1f | %.0f | %.0f | %.0f | %d |\n", Count(p.Keys), p.Insert.Seconds(), p.Maintain.Seconds(),
				float64(p.HeapBytes)/(1<<20), float64(p.KeyIndexBytes)/(1<<20), float64(p.IndexBytes)/(1<<20), errs)
		}
		fmt.Fprintln(w)
		g := r.Goal()
		mark := "FAIL"
		if g.Met {
			mark = "PASS"
		}
		fmt.Fprintf(w, "- Goal: %s: **%s** (%s)\n", g.Text, mark, g.Got)
		fmt.Fprintf(w, "- Each size: the key table emptied, then N finished keys in one scope inserted by one generate_series INSERT (every column as a single-phase Run writes it; keys are UUIDs spread over the whole index, finished one millisecond apart up to now), VACUUM ANALYZE, CHECKPOINT. Then, on one pool of c+10 connections, each cell: %v warm-up, %v measured, closed loop.\n", r.Timing.Warmup, r.Timing.Duration)
		fmt.Fprintln(w, "- Run: a first attempt on a new random UUID key (one business row, as in table 1). replay: Run on one of the N finished keys chosen at random; it returns the stored response. Resume: Runner.Resume(scope, key) on one of the N finished keys chosen at random, the library's read of a key by scope and value (txn has no separate Get); on a finished key it returns the stored response.")
		fmt.Fprintln(w, "- Ratios divide each latency by the same operation's at the smallest size, measured in the same run.")
		fmt.Fprintln(w)
	}
	if len(r.Drains) > 0 {
		fmt.Fprint(w, "### Relay: draining a pending backlog to JetStream\n\n")
		fmt.Fprintf(w, "| pending messages | INSERT + VACUUM ANALYZE + CHECKPOINT s | drain s | msg/s | ratio vs %s |\n", Count(r.Drains[0].Messages))
		fmt.Fprintln(w, "|--:|--:|--:|--:|--:|")
		for _, d := range r.Drains {
			fmt.Fprintf(w, "| %s | %.1f | %.1f | %.0f | %.2f |\n", Count(d.Messages), d.Insert.Seconds(), d.Took.Seconds(), d.Rate(), ratio(d.Rate(), r.Drains[0].Rate()))
		}
		fmt.Fprintln(w)
		fmt.Fprintln(w, "- The pending rows are inserted by one generate_series INSERT in the form outbox.Enqueue writes them (8-byte payload, no headers, no ordering key; message id from the column default), then VACUUM ANALYZE and CHECKPOINT; a relay with the default configuration is started and timed until JetStream has acknowledged every message.")
		fmt.Fprintln(w)
	}
}

// Chart draws the latency against the table size (log x axis) at c=8 (or
// the largest concurrency measured): the median of each operation as a
// solid line, its 99th percentile as a dashed line of the same colour, and
// writes it as a PNG image.
func (r *ScaleReport) Chart(file string) error {
	c := r.goalC()
	p := plot.New()
	p.Title.Text = fmt.Sprintf("atomicphase: latency beside N finished keys (c=%d)", c)
	p.X.Label.Text = "finished keys in the table"
	p.Y.Label.Text = "latency, ms (log scale)"
	p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
	p.X.Tick.Marker = logTicks{label: func(v float64) string { return Count(int(v)) }}
	p.Y.Tick.Marker = logTicks{label: func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }}
	if len(r.Points) > 0 {
		p.X.Min, p.X.Max = float64(r.Points[0].Keys)/1.5, float64(r.Points[len(r.Points)-1].Keys)*1.5
	}
	p.Legend.Top = true
	p.Legend.Left = true
	p.Add(plotter.NewGrid())
	colors := []color.Color{
		color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
		color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
		color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	}
	// The y range: from half the lowest latency to eight times the highest,
	// which leaves the top of the chart to the legend.
	lo, hi := math.Inf(1), 0.0
	for _, pt := range r.Points {
		for _, op := range ScaleOps {
			res := pt.Results[ScaleCell{op, c}]
			for _, pct := range []float64{50, 99} {
				if v := float64(res.Percentile(pct)) / float64(time.Millisecond); v > 0 {
					lo, hi = min(lo, v), max(hi, v)
				}
			}
		}
	}
	if hi > 0 {
		p.Y.Min, p.Y.Max = lo/2, hi*8
	}
	for i, op := range ScaleOps {
		for _, pct := range []float64{50, 99} {
			xy := make(plotter.XYs, 0, len(r.Points))
			for _, pt := range r.Points {
				res := pt.Results[ScaleCell{op, c}]
				xy = append(xy, plotter.XY{X: float64(pt.Keys), Y: float64(res.Percentile(pct)) / float64(time.Millisecond)})
			}
			l, pts, err := plotter.NewLinePoints(xy)
			if err != nil {
				return err
			}
			l.Color, pts.Color = colors[i%len(colors)], colors[i%len(colors)]
			l.Width = vg.Points(1.5)
			pts.Shape = draw.CircleGlyph{}
			if pct == 99 {
				l.Dashes = []vg.Length{vg.Points(5), vg.Points(3)}
				pts.Shape = draw.TriangleGlyph{}
			}
			p.Add(l, pts)
			p.Legend.Add(fmt.Sprintf("%s p%.0f", shortOp(op), pct), l, pts)
		}
	}
	return p.Save(7*vg.Inch, 4.5*vg.Inch, file)
}

// logTicks marks a log axis: a labelled tick at each power of ten, and
// unlabelled ones at its multiples between.
type logTicks struct{ label func(float64) string }

func (t logTicks) Ticks(lo, hi float64) []plot.Tick {
	var ts []plot.Tick
	for e := math.Floor(math.Log10(lo)); e <= math.Ceil(math.Log10(hi)); e++ {
		v := math.Pow(10, e)
		if v >= lo*0.999 && v <= hi*1.001 {
			ts = append(ts, plot.Tick{Value: v, Label: t.label(v)})
		}
		for m := 2.0; m < 10; m++ {
			if mv := m * v; mv >= lo && mv <= hi {
				ts = append(ts, plot.Tick{Value: mv})
			}
		}
	}
	return ts
}
