package txn_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/internal/txnbridge"
	"github.com/atomicphase/atomicphase/txn"
)

func TestNewRejectsInvalidConfig(t *testing.T) {
	t.Parallel()
	_, err := txn.New(nil, nil)
	require.ErrorIs(t, err, txn.ErrInvalidConfig)
	e := newEnv(t, nil)
	_, err = txn.New(e.Pool, &txn.Config{LeaseDuration: -1})
	require.ErrorIs(t, err, txn.ErrInvalidConfig)
	_, err = txn.New(e.Pool, &txn.Config{LeaseDuration: time.Millisecond})
	require.ErrorIs(t, err, txn.ErrInvalidConfig)
	_, err = txn.New(e.Pool, &txn.Config{ExpiredKeyPolicy: 7})
	require.ErrorIs(t, err, txn.ErrInvalidConfig)
}

func TestMaxAgeMustStayUnderTheProvidersWindow(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	for _, bad := range []time.Duration{txn.MaxAgeLimit, 36 * time.Hour, -time.Second} {
		_, err := txn.New(e.Pool, &txn.Config{MaxAge: bad})
		require.ErrorIs(t, err, txn.ErrInvalidConfig, bad)
	}
	r, err := txn.New(e.Pool, &txn.Config{MaxAge: txn.MaxAgeLimit - time.Second})
	require.NoError(t, err)
	require.Equal(t, txn.MaxAgeLimit-time.Second, txnbridge.Of(r).MaxAge)
	r, err = txn.New(e.Pool, nil)
	require.NoError(t, err)
	require.Equal(t, txn.MaxAgeDefault, txnbridge.Of(r).MaxAge)
	require.Equal(t, 12*time.Hour, txn.MaxAgeDefault)
}

// A zero Config gets the documented defaults, which the …Default constants
// name.
func TestZeroConfigGetsTheDocumentedDefaults(t *testing.T) {
	t.Parallel()
	r, err := txn.New(pgtest.Pool(t), nil)
	require.NoError(t, err)
	c := txn.ConfigOf(r)
	require.NotNil(t, c.Workflows)
	require.Empty(t, c.Workflows.Names())
	require.Same(t, slog.Default(), c.Logger)
	require.Equal(t, slog.LevelInfo, c.HitLogLevel)
	require.Equal(t, 90*time.Second, c.LeaseDuration)
	require.Equal(t, txn.LeaseDurationDefault, c.LeaseDuration)
	require.Equal(t, 8, c.MaxRetries)
	require.Equal(t, txn.MaxRetriesDefault, c.MaxRetries)
	require.Equal(t, 2*time.Millisecond, c.RetryBaseDelay)
	require.Equal(t, txn.RetryBaseDelayDefault, c.RetryBaseDelay)
	require.Equal(t, 250*time.Millisecond, c.RetryMaxDelay)
	require.Equal(t, txn.RetryMaxDelayDefault, c.RetryMaxDelay)
	require.Equal(t, 1<<20, c.MaxParamsBytes)
	require.Equal(t, txn.MaxParamsBytesDefault, c.MaxParamsBytes)
	require.False(t, c.WaitWhenInUse)
	require.Equal(t, 50*time.Millisecond, c.WaitPollInterval)
	require.Equal(t, txn.WaitPollIntervalDefault, c.WaitPollInterval)
	require.Equal(t, 5*time.Second, c.ReleaseTimeout)
	require.Equal(t, txn.ReleaseTimeoutDefault, c.ReleaseTimeout)
	require.Equal(t, 12*time.Hour, c.MaxAge)
	require.Equal(t, txn.MaxAgeDefault, c.MaxAge)
	for status := 100; status < 600; status++ {
		require.Equal(t, txn.DefaultStore(status), c.Store(status))
	}
}
