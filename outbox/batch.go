package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/telemetry"
)

// outcome is what happened to one claimed message.
type outcome struct {
	attempted bool  // the publisher was asked to publish it
	err       error // nil: published
}

// batch is what runBatch did.
type batch struct {
	published int
	claimed   int
	// nextDue, after a batch that claimed nothing, is when (from the start
	// of the batch) the earliest message that was not due yet falls due;
	// -1 when there is none or it is unknown.
	nextDue time.Duration
}

// failure is a failed publish as record writes it and report logs it.
type failure struct {
	env   *Envelope
	err   error
	delay time.Duration
	dead  bool
	down  bool // the destination was unavailable: no attempt counted
}

// runBatch claims, publishes and records one batch in one transaction.
func (r *Relay) runBatch(ctx context.Context) (b batch, err error) {
	b.nextDue = -1
	if err := ctx.Err(); err != nil {
		return b, err
	}
	start := time.Now()
	// The database work is not cut short by ctx (a cancelled relay still
	// records what it published), only by PublishTimeout.
	txCtx, cancel := context.WithDeadline(context.WithoutCancel(ctx), start.Add(r.cfg.PublishTimeout))
	defer cancel()
	tx, err := r.pool.Begin(txCtx)
	if err != nil {
		return b, fmt.Errorf("outbox: relay: begin: %w", err)
	}
	defer func() {
		rctx, rcancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer rcancel()
		_ = tx.Rollback(rctx) // no-op after Commit
	}()
	q := db.New(tx)

	envs, outcomes, nextDue, err := r.claim(txCtx, q)
	if err != nil || len(envs) == 0 {
		b.nextDue = nextDue
		return b, err
	}
	b.claimed = len(envs)
	ctx, span := r.tracer.Start(ctx, telemetry.SpanRelayBatch, trace.SpanKindInternal)
	defer span.End()
	if span.IsRecording() {
		span.SetAttributes(attribute.Int("messaging.batch.message_count", len(envs)))
	}
	pubStart := time.Now()

	// Stopping the relay (ctx) stops the batch from sending further
	// messages; those in flight keep until the publish deadline to be
	// acknowledged, so that a graceful stop publishes nothing twice.
	pubCtx, pubCancel := context.WithDeadline(context.WithoutCancel(ctx), start.Add(r.publishDeadline()))
	r.publish(pubCtx, ctx.Done(), envs, outcomes)
	pubCancel()

	published, failures, err := r.record(txCtx, q, envs, outcomes)
	if err != nil {
		return b, err
	}
	if err := tx.Commit(txCtx); err != nil {
		return b, fmt.Errorf("outbox: relay: commit: %w", err)
	}
	r.report(published, failures)
	r.observe(ctx, envs, outcomes, failures, pubStart)
	b.published = published
	return b, nil
}

// observe records a committed batch's metrics and, on a recording trace, a
// producer span per attempted message from the publish's start to now,
// linked to the trace that staged it (its traceparent header).
func (r *Relay) observe(ctx context.Context, envs []Envelope, outcomes []outcome, failures []failure, pubStart time.Time) {
	now := time.Now()
	for i := range envs {
		if outcomes[i].attempted && outcomes[i].err == nil {
			r.tel.Published(ctx, envs[i].Topic, now.Sub(envs[i].CreatedAt))
		}
	}
	for _, f := range failures {
		if f.dead {
			r.tel.DeadLettered(ctx, f.env.Topic)
		} else {
			r.tel.PublishFailed(ctx, f.env.Topic)
		}
	}
	if !r.tracer.Enabled() || !trace.SpanFromContext(ctx).IsRecording() {
		return
	}
	prop := otel.GetTextMapPropagator()
	for i := range envs {
		e, o := &envs[i], outcomes[i]
		if !o.attempted {
			continue
		}
		opts := []trace.SpanStartOption{
			trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(pubStart),
			trace.WithAttributes(attribute.String(telemetry.AttrTopic, e.Topic),
				attribute.String("messaging.message.id", e.ID.String()), attribute.Int(telemetry.AttrAttempt, e.Attempt)),
		}
		if sc := trace.SpanContextFromContext(prop.Extract(context.Background(), propagation.MapCarrier(e.Headers))); sc.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: sc}))
		}
		_, span := r.tracer.StartWith(ctx, telemetry.SpanPublishPrefix+e.Topic, opts...)
		if o.err != nil {
			span.RecordError(o.err)
			span.SetStatus(codes.Error, o.err.Error())
		}
		span.End(trace.WithTimestamp(now))
	}
}

