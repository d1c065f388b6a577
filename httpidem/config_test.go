package httpidem_test

import (
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	_, err := httpidem.New(nil, &httpidem.Config{})
	require.Error(t, err)
	d := pgtest.New(t)
	r, err := txn.New(d.Pool, nil)
	require.NoError(t, err)
	_, err = httpidem.New(r, &httpidem.Config{})
	require.ErrorIs(t, err, httpidem.ErrNoScope)
}

func TestNewWrapsErrInvalidConfig(t *testing.T) {
	t.Parallel()
	_, err := httpidem.New(nil, &httpidem.Config{})
	require.ErrorIs(t, err, httpidem.ErrInvalidConfig)
	require.Equal(t, 1, strings.Count(err.Error(), "httpidem:"), err.Error())
	r, err := txn.New(pgtest.Pool(t), nil)
	require.NoError(t, err)
	_, err = httpidem.New(r, &httpidem.Config{})
	require.True(t, errors.Is(err, httpidem.ErrInvalidConfig) && errors.Is(err, httpidem.ErrNoScope), "%v", err)
	require.Equal(t, "httpidem: new: invalid config: Config.Scope is required", err.Error())
}

// A Config with only Scope gets the documented defaults.
func TestConfigGetsTheDocumentedDefaults(t *testing.T) {
	t.Parallel()
	runner, err := txn.New(pgtest.Pool(t), nil)
	require.NoError(t, err)
	m, err := httpidem.New(runner, &httpidem.Config{Scope: func(*http.Request) (string, error) { return "u", nil }})
	require.NoError(t, err)
	c := httpidem.ConfigOf(m)
	require.False(t, c.AllowAnonymous)
	for method, required := range map[string]bool{"POST": true, "PATCH": true, "PUT": false, "DELETE": false} {
		require.Equal(t, required, c.Required(httptest.NewRequest(method, "/", nil)), method)
	}
	require.Equal(t, int64(1<<20), c.MaxBodyBytes)
	require.Equal(t, int64(httpidem.MaxBodyBytesDefault), c.MaxBodyBytes)
	require.Equal(t, []string{"Content-Type", "Location"}, c.StoreHeaders)
	require.Same(t, slog.Default(), c.Logger)
}
