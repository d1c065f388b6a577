package cleanup

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/service"
	"github.com/atomicphase/atomicphase/internal/telemetry"
)

// lockClass is the first half of the cleanup advisory lock's name ("apcl");
// the second is the idempotency_keys table's oid.
const lockClass int32 = 0x6170636c

// Report says what one round did.
type Report struct {
	// KeysDeleted counts idempotency keys deleted.
	KeysDeleted int64
	// OutboxDeleted counts outbox messages deleted.
	OutboxDeleted int64
	// InboxDeleted counts inbox rows (handled messages and dead letters)
	// deleted.
	InboxDeleted int64
	// TombstonesDeleted counts tombstones of deleted keys removed past
	// Config.TombstoneRetention (each deleted key leaves one, counted in
	// KeysDeleted).
	TombstonesDeleted int64
	// Batches counts the delete transactions that removed at least one row;
	// none removed more than Config.BatchSize.
	Batches int
	// Skipped is true when the round stopped because another cleaner held
	// the cleanup lock (it is deleting the same rows); the counts say what
	// this round deleted before that.
	Skipped bool
}

// Cleaner deletes expired keys, outbox messages and inbox rows. It is safe for
// concurrent use; across processes, one cleaner deletes at a time (a batch
// takes the cleanup lock; a round that finds it held stops).
type Cleaner struct {
	tracer *telemetry.Tracer
	pool   *pgxpool.Pool
	cfg    Config
	log    *slog.Logger

	life service.Lifecycle
}

// New returns a Cleaner over pool. cfg may be nil. Invalid values give an
// error wrapping ErrInvalidConfig.
func New(pool *pgxpool.Pool, cfg *Config) (*Cleaner, error) {
	if pool == nil {
		return nil, fmt.Errorf("cleanup: new: %w: pool is nil", ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("cleanup: new: %w", err)
	}
	return &Cleaner{pool: pool, cfg: c, log: c.Logger, tracer: telemetry.NewTracer(c.TracerProvider)}, nil
}

// RunOnce runs one round: it deletes expired keys, then expired outbox
// messages, then inbox rows past their keep_until (see package inbox), a
// batch per transaction, until a batch comes back short, waiting
// Config.BatchPause before each batch after the first. Each
// batch's transaction first takes the cleanup lock (a transaction-scoped
// advisory lock, so nothing outlives the transaction on a pooled
// connection); when another cleaner holds it, the round stops there, logs a
// warning, and returns a report with Skipped set: the other cleaner is
// deleting the same rows. If ctx ends, the round stops after the batch in
// flight (which gets up to 5 seconds to commit, else is rolled back), or at
// once during a pause, and the error wraps ctx's error; the report counts
// exactly the rows deleted.
func (c *Cleaner) RunOnce(ctx context.Context) (Report, error) {
	ctx, span := c.tracer.Start(ctx, telemetry.SpanCleanup, trace.SpanKindInternal)
	rep, err := c.runOnce(ctx)
	if span.IsRecording() {
		span.SetAttributes(attribute.Int64("atomicphase.keys_deleted", rep.KeysDeleted),
			attribute.Int64("atomicphase.outbox_deleted", rep.OutboxDeleted),
			attribute.Int64("atomicphase.inbox_deleted", rep.InboxDeleted),
			attribute.Bool("atomicphase.skipped", rep.Skipped))
		if err != nil && ctx.Err() == nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	}
	span.End()
	return rep, err
}

func (c *Cleaner) runOnce(ctx context.Context) (rep Report, err error) {
	// keysAfter and tombstonesAfter are where the round's next batch of
	// keys and of tombstones starts: the latest finished_at and expires_at
	// the previous one deleted (see DeleteExpiredKeys and
	// DeleteExpiredTombstones).
	var keysAfter, tombstonesAfter time.Time
	steps := []struct {
		op      string
		deleted *int64
		del     func(context.Context, *db.Queries) (int64, error)
	}{
		{"delete expired keys", &rep.KeysDeleted, func(ctx context.Context, q *db.Queries) (int64, error) {
			row, err := q.DeleteExpiredKeys(ctx, db.DeleteExpiredKeysParams{
				After: keysAfter, TtlSeconds: c.cfg.TTL.Seconds(), BatchSize: int32(c.cfg.BatchSize),
				TombstoneSeconds: c.cfg.TombstoneRetention.Seconds(),
			})
			if err != nil {
				return 0, err
			}
			keysAfter = row.NextAfter
			return row.Deleted, nil
		}},
		{"delete expired tombstones", &rep.TombstonesDeleted, func(ctx context.Context, q *db.Queries) (int64, error) {
			row, err := q.DeleteExpiredTombstones(ctx, db.DeleteExpiredTombstonesParams{
				After: tombstonesAfter, BatchSize: int32(c.cfg.BatchSize),
			})
			if err != nil {
				return 0, err
			}
			tombstonesAfter = row.NextAfter
			return row.Deleted, nil
		}},
		{"delete expired outbox messages", &rep.OutboxDeleted, func(ctx context.Context, q *db.Queries) (int64, error) {
			return q.DeleteExpiredOutboxMessages(ctx, db.DeleteExpiredOutboxMessagesParams{
				RetentionSeconds: c.cfg.OutboxRetention.Seconds(), BatchSize: int32(c.cfg.BatchSize),
			})
		}},
		{"delete expired inbox messages", &rep.InboxDeleted, func(ctx context.Context, q *db.Queries) (int64, error) {
			return q.DeleteExpiredInboxMessages(ctx, int32(c.cfg.BatchSize))
		}},
	}
	first := true
	for _, step := range steps {
		for {
			if err := ctx.Err(); err != nil {
				return rep, service.Wrap(ctx, "cleanup", step.op, err)
			}
			if !first && c.cfg.BatchPause > 0 {
				if err := pause(ctx, c.cfg.BatchPause); err != nil {
					return rep, service.Wrap(ctx, "cleanup", step.op, err)
				}
			}
			first = false
			n, locked, err := c.batch(ctx, step.del)
			if err != nil {
				return rep, service.Wrap(ctx, "cleanup", step.op, err)
			}
			if !locked {
				rep.Skipped = true
				c.log.WarnContext(ctx, "cleanup round skipped: another cleaner holds the cleanup lock",
					"reason", "lock_held", "keys_deleted", rep.KeysDeleted, "outbox_deleted", rep.OutboxDeleted,
					"inbox_deleted", rep.InboxDeleted)
				return rep, nil
			}
			*step.deleted += n
			if n > 0 {
				rep.Batches++
			}
			if n < int64(c.cfg.BatchSize) {
				break
			}
		}
	}
	return rep, nil
}

// pause waits d, or until ctx ends, when it returns ctx's error.
func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// batch runs del in a transaction of its own that first takes the cleanup
// lock without waiting; locked is false (and nothing deleted) when another
// cleaner holds it.
func (c *Cleaner) batch(ctx context.Context, del func(context.Context, *db.Queries) (int64, error)) (n int64, locked bool, err error) {
	err = service.InBatch(ctx, func(ctx context.Context) error {
		return pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
			q := db.New(tx)
			ok, err := q.TryLockCleanup(ctx, lockClass)
			if err != nil || !ok {
				return err
			}
			n, err = del(ctx, q)
			locked = err == nil
			return err
		})
	})
	if err != nil {
		return 0, false, err
	}
	return n, locked, nil
}

