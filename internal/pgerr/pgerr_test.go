package pgerr

import (
	"context"
	"errors"
	"fmt"
	"testing"

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
