package pgbouncer_test

import (
	"context"
	"errors"
	"os"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgbouncer"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var (
	bouncerOnce sync.Once
	bouncer     *pgbouncer.Bouncer
	bouncerErr  error
)

// startBouncer returns the test binary's PgBouncer, started on first use in
// front of the test server and stopped when the tests end. Without a
// pgbouncer binary the test is skipped on a developer's machine, and fails
// under CI (CI set): the CI script installs it.
func startBouncer(t *testing.T) *pgbouncer.Bouncer {
	t.Helper()
	server := pgtest.ServerURL(t)
	bouncerOnce.Do(func() {
		bouncer, bouncerErr = pgbouncer.Start(context.Background(), server, pgbouncer.Options{})
		if bouncerErr == nil {
			pgtest.AtExit(bouncer.Stop)
		}
	})
	if errors.Is(bouncerErr, pgbouncer.ErrNotInstalled) && os.Getenv("CI") == "" {
		t.Skipf("%v; CI runs these tests", bouncerErr)
	}
	require.NoError(t, bouncerErr)
	return bouncer
}
