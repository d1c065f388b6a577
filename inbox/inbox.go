package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/backoff"
	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/pgbatch"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/usercode"
)

// Outcome says what Handle did with a message it acknowledged.
type Outcome int

const (
	// Handled: the handler ran and its writes committed with the
	// message's row.
	Handled Outcome = iota + 1
	// Duplicate: the message already had a row (it was handled, or
	// dead-lettered, before); the handler did not run and nothing was
	// written.
	Duplicate
)

func (o Outcome) String() string {
	switch o {
	case Handled:
		return "handled"
	case Duplicate:
		return "duplicate"
	default:
		return fmt.Sprintf("Outcome(%d)", int(o))
	}
}

// Func is a message handler: it writes the message's effects through tx
// and returns nil to commit them, or an error to roll them back. It may run
// more than once for one delivery (after a serialization failure) and once
// per delivery until one commits, so it must do nothing outside tx.
type Func func(ctx context.Context, tx pgx.Tx) error

// Stats counts what an Inbox did since it was created.
type Stats struct {
	Handled      uint64 // messages whose handler committed
	Duplicates   uint64 // redeliveries acknowledged without running the handler
	Failed       uint64 // deliveries whose handler failed (error or panic), rolled back
	Conflicts    uint64 // deliveries abandoned with ErrConflict after retries
	Retries      uint64 // transaction retries after serialization failures or deadlocks
	DeadLettered uint64 // messages recorded as dead letters
	Unavailable  uint64 // deliveries that found the database unavailable (ErrUnavailable), rolled back
}

// Inbox handles messages exactly once per consumer. It is safe for
// concurrent use.
type Inbox struct {
	pool  *pgxpool.Pool
	q     *db.Queries
	cfg   Config
	log   *slog.Logger
	retry backoff.Policy // the wait before a transaction's retry

	handled, duplicates, failed, conflicts, retries, deadLettered, unavailable atomic.Uint64
}

// New returns an Inbox on pool for cfg.Consumer. Invalid values give an
// error wrapping ErrInvalidConfig.
func New(pool *pgxpool.Pool, cfg *Config) (*Inbox, error) {
	if pool == nil {
		return nil, fmt.Errorf("inbox: new: %w: pool is nil", ErrInvalidConfig)
	}
	if cfg == nil {
		return nil, fmt.Errorf("inbox: new: %w: Consumer is required", ErrInvalidConfig)
	}
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("inbox: new: %w", err)
	}
	return &Inbox{pool: pool, q: db.New(pool), cfg: c, log: c.Logger,
		retry: backoff.Policy{Base: c.RetryBaseDelay, Max: c.RetryMaxDelay, Jitter: backoff.Equal}}, nil
}

// Config returns the inbox's configuration, with every default filled in.
func (in *Inbox) Config() Config { return in.cfg }

// Stats returns the inbox's counters.
func (in *Inbox) Stats() Stats {
	return Stats{
		Handled:      in.handled.Load(),
		Duplicates:   in.duplicates.Load(),
		Failed:       in.failed.Load(),
		Conflicts:    in.conflicts.Load(),
		Retries:      in.retries.Load(),
		DeadLettered: in.deadLettered.Load(),
		Unavailable:  in.unavailable.Load(),
	}
}

// CheckHorizon returns an error wrapping ErrRetentionTooShort when a
// message may be delivered again as late as horizon after it was handled
// and Config.Retention is not longer than that. what says where the
// horizon comes from, for the message. Adapters call it when they start.
func (in *Inbox) CheckHorizon(horizon time.Duration, what string) error {
	if horizon < in.cfg.Retention {
		return nil
	}
	return fmt.Errorf("inbox: %w: %s may deliver a message again up to %v after it was handled, and consumer %q keeps handled messages for %v (Retention); raise Retention above %v or shorten the redelivery horizon",
		ErrRetentionTooShort, what, horizon, in.cfg.Consumer, in.cfg.Retention, horizon)
}

// Handle handles the message with id messageID exactly once for this
// consumer. In one SERIALIZABLE transaction it records (consumer,
// messageID) in inbox_messages, runs fn with that transaction, and commits
// the row with fn's writes:
//
//   - a message seen before (its row is committed) is acknowledged without
//     running fn: Handle returns Duplicate and writes nothing;
//   - fn's error, or its panic (a *PanicError), rolls everything back and
//     is returned: the message has no row and is handled when it is
//     delivered again;
//   - a serialization failure or deadlock (from fn's statements, or at
//     commit) rolls back and runs the transaction again, fn included, up to
//     Config.MaxRetries times (then ErrConflict);
//   - a concurrent delivery of the same message waits for the first one's
//     transaction, then finds its row (Duplicate) or, if it rolled back,
//     handles the message itself;
//   - a database that cannot be reached or cannot take writes (a failed
//     connection, a server shutting down or starting, a read-only server
//     during a failover), whether Handle's statements or fn's met it, gives
//     an error wrapping ErrUnavailable: the message is left to be
//     delivered again, and it is not the handler's failure.
//
// So acknowledge the message to the broker when Handle returns nil (either
// outcome), and leave it for redelivery when it returns an error.
//
// messageID is validated before any SQL (see ValidateMessageID). fn must do
// nothing outside tx, and must not commit or roll back tx (ErrInvalidUse);
// a statement error that fn swallows still aborts the transaction, which
// Handle reports instead of committing.
func (in *Inbox) Handle(ctx context.Context, messageID string, fn Func) (Outcome, error) {
	if fn == nil {
		return 0, fmt.Errorf("inbox: handle: %w: nil func", ErrInvalidUse)
	}
	if err := ValidateMessageID(messageID); err != nil {
		return 0, fmt.Errorf("inbox: handle: %w", err)
	}
	for tries := 0; ; tries++ {
		out, err := in.attempt(ctx, messageID, fn)
		switch {
		case err == nil && out == Duplicate:
			in.duplicates.Add(1)
			in.log.Log(ctx, in.cfg.DuplicateLogLevel, "inbox: message already handled; acknowledged without running the handler",
				"consumer", in.cfg.Consumer, "message_id", messageID)
			return out, nil
		case err == nil:
			in.handled.Add(1)
			return out, nil
		case pgerr.IsUnavailable(err):
			in.unavailable.Add(1)
			return 0, fmt.Errorf("inbox: handle: %w: %w", ErrUnavailable, err)
		case !pgerr.IsRetryable(err):
			in.failed.Add(1)
			return 0, fmt.Errorf("inbox: handle: %w", err)
		case tries >= in.cfg.MaxRetries:
			in.conflicts.Add(1)
			return 0, fmt.Errorf("inbox: handle: %w (%d retries): %w", ErrConflict, tries, err)
		}
		in.retries.Add(1)
		if err := backoff.Sleep(ctx, in.retry.Delay(tries)); err != nil {
			return 0, fmt.Errorf("inbox: handle: %w", err)
		}
	}
}

