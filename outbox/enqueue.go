package outbox

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	oteltrace "go.opentelemetry.io/otel/trace"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/phasectx"
	"github.com/atomicphase/atomicphase/internal/telemetry"
)

// NotifyChannel is the PostgreSQL notification channel Enqueue notifies and
// relays listen on. The payload is the enqueuing session's current schema; a
// relay wakes only for its own current schema (or an empty payload), so that
// outboxes in several schemas of one database do not wake each other. Give
// enqueuers and relays the same search_path.
const NotifyChannel = "atomicphase_outbox"

// Enqueue stages msgs in tx: they exist, and will be published, if and only
// if tx commits. Called inside an atomic phase, the messages record the
// phase's idempotency key.
//
// When ctx carries an OpenTelemetry span, each message's headers get its
// W3C trace context (traceparent, tracestate) as the global propagator
// writes it (otel.SetTextMapPropagator; the default writes nothing), unless
// the message sets those headers itself: publishers send them with the
// other headers, and the relay links its publish span to that trace.
//
// Every message is validated before anything is sent to the database; an
// invalid one fails the call with an error matching ErrInvalidMessage (and
// ErrInvalidTopic, ErrPayloadTooLarge or ErrInvalidHeader where one applies)
// and nothing is written. The messages are then written in one round trip,
// which also queues one notification to wake the relays at commit if a relay
// is idle and listening. While every relay is busy (or none runs), no
// notification is sent: PostgreSQL serialises the commits of notifying
// transactions, and a busy relay finds the messages in its next batch. The
// statement holds a shared advisory lock until tx ends, which a relay takes
// exclusively before it waits idle, so that it finds what was committed
// without a notification; a long transaction after Enqueue delays a relay
// going idle by up to 200 ms at a time, during which it polls.
//
// Ordering: for each distinct ordering key among msgs, Enqueue first takes a
// transaction-scoped advisory lock, and only then draws the messages' ids.
// A second transaction enqueueing on the same key waits for that lock until
// the first one commits or rolls back, so it draws larger ids and commits
// later: within an ordering key, id order is commit order, and a relay never
// sees a key's later message committed while an earlier one is still
// uncommitted. The price is that transactions staging messages with the same
// ordering key are serialized from their Enqueue to their commit; enqueue
// late in the transaction, and keep ordering keys as narrow as the ordering
// you need. The locks of one call are taken in a fixed order, so calls cannot
// deadlock each other; a transaction that calls Enqueue several times with
// different keys can, and then fails with a deadlock error (SQLSTATE 40P01)
// that the txn package retries.
func Enqueue(ctx context.Context, tx pgx.Tx, msgs ...Message) error {
	if tx == nil {
		return errors.New("outbox: enqueue: nil transaction")
	}
	if len(msgs) == 0 {
		return nil
	}
	p := db.EnqueueMessagesParams{
		Channel:       NotifyChannel,
		IdleLockClass: idleLockClass,
		Topics:        make([]string, len(msgs)),
		OrderingKeys:  make([]string, len(msgs)),
		Payloads:      make([][]byte, len(msgs)),
		Headers:       make([]string, len(msgs)),
		DelaysUs:      make([]int64, len(msgs)),
	}
	trace := traceHeaders(ctx)
	for i := range msgs {
		m := &msgs[i]
		if len(trace) > 0 {
			m = withTraceHeaders(m, trace)
		}
		headers, err := validate(i, m)
		if err != nil {
			return err
		}
		p.Topics[i] = m.Topic
		p.OrderingKeys[i] = m.OrderingKey
		p.Payloads[i] = m.Payload
		if p.Payloads[i] == nil {
			p.Payloads[i] = []byte{} // an empty payload, not SQL NULL
		}
		p.Headers[i] = headers
		p.DelaysUs[i] = m.Delay.Microseconds()
	}
	if id, ok := phasectx.KeyID(ctx); ok {
		p.IdempotencyKeyID = pgtype.Int8{Int64: id, Valid: true}
	}
	if err := db.New(tx).EnqueueMessages(ctx, p); err != nil {
		return fmt.Errorf("outbox: enqueue: %w", err)
	}
	return nil
}

// traceHeaders returns the W3C trace context of ctx's span (traceparent,
// tracestate), as the global OpenTelemetry propagator writes it, or nil when
// ctx carries no span or no propagator is installed.
func traceHeaders(ctx context.Context) propagation.MapCarrier {
	if !oteltrace.SpanContextFromContext(ctx).IsValid() {
		return nil
	}
	c := propagation.MapCarrier{}
	otel.GetTextMapPropagator().Inject(ctx, c)
	return c
}

// withTraceHeaders returns a copy of m whose headers carry trace, unless m
// sets a trace header of its own (in any case); m is not modified.
func withTraceHeaders(m *Message, trace propagation.MapCarrier) *Message {
	for name := range m.Headers {
		if strings.EqualFold(name, telemetry.HeaderTraceparent) || strings.EqualFold(name, telemetry.HeaderTracestate) {
			return m
		}
	}
	cp := *m
	cp.Headers = make(map[string]string, len(m.Headers)+len(trace))
	maps.Copy(cp.Headers, m.Headers)
	maps.Copy(cp.Headers, trace)
	return &cp
}
