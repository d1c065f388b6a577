package pgcluster_test

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgcluster"
)

func TestStartConnectRestartStop(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := pgcluster.Start(ctx, pgcluster.Options{})
	if errors.Is(err, pgcluster.ErrNoBinaries) && os.Getenv("CI") == "" {
		t.Skip("PostgreSQL server binaries are not installed here; CI has them")
	}
	require.NoError(t, err)
	dir := c.DataDir()

	conn, err := pgx.Connect(ctx, c.ConnString("postgres"))
	require.NoError(t, err)
	var fsync string
	require.NoError(t, conn.QueryRow(ctx, `SHOW fsync`).Scan(&fsync))
	require.Equal(t, "off", fsync, "a throwaway cluster trades durability for speed")
	require.NoError(t, conn.Close(ctx))

	require.NoError(t, c.Restart(ctx, "immediate"))
	conn, err = pgx.Connect(ctx, c.ConnString("postgres"))
	require.NoError(t, err)
	require.NoError(t, conn.Ping(ctx))
	require.NoError(t, conn.Close(ctx))

	require.NoError(t, c.Stop())
	_, err = os.Stat(dir)
	require.True(t, os.IsNotExist(err), "the cluster's files are removed")
}

// Run as root, the cluster runs as an unprivileged user, who cannot enter a
// private TMPDIR of root's (as mktemp -d makes): the cluster then lives in
// /tmp, and is removed from there too.
func TestStartsWhenTMPDIRIsPrivate(t *testing.T) {
	private := t.TempDir()
	require.NoError(t, os.Chmod(private, 0o700))
	t.Setenv("TMPDIR", private)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := pgcluster.Start(ctx, pgcluster.Options{})
	if errors.Is(err, pgcluster.ErrNoBinaries) && os.Getenv("CI") == "" {
		t.Skip("PostgreSQL server binaries are not installed here; CI has them")
	}
	require.NoError(t, err)
	conn, err := pgx.Connect(ctx, c.ConnString("postgres"))
	require.NoError(t, err)
	require.NoError(t, conn.Ping(ctx))
	require.NoError(t, conn.Close(ctx))
	dir := c.DataDir()
	require.NoError(t, c.Stop())
	_, err = os.Stat(dir)
	require.True(t, os.IsNotExist(err), "the cluster's files are removed")
}