// claim claims the next publishable messages in q's transaction and returns
// them as envelopes, with an outcome slot for each (a message that can never
// be published is failed here already). When nothing is due, it returns no
// envelopes and how long until the earliest message falls due (-1: none).
func (r *Relay) claim(ctx context.Context, q *db.Queries) ([]Envelope, []outcome, time.Duration, error) {
	rows, err := q.ClaimMessages(ctx, int32(r.cfg.BatchSize))
	if err != nil {
		return nil, nil, -1, fmt.Errorf("outbox: relay: claim: %w", err)
	}
	if len(rows) == 0 {
		// In the claim's transaction, now() is the time the claim judged
		// due messages by: every message that falls due after it counts,
		// including one that falls due while this runs.
		due, err := q.NextDueIn(ctx)
		if err == nil && due >= 0 {
			return nil, nil, seconds(due), nil
		}
		return nil, nil, -1, nil
	}
	envs := make([]Envelope, len(rows))
	outcomes := make([]outcome, len(rows))
	for i, row := range rows {
		envs[i] = Envelope{
			ID:          row.MessageID.UUID,
			RowID:       row.ID,
			Topic:       row.Topic,
			OrderingKey: row.OrderingKey.String,
			Payload:     row.Payload,
			Attempt:     int(row.Attempts) + 1,
			CreatedAt:   row.CreatedAt,
		}
		if !row.MessageID.Valid {
			// The schema's check constraint rules this out. A row written
			// around it fails, and is retried, rather than be sent without
			// the id that makes its republishes recognizable.
			outcomes[i] = outcome{attempted: true, err: errors.New("outbox: message has no message_id")}
			continue
		}
		if string(row.Headers) != "{}" {
			if err := json.Unmarshal(row.Headers, &envs[i].Headers); err != nil {
				// Only a row written around Enqueue can get here; it can
				// never be published.
				outcomes[i] = outcome{attempted: true, err: Permanent(fmt.Errorf("headers are not an object of strings: %w", err))}
			}
		}
	}
	return envs, outcomes, -1, nil
}

// record writes the outcomes in q's transaction: acknowledged messages are
// marked published, failed ones scheduled for a retry or dead-lettered.
// Messages never attempted are left as they were. It returns how many were
// published and the failures.
func (r *Relay) record(ctx context.Context, q *db.Queries, envs []Envelope, outcomes []outcome) (int, []failure, error) {
	var ok []int64
	var fail db.RecordFailuresParams
	var failures []failure
	for i := range envs {
		o := outcomes[i]
		switch {
		case !o.attempted:
		case o.err == nil:
			ok = append(ok, envs[i].RowID)
		default:
			// An unavailable destination says nothing about the message: no
			// attempt is counted, so an outage never dead-letters.
			down := errors.Is(o.err, ErrUnavailable) && !errors.Is(o.err, ErrPermanent)
			dead := !down && (errors.Is(o.err, ErrPermanent) || envs[i].Attempt >= r.cfg.MaxAttempts)
			var delay time.Duration
			if !dead {
				delay = r.retry.Delay(envs[i].Attempt - 1)
				if asked, ok := retryDelay(o.err); ok {
					delay = min(max(delay, asked), r.cfg.RetryMaxDelay)
				}
			}
			fail.Ids = append(fail.Ids, envs[i].RowID)
			fail.Errors = append(fail.Errors, errorText(o.err))
			fail.DelaysUs = append(fail.DelaysUs, delay.Microseconds())
			fail.Dead = append(fail.Dead, dead)
			fail.Counted = append(fail.Counted, !down)
			failures = append(failures, failure{&envs[i], o.err, delay, dead, down})
		}
	}
	if len(ok) > 0 {
		if err := q.MarkPublished(ctx, ok); err != nil {
			return 0, nil, fmt.Errorf("outbox: relay: mark published: %w", err)
		}
	}
	if len(fail.Ids) > 0 {
		if err := q.RecordFailures(ctx, fail); err != nil {
			return 0, nil, fmt.Errorf("outbox: relay: record failures: %w", err)
		}
	}
	return len(ok), failures, nil
}

// report counts and logs a committed batch's results.
func (r *Relay) report(published int, failures []failure) {
	r.published.Add(uint64(published))
	for _, f := range failures {
		attrs := []any{
			"message_id", f.env.ID, "row_id", f.env.RowID, "topic", f.env.Topic,
			"attempt", f.env.Attempt, "error", f.err,
		}
		if f.env.OrderingKey != "" {
			attrs = append(attrs, "ordering_key", f.env.OrderingKey)
		}
		if f.dead {
			r.dead.Add(1)
			r.log.Error("outbox: message dead-lettered", attrs...)
		} else if f.down {
			r.down.Add(1)
			r.log.Warn("outbox: destination unavailable; will retry without counting an attempt",
				append(attrs, "retry_in", f.delay)...)
		} else {
			r.retried.Add(1)
			r.log.Warn("outbox: publish failed; will retry", append(attrs, "retry_in", f.delay)...)
		}
	}
}

