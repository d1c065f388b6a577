package txn_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

// tryEnd calls Commit and Rollback on the transaction handed to user code,
// which must refuse both, then writes through it as usual.
func tryEnd(ctx context.Context, t *testing.T, tx pgx.Tx, ref string) {
	require.ErrorIs(t, tx.Commit(ctx), txn.ErrInvalidUse)
	require.ErrorIs(t, tx.Rollback(ctx), txn.ErrInvalidUse)
	// A savepoint (pseudo nested transaction) is the user's to end.
	sp, err := tx.Begin(ctx)
	require.NoError(t, err)
	_, err = sp.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('rolled-back', 1)`)
	require.NoError(t, err)
	require.NoError(t, sp.Rollback(ctx))
	_, err = tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, 1)`, ref)
	require.NoError(t, err)
}

// User code cannot end the transaction it was given, on every entry point
// that hands one to it.
func TestUserCodeCannotCommitOrRollBackItsTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)

	resp, err := e.runner.Run(ctx, chargeKey("single", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		tryEnd(ctx, t, tx, "single")
		return txn.JSON(201, "single")
	})
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	k := readKey(t, e.Pool, "acct_1", "single")
	require.Equal(t, 201, *k.RespStatus, "the response is stored")
	require.Equal(t, `"single"`, string(k.RespBody))

	wf := txn.NewWorkflow("ends_its_tx", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		if _, err := txn.Atomic(ctx, a, "one", func(ctx context.Context, tx pgx.Tx) (int, error) {
			tryEnd(ctx, t, tx, "atomic")
			return 1, nil
		}); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			tryEnd(ctx, t, tx, "finish")
			return txn.JSON(201, "workflow")
		})
	})
	require.NoError(t, e.reg.Register(wf))
	resp, err = e.runner.RunWorkflow(ctx, rideKey("wf"), wf)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, "finished", readKey(t, e.Pool, "user_1", "wf").Status)
	require.Equal(t, 3, e.Count(t, `SELECT count(*) FROM charges`))
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'rolled-back'`))

	// Ending the transaction through SQL is refused after the fact, and
	// nothing is stored for the run: its transaction did not commit.
	_, err = e.runner.Run(ctx, chargeKey("sql-commit", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		_, err := tx.Exec(ctx, `ROLLBACK`)
		return txn.Response{Status: 201}, err
	})
	require.ErrorIs(t, err, txn.ErrInvalidUse)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'sql-commit'`))
}

// injectSerializationFailure raises a real 40001 from PostgreSQL the first
// `times` calls of the test (a sequence survives the rollbacks).
func injectSerializationFailure(t *testing.T, e *env, times int) string {
	t.Helper()
	_, err := e.Pool.Exec(context.Background(), `
		CREATE SEQUENCE injected_failures;
		CREATE FUNCTION maybe_fail(times int) RETURNS void LANGUAGE plpgsql AS $$
		BEGIN
			IF nextval('injected_failures') <= times THEN
				RAISE EXCEPTION 'injected serialization failure' USING ERRCODE = '40001';
			END IF;
		END $$`)
	require.NoError(t, err)
	return fmt.Sprintf(`SELECT maybe_fail(%d)`, times)
}

