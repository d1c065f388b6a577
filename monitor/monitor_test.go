package monitor_test

import (
	"bytes"
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/opstest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/internal/telemetry/metrictest"
	"github.com/atomicphase/atomicphase/monitor"
	"github.com/atomicphase/atomicphase/recovery"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// seed writes one row of every state the figures tell apart.
func seed(t *testing.T, d *pgtest.DB) {
	t.Helper()
	p := d.Pool
	// Outbox: 3 pending (the oldest staged 90 s ago, one not yet due
	// counts too), 2 dead, 4 published.
	opstest.InsertMessage(t, p, opstest.Message{Age: 90 * time.Second})
	opstest.InsertMessage(t, p, opstest.Message{Age: 10 * time.Second, Attempts: 3, LastError: "503"})
	opstest.InsertMessage(t, p, opstest.Message{})
	opstest.InsertMessage(t, p, opstest.Message{State: "dead", Age: time.Hour, Attempts: 10, LastError: "gone"})
	opstest.InsertMessage(t, p, opstest.Message{State: "dead", Topic: "webhooks", Attempts: 1, LastError: "410"})
	for range 4 {
		opstest.InsertMessage(t, p, opstest.Message{State: "published", Age: time.Minute})
	}
	// Keys: 2 stalled (one with an expired lease), 1 held by a live lease,
	// 1 that ran recently, 1 failed, 1 finished.
	opstest.InsertKey(t, p, opstest.Key{Key: "stalled-old", Workflow: "create_ride", Age: 2 * time.Hour, Idle: 5 * time.Minute})
	opstest.InsertKey(t, p, opstest.Key{Key: "stalled-lease-expired", Workflow: "create_ride", Age: 3 * time.Minute,
		Idle: 2 * time.Minute, Lease: -time.Minute})
	opstest.InsertKey(t, p, opstest.Key{Key: "leased", Workflow: "create_ride", Age: time.Hour, Idle: 10 * time.Minute, Lease: time.Minute})
	opstest.InsertKey(t, p, opstest.Key{Key: "recent", Workflow: "create_ride", Age: 10 * time.Second})
	opstest.InsertKey(t, p, opstest.Key{Key: "failed", Workflow: "create_ride", Status: "failed", Age: time.Hour})
	opstest.InsertKey(t, p, opstest.Key{Key: "finished", Status: "finished", Age: time.Hour})
}

func TestReadReportsTheBacklogStalledKeysAndDeadLetters(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seed(t, d)
	s, err := monitor.Read(context.Background(), d.Pool, nil)
	require.NoError(t, err)
	require.Equal(t, int64(3), s.OutboxPending)
	require.InDelta(t, 90, s.OldestPendingAge.Seconds(), 30)
	require.Equal(t, int64(2), s.OutboxDead)
	require.Equal(t, int64(4), s.KeysRunning)
	require.Equal(t, int64(2), s.KeysStalled)
	require.InDelta(t, (2 * time.Hour).Seconds(), s.OldestStalledAge.Seconds(), 30)
	require.Equal(t, int64(1), s.KeysFailed)
	require.WithinDuration(t, time.Now(), s.At, time.Minute)

	// A longer stalled-after leaves only the key idle for 5 minutes.
	s, err = monitor.Read(context.Background(), d.Pool, &monitor.Config{StalledAfter: 3 * time.Minute})
	require.NoError(t, err)
	require.Equal(t, int64(1), s.KeysStalled)
}

func TestReadOfAnEmptyInstallationIsAllZero(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	s, err := monitor.Read(context.Background(), d.Pool, nil)
	require.NoError(t, err)
	s.At = time.Time{}
	require.Equal(t, monitor.Snapshot{}, s)
}

// Stalled means what the Resumer takes: by default, the Resumer's own
// resume delay.
func TestStalledAfterDefaultsToTheResumersDelay(t *testing.T) {
	t.Parallel()
	require.Equal(t, recovery.ResumeDelayDefault, monitor.StalledAfterDefault)
}

func TestBadConfigIsRefused(t *testing.T) {
	t.Parallel()
	_, err := monitor.RegisterGauges(nil, nil)
	require.ErrorIs(t, err, monitor.ErrInvalidConfig)
	_, err = monitor.Read(context.Background(), nil, nil)
	require.ErrorIs(t, err, monitor.ErrInvalidConfig)
	d := pgtest.New(t)
	_, err = monitor.RegisterGauges(d.Pool, &monitor.Config{StalledAfter: -time.Second})
	require.ErrorIs(t, err, monitor.ErrInvalidConfig)
	require.EqualError(t, err, "monitor: register gauges: invalid config: StalledAfter -1s is negative")
}

// The gauges are read at each collection, through the SDK's manual reader
// here, and report the database's figures.
func TestGaugesReportTheFiguresAtEachCollection(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	seed(t, d)
	mp, reader := metrictest.NewProvider(t)
	g, err := monitor.RegisterGauges(d.Pool, &monitor.Config{MeterProvider: mp})
	require.NoError(t, err)

	got := metrictest.Collect(t, reader)
	for name, want := range map[string]struct {
		unit  string
		value float64
	}{
		telemetry.MetricPending: {"{message}", 3},
		telemetry.MetricDead:    {"{message}", 2},
		telemetry.MetricStalled: {"{key}", 2},
	} {
		require.Equal(t, "gauge", got[name].Kind, name)
		require.Equal(t, want.unit, got[name].Unit, name)
		require.Equal(t, want.value, got[name].Points[""].Value, name)
	}
	age := got[telemetry.MetricOldestPendingAge]
	require.Equal(t, "s", age.Unit)
	require.InDelta(t, 90, age.Points[""].Value, 30)

	// Read again at the next collection: a message published meanwhile.
	_, err = d.Pool.Exec(context.Background(),
		`UPDATE outbox_messages SET published_at = now() WHERE published_at IS NULL AND dead_at IS NULL
		 AND created_at < now() - interval '1 minute'`)
	require.NoError(t, err)
	got = metrictest.Collect(t, reader)
	require.Equal(t, 2.0, got[telemetry.MetricPending].Points[""].Value)
	require.Less(t, got[telemetry.MetricOldestPendingAge].Points[""].Value, 60.0)

	require.NoError(t, g.Unregister())
	require.NoError(t, g.Unregister(), "twice is fine")
	got = metrictest.Collect(t, reader)
	require.Empty(t, got[telemetry.MetricPending].Points, "unregistered gauges are not read")
}

// When the database cannot be read, the gauges report nothing rather than
// a stale or zero figure, and the collection of other metrics goes on.
func TestGaugesReportNothingWhenTheDatabaseCannotBeRead(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	pool := d.NewPool(t, nil)
	mp, reader := metrictest.NewProvider(t)
	var logged bytes.Buffer
	_, err := monitor.RegisterGauges(pool, &monitor.Config{MeterProvider: mp, QueryTimeout: 2 * time.Second,
		Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	require.NoError(t, err)
	telemetry.NewCleanup(mp).Round(context.Background(), false)
	pool.Close()

	got, err := metrictest.CollectWithError(reader)
	require.ErrorContains(t, err, "monitor: gauges: closed pool")
	require.Contains(t, logged.String(), "cannot read the gauges")
	require.Empty(t, got[telemetry.MetricPending].Points)
	require.Contains(t, got, telemetry.MetricCleanupSkipped, "other metrics are still collected")
}
