package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// New validates its arguments and fills defaults.
func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	pub := PublisherFunc(func(context.Context, Envelope) error { return nil })
	_, err := New(nil, pub, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = New(d.Pool, nil, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	for _, cfg := range []Config{
		{BatchSize: -1},
		{BatchSize: 10001},
		{PollInterval: -time.Second},
		{PublishTimeout: -time.Second},
		{MaxAttempts: -1},
		{RetryBaseDelay: -time.Second},
		{RetryBaseDelay: time.Hour, RetryMaxDelay: time.Minute},
	} {
		_, err := New(d.Pool, pub, &cfg)
		require.ErrorIs(t, err, ErrInvalidConfig, "%+v", cfg)
	}
	r, err := New(d.Pool, pub, nil)
	require.NoError(t, err)
	require.Equal(t, 100, r.cfg.BatchSize)
	require.Equal(t, time.Second, r.cfg.PollInterval)
	require.Equal(t, 10*time.Second, r.cfg.PublishTimeout)
	require.Equal(t, 10, r.cfg.MaxAttempts)
	require.Equal(t, time.Second, r.cfg.RetryBaseDelay)
	require.Equal(t, 10*time.Minute, r.cfg.RetryMaxDelay)
	require.NotNil(t, r.cfg.Logger)
}