// A serialization failure met by user code is retried even
// when the code swallowed it and answered, and never becomes a stored
// response; on Run, Atomic and Finish.
func TestSerializationFailureSwallowedByUserCodeIsRetriedNeverStored(t *testing.T) {
	t.Parallel()
	for _, entry := range []string{"run", "atomic", "finish"} {
		t.Run(entry, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, &txn.Config{RetryBaseDelay: 1})
			ctx := ctxT(t)
			fail := injectSerializationFailure(t, e, 2)
			var runs atomic.Int64
			// The body swallows the statement's error and answers 500, as a
			// handler that writes its own error page would.
			body := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				runs.Add(1)
				if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('c', 1)`); err != nil {
					return txn.Response{}, err
				}
				rows, err := tx.Query(ctx, fail)
				if err == nil {
					for rows.Next() {
					}
					err = rows.Err()
				}
				if err != nil {
					return txn.Response{Status: 500, Body: []byte("storage failed")}, nil
				}
				return txn.JSON(201, rows.CommandTag().String())
			}
			var resp txn.Response
			var err error
			switch entry {
			case "run":
				resp, err = e.runner.Run(ctx, chargeKey("k", 1), body)
			default:
				wf := txn.NewWorkflow(entry, func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
					if entry == "atomic" {
						if _, err := txn.Atomic(ctx, a, "p", func(ctx context.Context, tx pgx.Tx) (int, error) {
							resp, err := body(ctx, tx)
							return resp.Status, err
						}); err != nil {
							return txn.Response{}, err
						}
						return txn.JSON(201, "after atomic")
					}
					return a.Finish(ctx, body)
				})
				require.NoError(t, e.reg.Register(wf))
				resp, err = e.runner.RunWorkflow(ctx, rideKey("k"), wf)
			}
			require.NoError(t, err)
			require.Equal(t, 201, resp.Status, string(resp.Body))
			require.Equal(t, int64(3), runs.Load(), "two rolled-back runs, then the one that committed")
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`), "one run's writes")
			require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE response_status = 500`))
			require.Equal(t, uint64(2), e.runner.Stats().Retries)
		})
	}
}

// A persistent serialization failure that user code swallows ends in
// ErrConflict after the retries, still nothing stored.
func TestSwallowedSerializationFailureThatPersistsIsConflictNotStored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, &txn.Config{MaxRetries: 2, RetryBaseDelay: 1})
	ctx := ctxT(t)
	fail := injectSerializationFailure(t, e, 9)
	_, err := e.runner.Run(ctx, chargeKey("k", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		_ = tx.QueryRow(ctx, fail).Scan() // swallowed
		return txn.Response{Status: 500}, nil
	})
	require.ErrorIs(t, err, txn.ErrConflict)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

// A statement error user code swallows aborts the transaction; the error
// returned is that statement's, not "current transaction is aborted".
func TestSwallowedStatementErrorIsReportedInsteadOfAbortedTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	swallow := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		_, _ = tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('c', 1/0)`)
		return txn.JSON(201, "ok")
	}
	_, err := e.runner.Run(ctx, chargeKey("k", 1), swallow)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "%v", err)
	require.Equal(t, "22012", pgErr.Code, "division by zero, the statement that failed")
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`))

	wf := txn.NewWorkflow("swallows", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		return a.Finish(ctx, swallow)
	})
	require.NoError(t, e.reg.Register(wf))
	_, err = e.runner.RunWorkflow(ctx, rideKey("w"), wf)
	require.True(t, errors.As(err, &pgErr), "%v", err)
	require.Equal(t, "22012", pgErr.Code)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`), "nothing stored: the key went with the final phase")
}

