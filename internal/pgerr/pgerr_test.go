package pgerr

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

func TestClassifiesBySQLSTATE(t *testing.T) {
	t.Parallel()
	wrap := func(code string) error { return fmt.Errorf("op: %w", &pgconn.PgError{Code: code}) }
	require.True(t, IsRetryable(wrap(SerializationFailure)))
	require.True(t, IsRetryable(wrap(DeadlockDetected)))
	require.False(t, IsRetryable(wrap(UniqueViolation)))
	require.True(t, IsUniqueViolation(wrap(UniqueViolation)))
	require.True(t, IsLockNotAvailable(wrap(LockNotAvailable)))
	require.True(t, IsUndefinedTable(wrap(UndefinedTable)))
	require.True(t, IsConnection(wrap(AdminShutdown)))
	require.False(t, IsConnection(wrap(UniqueViolation)))
	require.False(t, IsConnection(context.Canceled))
	require.False(t, IsConnection(nil))
	require.Equal(t, "", Code(errors.New("plain")))
	require.True(t, IsInFailedTransaction(wrap(InFailedTransaction)))
	require.True(t, IsServerRejection(wrap(UniqueViolation)))
	require.False(t, IsServerRejection(wrap(AdminShutdown)), "the server went away: the outcome is unknown")
	require.False(t, IsServerRejection(context.DeadlineExceeded))
	require.False(t, IsServerRejection(errors.New("unexpected EOF")))
}

func TestIsUnavailableBySQLSTATE(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		code string
		want bool
	}{
		{AdminShutdown, true},          // the primary was shut down (failover, restart)
		{CrashShutdown, true},          // another backend crashed
		{CannotConnectNow, true},       // starting up, or promotion in progress
		{ReadOnlySQLTransaction, true}, // a demoted primary or a standby
		{"53300", true},                // too_many_connections
		{"53100", true},                // disk_full
		{"58030", true},                // io_error
		{SerializationFailure, false},  // retried as a transaction, not an outage
		{UniqueViolation, false},
		{"22P02", false},
		{"42501", false}, // insufficient_privilege: a configuration error
	} {
		err := fmt.Errorf("op: %w", &pgconn.PgError{Code: tc.code})
		require.Equal(t, tc.want, IsUnavailable(err), tc.code)
	}
	require.True(t, IsReadOnly(&pgconn.PgError{Code: ReadOnlySQLTransaction}))
	require.False(t, IsReadOnly(&pgconn.PgError{Code: AdminShutdown}))
	require.False(t, IsUnavailable(nil))
	require.False(t, IsUnavailable(context.Canceled))
	require.False(t, IsUnavailable(context.DeadlineExceeded))
	require.False(t, IsUnavailable(errors.New("plain")))
}

func TestConnectionRefusedIsUnavailable(t *testing.T) {
	t.Parallel()
	// A port nothing listens on: what clients see while a standby is being
	// promoted and the old primary is gone.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().(*net.TCPAddr)
	require.NoError(t, ln.Close())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgconn.Connect(ctx, fmt.Sprintf("postgres://nobody@127.0.0.1:%d/none?connect_timeout=5", addr.Port))
	if conn != nil {
		_ = conn.Close(ctx)
	}
	require.Error(t, err)
	require.True(t, IsUnavailable(err), "%v", err)
	require.True(t, IsConnection(err), "%v", err)
}

// A server killed mid-statement closes the connection under the driver,
// which reads io.EOF or io.ErrUnexpectedEOF, or the kernel resets it: all
// are the connection failing, and the database unavailable.
func TestConnectionClosedMidStatementIsUnavailable(t *testing.T) {
	t.Parallel()
	for _, err := range []error{io.EOF, io.ErrUnexpectedEOF,
		&net.OpError{Op: "read", Net: "unix", Err: syscall.ECONNRESET}} {
		wrapped := fmt.Errorf("insert key: %w", err)
		require.True(t, IsConnection(wrapped), "%v", err)
		require.True(t, IsUnavailable(wrapped), "%v", err)
		require.False(t, IsServerRejection(wrapped), "%v: it may have taken effect", err)
	}
}

// A server that accepts connections but does not answer within
// connect_timeout (a standby busy being promoted): pgx's connect error
// wraps its own context.DeadlineExceeded, yet the caller's context did not
// end. It is the database being unavailable.
func TestConnectTimeoutIsUnavailable(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close() // accepted, never answered
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	port := ln.Addr().(*net.TCPAddr).Port
	_, err = pgconn.Connect(ctx, fmt.Sprintf("postgres://nobody@127.0.0.1:%d/none?connect_timeout=1&sslmode=disable", port))
	require.Error(t, err)
	require.NoError(t, ctx.Err())
	require.True(t, IsConnection(err), "%v", err)
	require.True(t, IsUnavailable(err), "%v", err)

	// A caller that gave up is not told the database is unavailable.
	cctx, ccancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, ccancel)
	_, err = pgconn.Connect(cctx, fmt.Sprintf("postgres://nobody@127.0.0.1:%d/none?sslmode=disable", port))
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, IsUnavailable(err), "%v", err)
}