var serializable = pgx.TxOptions{IsoLevel: pgx.Serializable}

// attempt runs one transaction: BEGIN and the message's row go to the
// server in one round trip, then fn, then COMMIT.
func (in *Inbox) attempt(ctx context.Context, messageID string, fn Func) (Outcome, error) {
	conn, err := in.pool.Acquire(ctx)
	if err != nil {
		return 0, fmt.Errorf("acquire: %w", err)
	}
	defer conn.Release()
	tx, br, err := pgbatch.Begin(ctx, conn.Conn(), serializable, func(b *pgx.Batch) error {
		_, err := db.New(pgbatch.Queue{B: b}).RecordInboxMessage(ctx, db.RecordInboxMessageParams{
			Consumer: in.cfg.Consumer, MessageID: messageID, RetentionSeconds: in.cfg.Retention.Seconds(),
		})
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			rollback(ctx, tx)
		}
	}()
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return 0, fmt.Errorf("record message: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return Duplicate, nil // the deferred rollback ends the transaction
	}
	htx := &handlerTx{Tx: tx}
	_, err = usercode.Call(func() (struct{}, error) { return struct{}{}, fn(ctx, htx) }, newPanicError)
	if err != nil {
		return 0, err
	}
	if err := htx.usable(); err != nil {
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	committed = true
	return Handled, nil
}

func newPanicError(value any, stack []byte) error { return &PanicError{Value: value, Stack: stack} }

// rollbackTimeout bounds ending a transaction after a failure.
const rollbackTimeout = 5 * time.Second

// rollback ends tx on a context detached from the caller's, which may be
// done.
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// DeadLetter records msg as a message the consumer gave up on, with cause
// (its last delivery's error), in a transaction of its own, and returns
// true. It returns false, and changes nothing, when the message already
// has a row: it was handled (by a concurrent delivery) or dead-lettered
// before. Adapters call it when the broker's last delivery of a message
// fails; a later redelivery is then acknowledged without running the
// handler. Delete the row to have a redelivered message handled again.
//
// The row keeps the message's topic, payload and headers, and the error's
// text (up to 8 KiB), for inspection; it is kept for Config.Retention like
// any other.
func (in *Inbox) DeadLetter(ctx context.Context, msg Message, cause error) (bool, error) {
	if err := ValidateMessageID(msg.ID); err != nil {
		return false, fmt.Errorf("inbox: dead letter: %w", err)
	}
	if cause == nil {
		cause = errors.New("unknown error")
	}
	headers, err := headersJSON(msg.Headers)
	if err != nil {
		return false, fmt.Errorf("inbox: dead letter: encode headers: %w", err)
	}
	p := db.DeadLetterInboxMessageParams{
		Consumer: in.cfg.Consumer, MessageID: msg.ID, RetentionSeconds: in.cfg.Retention.Seconds(),
		LastError: storableText(cause.Error(), maxErrorBytes),
		Payload:   msg.Payload,
	}
	if p.Payload == nil {
		p.Payload = []byte{}
	}
	if msg.Deliveries > 0 {
		p.Deliveries = pgtype.Int4{Int32: int32(min(msg.Deliveries, 1<<31-1)), Valid: true}
	}
	if msg.Topic != "" {
		p.Topic = pgtype.Text{String: storableText(msg.Topic, 0), Valid: true}
	}
	if headers != "" {
		p.Headers = pgtype.Text{String: headers, Valid: true}
	}
	n, err := in.q.DeadLetterInboxMessage(ctx, p)
	if err != nil {
		if pgerr.IsUnavailable(err) {
			return false, fmt.Errorf("inbox: dead letter: %w: %w", ErrUnavailable, err)
		}
		return false, fmt.Errorf("inbox: dead letter: %w", err)
	}
	if n == 0 {
		return false, nil
	}
	in.deadLettered.Add(1)
	in.log.WarnContext(ctx, "inbox: message dead-lettered: the broker will not deliver it again",
		"consumer", in.cfg.Consumer, "message_id", msg.ID, "topic", msg.Topic, "deliveries", msg.Deliveries, "error", cause)
	return true, nil
}
