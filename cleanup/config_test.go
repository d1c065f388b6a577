package cleanup_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/cleanup"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

func TestNewValidatesExpiryWindow(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	_, err := cleanup.New(nil, nil)
	require.ErrorIs(t, err, cleanup.ErrInvalidConfig)
	requireOnePrefix(t, err)
	for name, cfg := range map[string]cleanup.Config{
		"ttl under a day":     {TTL: 23 * time.Hour},
		"ttl over a week":     {TTL: 7*24*time.Hour + time.Second},
		"negative ttl":        {TTL: -time.Hour},
		"negative retention":  {OutboxRetention: -time.Hour},
		"negative batch":      {BatchSize: -1},
		"huge batch":          {BatchSize: 100_001},
		"negative interval":   {Interval: -time.Second},
		"negative pause":      {BatchPause: -time.Millisecond},
		"pause over a minute": {BatchPause: time.Minute + time.Millisecond},
	} {
		_, err := cleanup.New(pool, &cfg)
		require.ErrorIs(t, err, cleanup.ErrInvalidConfig, name)
		requireOnePrefix(t, err)
	}
	for _, ttl := range []time.Duration{0, cleanup.MinTTL, 72 * time.Hour, cleanup.MaxTTL} {
		_, err := cleanup.New(pool, &cleanup.Config{TTL: ttl})
		require.NoError(t, err)
	}
}

// A zero Config gets the documented defaults, which the …Default constants
// name.
func TestZeroConfigGetsTheDocumentedDefaults(t *testing.T) {
	t.Parallel()
	c, err := cleanup.New(pgtest.Pool(t), nil)
	require.NoError(t, err)
	require.Equal(t, cleanup.Config{
		Logger: slog.Default(), TTL: 24 * time.Hour, OutboxRetention: 7 * 24 * time.Hour, TombstoneRetention: 30 * 24 * time.Hour,
		BatchSize: 1000, Interval: 5 * time.Minute,
	}, cleanup.ConfigOf(c))
	require.Equal(t, cleanup.Config{
		Logger: slog.Default(), TTL: cleanup.TTLDefault, OutboxRetention: cleanup.OutboxRetentionDefault,
		TombstoneRetention: cleanup.TombstoneRetentionDefault, BatchSize: cleanup.BatchSizeDefault, Interval: cleanup.IntervalDefault,
		BatchPause: cleanup.BatchPauseDefault,
	}, cleanup.ConfigOf(c))
	require.Equal(t, cleanup.MinTTL, cleanup.TTLDefault)
	for _, pause := range []time.Duration{time.Millisecond, cleanup.BatchPauseMax} {
		c, err := cleanup.New(pgtest.Pool(t), &cleanup.Config{BatchPause: pause})
		require.NoError(t, err)
		require.Equal(t, pause, cleanup.ConfigOf(c).BatchPause)
	}
}