// A function that ends its transaction through SQL (COMMIT sent as a
// statement) has committed what it wrote before, without its result. The
// library cannot undo that, so it makes sure nothing more happens: the
// function's next statement fails instead of running on its own
// (autocommit), and the key is failed with a stored 500 that says why,
// so that no retry runs the operation's writes a second time. On every
// entry point that hands user code a transaction, in both exec modes
// that send a first statement with BEGIN.
func TestFunctionEndingItsTransactionThroughSQLFailsTheKeyAndRunsNothingMore(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeCacheStatement} {
		for _, entry := range []string{"run", "first_phase", "second_phase", "finish"} {
			for _, first := range []bool{true, false} { // COMMIT as the function's first statement, or after a write
				t.Run(fmt.Sprintf("%s/%s/first=%v", mode, entry, first), func(t *testing.T) {
					t.Parallel()
					e := newEnv(t, nil)
					ctx := ctxT(t)
					r, _ := e.countingRunnerIn(t, nil, mode)
					var calls atomic.Int64
					var afterErr error
					body := func(ctx context.Context, tx pgx.Tx) error {
						calls.Add(1)
						if !first {
							if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('before', 1)`); err != nil {
								return err
							}
						}
						if _, err := tx.Exec(ctx, `COMMIT`); err != nil {
							return err
						}
						_, afterErr = tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('after', 1)`)
						return nil // as a function that ignores the error would
					}
					wf := endingFlow(t, e, entry, body)
					run, scope := entryRun(ctx, r, entry, wf, body)
					_, err := run()
					require.ErrorIs(t, err, txn.ErrInvalidUse)
					require.ErrorContains(t, err, "ended the transaction")
					require.Error(t, afterErr, "the statement after the COMMIT did not run on its own")
					require.Zero(t, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'after'`))
					if !first {
						require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'before'`), "committed by the function's COMMIT")
					}
					k := readKey(t, e.Pool, scope, "k1")
					require.Equal(t, "failed", k.Status)
					require.False(t, k.LeaseHeld)
					require.Equal(t, "ended_by_function", e.failureReason(t, "k1"))
					require.Equal(t, 500, *k.RespStatus)
					require.Contains(t, string(k.RespBody), "ended its database transaction")

					// A retry replays the failure: the operation does not run again.
					resp, err := run()
					require.NoError(t, err)
					require.True(t, resp.Replayed)
					require.Equal(t, 500, resp.Status)
					require.Equal(t, int64(1), calls.Load())
				})
			}
		}
	}
}

// A function that keeps its tx and uses it after its Run ended writes
// nothing: whatever the Run's end (stored, not stored, the function's error,
// a failed statement; a workflow's first phase the same), the transaction is
// over and its tx says so (pgx.ErrTxClosed), where a statement would
// otherwise run on its own, outside any transaction, on a connection back
// in the pool, and commit without the key.
func TestTxKeptByTheFunctionIsClosedAfterTheRun(t *testing.T) {
	t.Parallel()
	const insert = `INSERT INTO charges (ref, amount) VALUES ($1, 1)`
	ends := map[string]func(ctx context.Context, tx pgx.Tx) (txn.Response, error){
		"stored": func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			_, err := tx.Exec(ctx, insert, "in_fn")
			return txn.Response{Status: 201}, err
		},
		"unstored_response": func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			_, err := tx.Exec(ctx, insert, "in_fn")
			return txn.Response{Status: 422}, err
		},
		"function_error": func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, insert, "in_fn"); err != nil {
				return txn.Response{}, err
			}
			return txn.Response{}, errInjected
		},
		"failed_statement": func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			_, err := tx.Exec(ctx, insert, nil)
			return txn.Response{}, err
		},
		"no_statement": func(context.Context, pgx.Tx) (txn.Response, error) {
			return txn.Response{}, errInjected
		},
	}
	for name, end := range ends {
		for _, entry := range []string{"run", "workflow_first_phase"} {
			t.Run(name+"/"+entry, func(t *testing.T) {
				t.Parallel()
				e := newEnv(t, nil)
				ctx := ctxT(t)
				var kept pgx.Tx
				keep := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
					kept = tx
					return end(ctx, tx)
				}
				if entry == "run" {
					_, _ = e.runner.Run(ctx, chargeKey("k1", 1), keep)
				} else {
					wf := txn.NewWorkflow("kept", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
						resp, err := txn.Atomic(ctx, a, "first", func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
							return keep(ctx, tx)
						})
						if err != nil {
							return txn.Response{}, err
						}
						return a.Finish(ctx, func(context.Context, pgx.Tx) (txn.Response, error) { return resp, nil })
					})
					require.NoError(t, e.reg.Register(wf))
					_, _ = e.runner.RunWorkflow(ctx, rideKey("k1"), wf)
				}
				require.NotNil(t, kept)
				_, err := kept.Exec(ctx, insert, "after_return")
				require.ErrorIs(t, err, pgx.ErrTxClosed)
				require.Zero(t, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'after_return'`))
			})
		}
	}
}