// publish publishes envs in waves: wave n holds the n-th claimed message of
// every ordering key (unordered messages all go in the first wave), so no
// two messages of one call share a key, and a key's message is published
// only after its predecessor was acknowledged. A key whose message fails, or
// is not sent, is left out of the later waves: its remaining messages stay
// pending, held back behind it. Messages already failed (outcomes set) are
// treated the same way.
//
// ctx carries the publish deadline; stopping is closed when the relay
// stops, after which no further wave starts and the publisher sends no
// further message, while the messages in flight finish.
func (r *Relay) publish(ctx context.Context, stopping <-chan struct{}, envs []Envelope, outcomes []outcome) {
	var waves [][]int
	next := make(map[string]int)
	for i := range envs {
		w := 0
		if k := envs[i].OrderingKey; k != "" {
			w = next[k]
			next[k] = w + 1
		}
		if w == len(waves) {
			waves = append(waves, nil)
		}
		waves[w] = append(waves[w], i)
	}
	stopped := make(map[string]bool)
	for _, wave := range waves {
		if ctx.Err() != nil || isClosed(stopping) {
			return
		}
		var idx []int
		var batch []Envelope
		for _, i := range wave {
			k := envs[i].OrderingKey
			if k != "" && stopped[k] {
				continue
			}
			if outcomes[i].attempted { // failed before publishing
				if k != "" {
					stopped[k] = true
				}
				continue
			}
			idx = append(idx, i)
			batch = append(batch, envs[i])
		}
		if len(batch) == 0 {
			continue
		}
		returned := r.publishWave(ctx, stopping, batch, idx, outcomes)
		for _, i := range idx {
			if o := outcomes[i]; (!o.attempted || o.err != nil) && envs[i].OrderingKey != "" {
				stopped[envs[i].OrderingKey] = true
			}
		}
		if !returned {
			return // the publisher is stuck past the deadline
		}
	}
}

// publishWave hands one wave to the publisher and sets the outcomes of its
// messages (batch[j] is envs[idx[j]]). It runs the publisher on its own
// goroutine and waits until Publish returns, or until publishGrace after
// ctx's deadline, so that a publisher that ignores ctx cannot hold the claim
// transaction open past its bound; it reports whether Publish returned.
//
// Every outcome set before the relay stopped waiting counts, whatever
// happens to the other messages. A message the publisher reported as
// ErrNotSent because ctx ended or the relay is stopping stays unattempted.
// A message without an outcome counts as a failed attempt: the publisher
// may have sent it.
func (r *Relay) publishWave(ctx context.Context, stopping <-chan struct{}, batch []Envelope, idx []int, outcomes []outcome) (returned bool) {
	res := newResults(len(batch), stopping)
	done := make(chan any, 1)
	go func() {
		defer func() { done <- recover() }()
		r.pub.Publish(ctx, batch, res)
	}()
	var panicked any
	select {
	case panicked = <-done:
		returned = true
	case <-ctx.Done():
		grace := time.NewTimer(r.publishGrace())
		select {
		case panicked = <-done:
			returned = true
		case <-grace.C:
		}
		grace.Stop()
	}
	errs, reported := res.seal()
	halted := ctx.Err() != nil || isClosed(stopping)
	for j, i := range idx {
		var err error
		switch {
		case reported[j] && errors.Is(errs[j], ErrNotSent) && halted:
			continue // never sent: left as it was
		case reported[j]:
			err = errs[j]
		case panicked != nil:
			err = fmt.Errorf("outbox: publisher panicked: %v", panicked)
		case !returned:
			err = fmt.Errorf("outbox: publish: no acknowledgement before the publish deadline: %w", context.DeadlineExceeded)
		default:
			err = errors.New("outbox: publisher returned without an outcome for the message")
		}
		outcomes[i] = outcome{attempted: true, err: err}
	}
	return returned
}

// publishDeadline is how long after its start a batch may publish: three
// quarters of PublishTimeout, the rest kept for recording and committing.
func (r *Relay) publishDeadline() time.Duration {
	return r.cfg.PublishTimeout - r.cfg.PublishTimeout/4
}

// publishGrace is how long the relay waits, after the publish deadline, for
// the publisher to return with its last outcomes (a publisher that honours
// ctx returns at once). It leaves at least an eighth of PublishTimeout to
// record and commit.
func (r *Relay) publishGrace() time.Duration {
	return min(r.cfg.PublishTimeout/8, time.Second)
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// errorText makes err storable as last_error: valid UTF-8, no NUL, bounded.
func errorText(err error) string {
	s := strings.ReplaceAll(strings.ToValidUTF8(err.Error(), "\uFFFD"), "\x00", "")
	if len(s) > maxErrorBytes {
		cut := maxErrorBytes
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut]
	}
	return s
}

func seconds(s float64) time.Duration {
	return time.Duration(s * float64(time.Second))
}