// DryRun reports what a round would delete now, and changes nothing
// (Batches stays zero).
func (c *Cleaner) DryRun(ctx context.Context) (Report, error) {
	n, err := db.New(c.pool).CountExpired(ctx, db.CountExpiredParams{
		TtlSeconds: c.cfg.TTL.Seconds(), RetentionSeconds: c.cfg.OutboxRetention.Seconds(),
	})
	if err != nil {
		return Report{}, service.Wrap(ctx, "cleanup", "count expired rows", err)
	}
	inbox, err := db.New(c.pool).CountExpiredInboxMessages(ctx)
	if err != nil {
		return Report{}, service.Wrap(ctx, "cleanup", "count expired inbox messages", err)
	}
	return Report{KeysDeleted: n.Keys, OutboxDeleted: n.OutboxMessages, InboxDeleted: inbox}, nil
}

// Start runs a round at once and then every Config.Interval, in a goroutine,
// until ctx ends or Stop is called. Each round's outcome is logged; a
// round's error does not stop the loop. Start on a running Cleaner returns
// ErrAlreadyStarted; one whose ctx ended may be started again.
func (c *Cleaner) Start(ctx context.Context) error {
	if err := c.life.Start(ctx, nil, service.Every(c.cfg.Interval, c.round)); err != nil {
		return fmt.Errorf("cleanup: start: %w", err)
	}
	return nil
}

// Stop ends the loop Start began, stopping the round in progress after its
// batch in flight, and returns when the loop has ended. It does nothing if
// not started.
func (c *Cleaner) Stop() { c.life.Stop() }

// round runs one round for the Start loop and logs its outcome; an error
// does not stop the loop.
func (c *Cleaner) round(ctx context.Context) {
	rep, err := c.RunOnce(ctx)
	switch {
	case err != nil && ctx.Err() != nil:
		return // stopped
	case err != nil:
		c.log.ErrorContext(ctx, "cleanup round failed", "error", err,
			"keys_deleted", rep.KeysDeleted, "outbox_deleted", rep.OutboxDeleted, "inbox_deleted", rep.InboxDeleted)
	default:
		level := slog.LevelInfo
		if rep.KeysDeleted == 0 && rep.OutboxDeleted == 0 && rep.InboxDeleted == 0 {
			level = slog.LevelDebug
		}
		c.log.Log(ctx, level, "cleanup round", "keys_deleted", rep.KeysDeleted,
			"outbox_deleted", rep.OutboxDeleted, "inbox_deleted", rep.InboxDeleted, "batches", rep.Batches, "skipped", rep.Skipped)
	}
}
