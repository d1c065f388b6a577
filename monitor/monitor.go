package monitor

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/telemetry"
)

// Snapshot is what Read returns. Ages are measured by the database clock.
type Snapshot struct {
	// At is when the figures were read, by the database clock.
	At time.Time
	// OutboxPending counts messages neither published nor dead-lettered
	// (due or not).
	OutboxPending int64
	// OldestPendingAge is how long ago the oldest pending message was
	// staged; 0 when none is pending. A growing value means the relays are
	// behind, or a failing message holds its ordering key back.
	OldestPendingAge time.Duration
	// OutboxDead counts dead-lettered messages still kept (cleanup deletes
	// them after the outbox retention).
	OutboxDead int64
	// KeysRunning counts keys not yet terminal: in flight or stalled.
	KeysRunning int64
	// KeysStalled counts running keys with a free or expired lease whose
	// last run is older than Config.StalledAfter: what a Resumer would
	// resume or fail.
	KeysStalled int64
	// OldestStalledAge is the age (since creation) of the oldest stalled
	// key; 0 when none is stalled.
	OldestStalledAge time.Duration
	// KeysFailed counts failed keys still kept (cleanup deletes them after
	// the TTL).
	KeysFailed int64
}

// Read returns the figures, read in one statement. cfg may be nil; only
// StalledAfter is used.
func Read(ctx context.Context, pool *pgxpool.Pool, cfg *Config) (Snapshot, error) {
	if pool == nil {
		return Snapshot{}, fmt.Errorf("monitor: read: %w: pool is nil", ErrInvalidConfig)
	}
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return Snapshot{}, fmt.Errorf("monitor: read: %w", err)
	}
	s, err := read(ctx, db.New(pool), c.StalledAfter)
	if err != nil {
		return Snapshot{}, fmt.Errorf("monitor: read: %w", err)
	}
	return s, nil
}

func read(ctx context.Context, q *db.Queries, stalledAfter time.Duration) (Snapshot, error) {
	row, err := q.Snapshot(ctx, stalledAfter.Seconds())
	if err != nil {
		return Snapshot{}, err
	}
	return Snapshot{
		At:               row.ReadAt,
		OutboxPending:    row.OutboxPending,
		OldestPendingAge: seconds(row.OldestPendingAgeSeconds),
		OutboxDead:       row.OutboxDead,
		KeysRunning:      row.KeysRunning,
		KeysStalled:      row.KeysStalled,
		OldestStalledAge: seconds(row.OldestStalledAgeSeconds),
		KeysFailed:       row.KeysFailed,
	}, nil
}

// seconds converts a non-negative number of seconds to a Duration,
// rounded to the microsecond (the database clock's resolution).
func seconds(s float64) time.Duration {
	if s <= 0 || math.IsNaN(s) {
		return 0
	}
	if s >= math.MaxInt64/float64(time.Second) {
		return math.MaxInt64
	}
	return time.Duration(math.Round(s*1e6)) * time.Microsecond
}

// Gauges is the registration of the observable gauges; Unregister removes
// it.
type Gauges struct {
	reg  metric.Registration
	once sync.Once
	err  error
}

// RegisterGauges registers the four gauges with cfg.MeterProvider (the
// global provider by default): one callback reads them all with one
// statement at each collection, bounded by cfg.QueryTimeout. When the
// read fails the gauges report nothing for that collection (their series
// go stale rather than show a wrong figure) and the error is logged. cfg
// may be nil.
func RegisterGauges(pool *pgxpool.Pool, cfg *Config) (*Gauges, error) {
	if pool == nil {
		return nil, fmt.Errorf("monitor: register gauges: %w: pool is nil", ErrInvalidConfig)
	}
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("monitor: register gauges: %w", err)
	}
	m := telemetry.Meter(c.MeterProvider)
	pending, err := m.Int64ObservableGauge(telemetry.MetricPending, metric.WithUnit(telemetry.UnitMessages),
		metric.WithDescription("Outbox messages neither published nor dead-lettered."))
	if err != nil {
		return nil, fmt.Errorf("monitor: register gauges: %w", err)
	}
	oldest, err := m.Float64ObservableGauge(telemetry.MetricOldestPendingAge, metric.WithUnit(telemetry.UnitSeconds),
		metric.WithDescription("Age of the oldest pending outbox message, by the database clock; 0 when none is pending."))
	if err != nil {
		return nil, fmt.Errorf("monitor: register gauges: %w", err)
	}
	dead, err := m.Int64ObservableGauge(telemetry.MetricDead, metric.WithUnit(telemetry.UnitMessages),
		metric.WithDescription("Dead-lettered outbox messages kept until the outbox retention."))
	if err != nil {
		return nil, fmt.Errorf("monitor: register gauges: %w", err)
	}
	stalled, err := m.Int64ObservableGauge(telemetry.MetricStalled, metric.WithUnit(telemetry.UnitKeys),
		metric.WithDescription("Running idempotency keys with a free or expired lease, idle past the resume delay."))
	if err != nil {
		return nil, fmt.Errorf("monitor: register gauges: %w", err)
	}
	q := db.New(pool)
	reg, err := m.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, c.QueryTimeout)
		defer cancel()
		s, err := read(ctx, q, c.StalledAfter)
		if err != nil {
			c.Logger.WarnContext(ctx, "monitor: cannot read the gauges", "error", err.Error())
			return fmt.Errorf("monitor: gauges: %w", err)
		}
		o.ObserveInt64(pending, s.OutboxPending)
		o.ObserveFloat64(oldest, s.OldestPendingAge.Seconds())
		o.ObserveInt64(dead, s.OutboxDead)
		o.ObserveInt64(stalled, s.KeysStalled)
		return nil
	}, pending, oldest, dead, stalled)
	if err != nil {
		return nil, fmt.Errorf("monitor: register gauges: %w", err)
	}
	return &Gauges{reg: reg}, nil
}

// Unregister stops the gauges from being read. It is safe to call more
// than once.
func (g *Gauges) Unregister() error {
	g.once.Do(func() {
		if err := g.reg.Unregister(); err != nil {
			g.err = fmt.Errorf("monitor: unregister gauges: %w", err)
		}
	})
	return g.err
}
