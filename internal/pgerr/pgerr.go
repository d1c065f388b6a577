// Package pgerr interprets PostgreSQL and driver errors by SQLSTATE code, in
// one place, so that no package matches on error strings.
package pgerr

import (
	"context"
	"errors"
	"io"
	"net"

	"github.com/jackc/pgx/v5/pgconn"
)

// SQLSTATE codes atomicphase reacts to.
const (
	SerializationFailure = "40001"
	DeadlockDetected     = "40P01"
	UniqueViolation      = "23505"
	LockNotAvailable     = "55P03"
	QueryCanceled        = "57014"
	AdminShutdown        = "57P01"
	CrashShutdown        = "57P02"
	CannotConnectNow     = "57P03"
	UndefinedTable       = "42P01"
	DivisionByZero       = "22012"
	InFailedTransaction  = "25P02"
	DuplicateTable       = "42P07"
	DuplicateObject      = "42710"
	DuplicateFunction    = "42723"
	// ReadOnlySQLTransaction is what a demoted primary or a standby answers
	// to a write: after a failover, a client can still reach the old node.
	ReadOnlySQLTransaction = "25006"
	// DataLossRefused is raised by atomicphase_refuse_data_loss (migration
	// 00003) when a down migration would delete rows without the opt-in.
	DataLossRefused = "AP001"
	// KeyExpired is raised by atomicphase_refuse_tombstoned (migration
	// 00009) when a key insert meets a live tombstone: the key belonged to
	// an operation that finished and was cleaned up.
	KeyExpired = "AP002"
)

// Code returns the SQLSTATE of err, or "" when err carries none.
func Code(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// IsRetryable reports whether the transaction that failed with err can be
// retried as it is: a serialization failure or a detected deadlock.
func IsRetryable(err error) bool {
	switch Code(err) {
	case SerializationFailure, DeadlockDetected:
		return true
	}
	return false
}

// IsInFailedTransaction reports a statement refused because an earlier
// statement of its transaction failed and the transaction is aborted.
func IsInFailedTransaction(err error) bool { return Code(err) == InFailedTransaction }

// IsServerRejection reports an error the server returned for a statement it
// refused: a statement that failed this way did not take effect. It is
// false for errors of the connection, of the context, and for anything the
// server did not answer, after which a statement (or its implicit
// transaction's commit) may have taken effect unseen.
func IsServerRejection(err error) bool {
	return Code(err) != "" && !IsConnection(err)
}

// IsKeyExpired reports a key insert refused because the key has a live
// tombstone (KeyExpired).
func IsKeyExpired(err error) bool { return Code(err) == KeyExpired }

// IsUniqueViolation reports a unique-constraint violation.
func IsUniqueViolation(err error) bool { return Code(err) == UniqueViolation }

// KeyIDConstraint is the primary key of idempotency_keys, on the id the
// key lookup allots with nextval.
const KeyIDConstraint = "idempotency_keys_pkey"

// IsKeyIDTaken reports a key inserted with an id another key has. The id
// is allotted by the lookup's nextval, which no commit waits for, so after
// a failover the new primary's sequence may stand behind ids handed out by
// the old one and already inserted: the insert is to be retried with a new
// lookup, which allots another id.
func IsKeyIDTaken(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == UniqueViolation && pgErr.ConstraintName == KeyIDConstraint
}

// KeyConstraint is the unique constraint of idempotency_keys on (scope,
// key).
const KeyConstraint = "idempotency_keys_scope_key_uniq"

// IsKeyTaken reports a key inserted under a (scope, key) that another
// key, committed since the inserting transaction looked, already has.
func IsKeyTaken(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == UniqueViolation && pgErr.ConstraintName == KeyConstraint
}

// IsLockNotAvailable reports a lock that could not be taken without waiting
// (NOWAIT or lock_timeout).
func IsLockNotAvailable(err error) bool { return Code(err) == LockNotAvailable }

// IsUndefinedTable reports a missing table, as when migrations were not run.
func IsUndefinedTable(err error) bool { return Code(err) == UndefinedTable }

// ErrConnectionLost says that a connection was found closed, where no
// driver error said why (a caller swallowed it). IsConnection reports it.
var ErrConnectionLost = errors.New("the connection to the database was lost")

// IsConnection reports an error of the connection rather than of a statement:
// the server went away, the network failed, or the server is shutting down.
// Whether a COMMIT sent just before such an error took effect is unknown.
func IsConnection(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	if errors.Is(err, ErrConnectionLost) {
		return true
	}
	// A connection that could not be made, also when connect_timeout
	// expired (pgx wraps its own context.DeadlineExceeded then): a server
	// that does not answer, such as a standby being promoted.
	var connErr *pgconn.ConnectError
	if errors.As(err, &connErr) {
		return true
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	switch Code(err) {
	case AdminShutdown, CrashShutdown, CannotConnectNow:
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	// The driver reads io.EOF or io.ErrUnexpectedEOF when the server closed
	// the connection under it, as a killed server does mid-statement.
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	return pgconn.SafeToRetry(err) || pgconn.Timeout(err)
}

// IsReadOnly reports a write refused because the server accepts only reads:
// a hot standby, or a primary demoted by a failover that a client reached
// through a stale connection or DNS entry.
func IsReadOnly(err error) bool { return Code(err) == ReadOnlySQLTransaction }

// IsUnavailable reports that the database cannot serve the request now but
// may soon: the connection failed or was refused, the server is starting or
// shutting down (class 57P), it lacks resources such as connection slots
// (class 53), it reports a system or I/O error (class 58), or it accepts only
// reads (a failover in progress), or a key's id was already taken (after a
// failover: see IsKeyIDTaken). Callers retry later rather than treat the
// operation as failed; whether a COMMIT sent just before a connection error
// took effect is still unknown (see IsConnection).
func IsUnavailable(err error) bool {
	if IsConnection(err) {
		return true
	}
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	if IsReadOnly(err) || IsKeyIDTaken(err) {
		return true
	}
	code := Code(err)
	return len(code) == 5 && (code[:2] == "53" || code[:2] == "58")
}
