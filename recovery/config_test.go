package recovery_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/recovery"
	"github.com/atomicphase/atomicphase/txn"
)

func TestNewRejectsInvalidConfig(t *testing.T) {
	t.Parallel()
	runner, err := txn.New(pgtest.Pool(t), nil)
	require.NoError(t, err)
	_, err = recovery.New(nil, nil)
	require.ErrorIs(t, err, recovery.ErrInvalidConfig)
	require.Equal(t, "recovery: new: invalid config: runner is nil", err.Error(), "one prefix")
	for name, cfg := range map[string]recovery.Config{
		"negative resume delay":  {ResumeDelay: -time.Second},
		"negative max attempts":  {MaxAttempts: -1},
		"negative unknown delay": {UnknownWorkflowDelay: -time.Second},
		"negative concurrency":   {Concurrency: -1},
		"negative interval":      {Interval: -1},
		"huge batch":             {BatchSize: 10001},
	} {
		_, err := recovery.New(runner, &cfg)
		require.ErrorIs(t, err, recovery.ErrInvalidConfig, name)
	}
	_, err = recovery.New(runner, nil)
	require.NoError(t, err)
}

// A zero Config gets the documented defaults, which the …Default constants
// name; the logger is the runner's.
func TestZeroConfigGetsTheDocumentedDefaults(t *testing.T) {
	t.Parallel()
	logger := slog.New(slog.DiscardHandler)
	runner, err := txn.New(pgtest.Pool(t), &txn.Config{Logger: logger})
	require.NoError(t, err)
	r, err := recovery.New(runner, nil)
	require.NoError(t, err)
	require.Equal(t, recovery.Config{
		Logger: logger, ResumeDelay: time.Minute, MaxAttempts: 10, UnknownWorkflowDelay: time.Hour,
		BatchSize: 100, Concurrency: 4, Interval: 30 * time.Second,
	}, recovery.ConfigOf(r))
	require.Equal(t, recovery.Config{
		Logger: logger, ResumeDelay: recovery.ResumeDelayDefault, MaxAttempts: recovery.MaxAttemptsDefault,
		UnknownWorkflowDelay: recovery.UnknownWorkflowDelayDefault, BatchSize: recovery.BatchSizeDefault,
		Concurrency: recovery.ConcurrencyDefault, Interval: recovery.IntervalDefault,
	}, recovery.ConfigOf(r))
}
