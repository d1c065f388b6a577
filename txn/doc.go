// Package txn runs payment and order operations exactly once under
// idempotency keys, on PostgreSQL.
//
// An operation is a sequence of atomic phases. Each phase commits its
// business writes, any outbox messages and the key's new recovery point in
// one SERIALIZABLE transaction. A retry with the same key replays the stored
// response, or resumes after the last committed phase; nothing is done twice.
//
// Most endpoints need one phase: [Runner.Run] inserts the key, runs the
// function and stores its response in a single transaction. Work that calls
// a foreign system (a payment provider) is a registered [Workflow] of
// [Atomic] and [Foreign] phases ending in [Attempt.Finish], run with
// [Runner.RunWorkflow] and resumed after a crash by [Runner.Resume] (which
// the recovery package calls for stalled keys). A workflow's first attempt
// inserts its key with its first commit and records a foreign call's
// result with the next one, so Atomic, Foreign and Finish commit twice.
//
// A running attempt holds the key's lease, a token with an expiry judged by
// the database clock; every phase commit checks the token (fencing), so an
// attempt that lost its lease to a retry or to recovery commits nothing and
// gets [ErrLeaseLost]. No attempt takes over a key older than
// [Config.MaxAge], and no foreign call is made for one: a foreign call is
// never repeated more than MaxAge after the key was created.
//
// Functions that receive a transaction may run more than once (after a
// serialization failure, even one they swallowed); only one run commits, so
// calls to other systems belong in a Foreign phase. They cannot commit or
// roll back the transaction themselves. Params and phase results are stored
// as the exact bytes the library produced, so every resume sees them byte
// for byte.
//
// Errors are sentinels in errors.go, matched with errors.Is; [HTTPStatus]
// maps them to the status an API should answer.
package txn
