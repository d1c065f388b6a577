package outbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/db"
)

// MaxRedriveIDs is the most ids one Redrive call may name.
const MaxRedriveIDs = 10000

// redriveBatch is how many messages one transaction of a Redrive with All
// returns to pending.
const redriveBatch = 1000

// RedriveSelection chooses the dead-lettered messages Redrive returns to
// pending: the messages named by IDs and RowIDs, or All of them (of Topic,
// when it is set).
type RedriveSelection struct {
	// IDs are message ids (Envelope.ID).
	IDs []uuid.UUID
	// RowIDs are outbox row ids (Envelope.RowID).
	RowIDs []int64
	// All selects every message dead-lettered when Redrive starts. It
	// cannot be combined with IDs or RowIDs.
	All bool
	// Topic, with All, selects only that topic's messages.
	Topic string
}

// Redriven is a message Redrive returned to pending, as it was before.
type Redriven struct {
	// ID is the message's id, kept: receivers that saw an earlier attempt
	// deduplicate the next one on it.
	ID uuid.UUID
	// RowID is its row id.
	RowID int64
	// Topic and OrderingKey are as enqueued.
	Topic, OrderingKey string
	// Attempts is how many attempts it had had; it starts again from 0.
	Attempts int
	// DeadAt is when it had been dead-lettered, by the database clock.
	DeadAt time.Time
	// LastError is the error of its last attempt. The row keeps it until
	// the next attempt overwrites it.
	LastError string
}

// Redrive returns dead-lettered messages to pending, for the relay to
// publish again: dead_at is cleared, the attempts start again from 0, and
// the messages are due at once (by the database clock). Each keeps its
// message id. Listening relays are woken at commit. The result says what
// each message was before, for the caller's audit log.
//
// With IDs or RowIDs it is all or nothing: if one of them is not a dead
// letter (it is pending, published, deleted, or was never there), nothing
// changes and the error wraps ErrNotDeadLettered, naming them. With All,
// messages are returned in batches of 1000, each committed on its own,
// oldest dead first; a message that dies again during the call is not
// taken twice. If a batch fails, the batches committed before it stay
// redriven and are returned with the error.
//
// A redriven message with an ordering key is published before its key's
// messages that are still pending, and after those that were published
// while it was dead: dead-lettering it released the key.
func Redrive(ctx context.Context, pool *pgxpool.Pool, sel RedriveSelection) ([]Redriven, error) {
	switch {
	case pool == nil:
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidRedrive)
	case sel.All && (len(sel.IDs) > 0 || len(sel.RowIDs) > 0):
		return nil, fmt.Errorf("%w: All and ids given together", ErrInvalidRedrive)
	case !sel.All && len(sel.IDs) == 0 && len(sel.RowIDs) == 0:
		return nil, fmt.Errorf("%w: no ids given, and not All", ErrInvalidRedrive)
	case !sel.All && sel.Topic != "":
		return nil, fmt.Errorf("%w: Topic is only for All", ErrInvalidRedrive)
	case len(sel.IDs)+len(sel.RowIDs) > MaxRedriveIDs:
		return nil, fmt.Errorf("%w: %d ids given, at most %d", ErrInvalidRedrive, len(sel.IDs)+len(sel.RowIDs), MaxRedriveIDs)
	}
	if sel.All {
		return redriveAll(ctx, pool, sel.Topic)
	}
	return redriveIDs(ctx, pool, sel.IDs, sel.RowIDs)
}

func redriveIDs(ctx context.Context, pool *pgxpool.Pool, ids []uuid.UUID, rowIDs []int64) ([]Redriven, error) {
	var out []Redriven
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		q := db.New(tx)
		rows, err := q.RedriveMessages(ctx, db.RedriveMessagesParams{
			RowIds:     nonNil(rowIDs),
			MessageIds: uuidStrings(ids),
		})
		if err != nil {
			return err
		}
		out = make([]Redriven, 0, len(rows))
		for _, r := range rows {
			out = append(out, Redriven{
				ID: r.MessageID.UUID, RowID: r.ID, Topic: r.Topic, OrderingKey: r.OrderingKey,
				Attempts: int(r.PreviousAttempts), DeadAt: r.DeadAt, LastError: r.LastError,
			})
		}
		if missing := notRedriven(out, ids, rowIDs); missing != "" {
			return fmt.Errorf("%w: %s", ErrNotDeadLettered, missing)
		}
		return q.NotifyRelays(ctx, NotifyChannel)
	})
	if errors.Is(err, ErrNotDeadLettered) {
		return nil, err // already says "outbox: ..."
	}
	if err != nil {
		return nil, fmt.Errorf("outbox: redrive: %w", err)
	}
	return out, nil
}

// notRedriven names the requested ids that are not among those redriven.
func notRedriven(done []Redriven, ids []uuid.UUID, rowIDs []int64) string {
	var missing []string
	for _, id := range uniq(rowIDs) {
		if !slices.ContainsFunc(done, func(r Redriven) bool { return r.RowID == id }) {
			missing = append(missing, strconv.FormatInt(id, 10))
		}
	}
	for _, id := range uniq(ids) {
		if !slices.ContainsFunc(done, func(r Redriven) bool { return r.ID == id }) {
			missing = append(missing, id.String())
		}
	}
	if len(missing) == 0 {
		return ""
	}
	return strings.Join(missing, ", ") + " (pending, published, deleted or unknown); nothing was redriven"
}

func redriveAll(ctx context.Context, pool *pgxpool.Pool, topic string) ([]Redriven, error) {
	before, err := db.New(pool).DatabaseNow(ctx)
	if err != nil {
		return nil, fmt.Errorf("outbox: redrive: %w", err)
	}
	var out []Redriven
	for {
		var n int
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			q := db.New(tx)
			rows, err := q.RedriveDeadBatch(ctx, db.RedriveDeadBatchParams{DeadBefore: before, Topic: topic, BatchSize: redriveBatch})
			if err != nil || len(rows) == 0 {
				return err
			}
			n = len(rows)
			for _, r := range rows {
				out = append(out, Redriven{
					ID: r.MessageID.UUID, RowID: r.ID, Topic: r.Topic, OrderingKey: r.OrderingKey,
					Attempts: int(r.PreviousAttempts), DeadAt: r.DeadAt, LastError: r.LastError,
				})
			}
			return q.NotifyRelays(ctx, NotifyChannel)
		})
		if err != nil {
			// This batch rolled back: drop what it appended.
			out = out[:len(out)-n]
			return out, fmt.Errorf("outbox: redrive: %d messages redriven, then: %w", len(out), err)
		}
		if n == 0 {
			return out, nil
		}
	}
}

func uniq[T comparable](s []T) []T {
	seen := make(map[T]bool, len(s))
	out := s[:0:0]
	for _, v := range s {
		if !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	return out
}

// uuidStrings renders ids as text, bound as text[] and cast to uuid[] in
// the query: pgx cannot encode a []uuid.UUID without the server's
// description of the parameter, which the exec and simple_protocol modes
// (the ones that work behind PgBouncer) never ask for.
func uuidStrings(ids []uuid.UUID) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.String()
	}
	return out
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
