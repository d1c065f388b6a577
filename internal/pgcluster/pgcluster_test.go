package pgcluster_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
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

// A primary with a synchronous standby: the standby streams from it; after
// the primary is killed with SIGKILL and the standby promoted, the
// multi-host connection string reaches the new primary, which has every
// committed row and accepts writes. Stop removes both clusters' files, the
// killed one's too.
func TestStandbyPromotedAfterPrimaryKilled(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary, err := pgcluster.Start(ctx, pgcluster.Options{Settings: map[string]string{
		"synchronous_standby_names": "'*'", "synchronous_commit": "on"}})
	if errors.Is(err, pgcluster.ErrNoBinaries) && os.Getenv("CI") == "" {
		t.Skip("PostgreSQL server binaries are not installed here; CI has them")
	}
	require.NoError(t, err)
	t.Cleanup(func() { _ = primary.Stop() })
	standby, err := primary.StartStandby(ctx, pgcluster.Options{Port: 5433})
	require.NoError(t, err)
	t.Cleanup(func() { _ = standby.Stop() })
	url := pgcluster.ConnStringReadWrite("postgres", primary, standby)

	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	var port, syncState string
	require.NoError(t, conn.QueryRow(ctx, `SHOW port`).Scan(&port))
	require.Equal(t, "5432", port, "the read-write host is the primary")
	require.Eventually(t, func() bool {
		return conn.QueryRow(ctx, `SELECT sync_state FROM pg_stat_replication`).Scan(&syncState) == nil && syncState == "sync"
	}, 30*time.Second, 50*time.Millisecond, "the standby streams synchronously")
	_, err = conn.Exec(ctx, `CREATE TABLE t (v int); INSERT INTO t VALUES (1)`)
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))

	require.NoError(t, primary.Kill())
	_, err = pgx.Connect(ctx, url)
	require.Error(t, err, "no read-write server: the standby is not promoted yet")
	require.NoError(t, standby.Promote(ctx))

	conn, err = pgx.Connect(ctx, url)
	require.NoError(t, err)
	require.NoError(t, conn.QueryRow(ctx, `SHOW port`).Scan(&port))
	require.Equal(t, "5433", port, "the read-write host is the promoted standby")
	var n int
	require.NoError(t, conn.QueryRow(ctx, `INSERT INTO t VALUES (2) RETURNING (SELECT count(*) FROM t)`).Scan(&n))
	require.Equal(t, 1, n, "the row committed on the old primary is there")
	require.NoError(t, conn.Close(ctx))

	dirs := []string{primary.DataDir(), standby.DataDir()}
	require.NoError(t, primary.Stop())
	require.NoError(t, standby.Stop())
	for _, dir := range dirs {
		_, err = os.Stat(dir)
		require.True(t, os.IsNotExist(err), "the cluster's files are removed")
	}
}

// Kill leaves no process of the server behind, also while clients open
// connections as fast as they can (the postmaster forking a backend for
// each): a backend forked as the kill begins would outlive it and serve a
// client on a dead server. Every server process has the data directory as
// its working directory, which is how the survivors are looked for.
func TestKillLeavesNoProcessWhileConnectionsOpen(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("Kill needs Linux's /proc")
	}
	for range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		c, err := pgcluster.Start(ctx, pgcluster.Options{})
		if errors.Is(err, pgcluster.ErrNoBinaries) && os.Getenv("CI") == "" {
			cancel()
			t.Skip("PostgreSQL server binaries are not installed here; CI has them")
		}
		require.NoError(t, err)
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					if conn, err := pgx.Connect(ctx, c.ConnString("postgres")); err == nil {
						_ = conn.Close(ctx)
					}
				}
			})
		}
		time.Sleep(200 * time.Millisecond)
		require.NoError(t, c.Kill())
		close(stop)
		wg.Wait()
		data, err := filepath.EvalSymlinks(c.DataDir())
		require.NoError(t, err)
		cwds, _ := filepath.Glob("/proc/[0-9]*/cwd")
		for _, cwd := range cwds {
			if dir, err := os.Readlink(cwd); err == nil && dir == data {
				status, _ := os.ReadFile(filepath.Join(filepath.Dir(cwd), "status"))
				if !strings.Contains(string(status), "zombie") {
					t.Errorf("a server process survived Kill: %s", filepath.Dir(cwd))
				}
			}
		}
		require.NoError(t, c.Stop())
		cancel()
	}
}
