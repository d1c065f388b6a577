package txn_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/phasectx"
	"github.com/atomicphase/atomicphase/txn"
)

// Whatever a function's first statement is, the key's insert goes out
// before it in the same transaction: the function knows its key's id
// from the start (outbox messages record it), its writes commit with the
// key, and the statements that can travel with BEGIN do, so the run costs
// 3 round trips (in the exec mode); the others cost one more.
func TestEveryKindOfFirstStatementTakesTheKey(t *testing.T) {
	t.Parallel()
	insert := `INSERT INTO charges (ref, amount) VALUES ($1, 1)`
	cases := []struct {
		name       string
		first      func(ctx context.Context, tx pgx.Tx, ref string) error
		roundTrips int64
	}{
		{"exec", func(ctx context.Context, tx pgx.Tx, ref string) error {
			_, err := tx.Exec(ctx, insert, ref)
			return err
		}, 3},
		{"query_row", func(ctx context.Context, tx pgx.Tx, ref string) error {
			var id int64
			return tx.QueryRow(ctx, insert+` RETURNING id`, ref).Scan(&id)
		}, 3},
		{"query", func(ctx context.Context, tx pgx.Tx, ref string) error {
			rows, err := tx.Query(ctx, insert+` RETURNING id`, ref)
			if err != nil {
				return err
			}
			ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err == nil && len(ids) != 1 {
				err = fmt.Errorf("%d rows", len(ids))
			}
			return err
		}, 3},
		{"named_args", func(ctx context.Context, tx pgx.Tx, ref string) error {
			_, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES (@ref, 1)`, pgx.NamedArgs{"ref": ref})
			return err
		}, 3},
		{"exec_without_args", func(ctx context.Context, tx pgx.Tx, ref string) error {
			// Two statements in one string: pgx sends it over the simple
			// protocol, so it cannot travel with BEGIN.
			_, err := tx.Exec(ctx, fmt.Sprintf(`SELECT 1; INSERT INTO charges (ref, amount) VALUES ('%s', 1)`, ref))
			return err
		}, 4},
		{"exec_mode_option", func(ctx context.Context, tx pgx.Tx, ref string) error {
			_, err := tx.Exec(ctx, insert, pgx.QueryExecModeSimpleProtocol, ref)
			return err
		}, 4},
		{"send_batch", func(ctx context.Context, tx pgx.Tx, ref string) error {
			b := &pgx.Batch{}
			b.Queue(insert, ref)
			return tx.SendBatch(ctx, b).Close()
		}, 4},
		{"copy_from", func(ctx context.Context, tx pgx.Tx, ref string) error {
			_, err := tx.CopyFrom(ctx, pgx.Identifier{"charges"}, []string{"ref", "amount"},
				pgx.CopyFromRows([][]any{{ref, int64(1)}}))
			return err
		}, 3}, // 4: the counter does not see COPY
		{"conn", func(ctx context.Context, tx pgx.Tx, ref string) error {
			_, err := tx.Conn().Exec(ctx, insert, ref)
			return err
		}, 4},
		{"savepoint", func(ctx context.Context, tx pgx.Tx, ref string) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := sp.Exec(ctx, insert, ref); err != nil {
				return err
			}
			return sp.Commit(ctx)
		}, 6},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			// The exec mode, in which a statement can travel with BEGIN
			// (see TestFirstStatementTravelsOnlyInModesThatPrepareNothing).
			r, qc := e.countingRunnerIn(t, nil, pgx.QueryExecModeExec)
			var keyID int64
			before := qc.n.Load()
			resp, err := r.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				id, ok := phasectx.KeyID(ctx)
				if !ok {
					return txn.Response{}, fmt.Errorf("no key id")
				}
				keyID = id
				if err := c.first(ctx, tx, "c1"); err != nil {
					return txn.Response{}, err
				}
				var isolation string
				if err := tx.QueryRow(ctx, `SHOW transaction_isolation`).Scan(&isolation); err != nil {
					return txn.Response{}, err
				}
				return txn.JSON(201, map[string]string{"isolation": isolation})
			})
			require.NoError(t, err)
			require.Equal(t, 201, resp.Status)
			require.JSONEq(t, `{"isolation":"serializable"}`, string(resp.Body))
			require.Equal(t, c.roundTrips+1, qc.n.Load()-before, "round trips, with the SHOW")
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'c1'`))
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM idempotency_keys WHERE id = $1 AND key = 'k1' AND response_status = 201`, keyID),
				"the key was inserted with the id the function was given")

			again, err := r.Run(ctx, chargeKey("k1", 1), func(context.Context, pgx.Tx) (txn.Response, error) {
				return txn.Response{}, fmt.Errorf("ran again")
			})
			require.NoError(t, err)
			require.True(t, again.Replayed)
		})
	}
}

// A function that makes no statement still takes the key, when it returns.
func TestFunctionWithoutStatementsStillTakesTheKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	resp, err := e.runner.Run(ctx, chargeKey("k1", 1), func(context.Context, pgx.Tx) (txn.Response, error) {
		return txn.Response{Status: 204}, nil
	})
	require.NoError(t, err)
	require.Equal(t, 204, resp.Status)
	require.Equal(t, 204, *readKey(t, e.Pool, "acct_1", "k1").RespStatus)
}

// A first statement whose context was already done sends nothing, so no
// transaction began. The connection the function can still reach through
// tx.Conn() must not run statements outside the key's transaction: a write
// there would commit without the key, and a retry would write it again.
func TestConnAfterAFailedStartWritesNothingWithoutTheKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var connErr error
	_, err := e.runner.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		done, cancel := context.WithCancel(ctx)
		cancel()
		_, ferr := tx.Exec(done, `INSERT INTO charges (ref, amount) VALUES ($1, 1)`, "c0")
		require.Error(t, ferr)
		_, connErr = tx.Conn().Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, 1)`, "c1")
		return txn.Response{Status: 201}, nil
	})
	require.Error(t, err)
	require.Error(t, connErr, "the connection refuses statements outside the transaction")
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges`), "nothing committed without the key")
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

// In the exec modes that prepare a statement pgx has not cached yet, pgx
// sends that prepare in a round trip of its own, before anything else of
// the batch: before BEGIN and the key's insert. Preparing takes the
// statement's table locks, so a first statement that travelled with BEGIN
// would wait behind a holder's table lock instead of its key insert being
// refused at once (rule 4). In those modes BEGIN and the key insert go
// first (unless the Run prepared the statement on that connection before:
// TestPreparedFirstStatementStillLosesTheKeyAtOnce); in every mode the
// twin gets ErrKeyInUse at once.
func TestFirstStatementTravelsOnlyInModesThatPrepareNothing(t *testing.T) {
	t.Parallel()
	for _, mode := range allExecModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			r, _ := e.countingRunnerIn(t, nil, mode)
			release := holdKeyWithTableLock(ctx, t, e, chargeKey("k1", 1))
			short, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			var calls atomic.Int64
			_, err := r.Run(short, chargeKey("k1", 1), insertCharge(&calls, "twin", 1))
			require.ErrorIs(t, err, txn.ErrKeyInUse, "at once, not after a wait on the holder's table lock")
			require.NoError(t, release())
			require.Zero(t, e.Count(t, `SELECT count(*) FROM charges`))
		})
	}
}

// pgx.NamedArgs without any argument left after the rewrite make pgx send
// the statement over the simple protocol, where one string may hold
// several statements; such a statement does not travel with BEGIN either.
func TestNamedArgsRewrittenToNoArgumentsRunAsPlainPgx(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, _ := e.countingRunnerIn(t, nil, pgx.QueryExecModeExec)
	resp, err := r.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		_, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('a', 1); INSERT INTO charges (ref, amount) VALUES ('b', 1)`, pgx.NamedArgs{})
		if err != nil {
			return txn.Response{}, err
		}
		return txn.Response{Status: 201}, nil
	})
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, 2, e.Count(t, `SELECT count(*) FROM charges`))
}

// An argument pgx cannot encode fails the first statement before anything
// reaches the server, as it fails a statement on any pgx.Tx, which stays
// usable: the function's next statement takes the key, and the run
// commits what the function wrote.
func TestFirstStatementThatCannotBeEncodedLeavesTheTransactionUsable(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			r, _ := e.countingRunnerIn(t, nil, mode)
			var encodeErr error
			resp, err := r.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				_, encodeErr = tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, 1)`, make(chan int))
				if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, 1)`, "c1"); err != nil {
					return txn.Response{}, err
				}
				return txn.Response{Status: 201}, nil
			})
			require.Error(t, encodeErr)
			require.NoError(t, err)
			require.Equal(t, 201, resp.Status)
			require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges`))
			require.Equal(t, 201, *readKey(t, e.Pool, "acct_1", "k1").RespStatus)
		})
	}
}

// A function that returns with its Rows open, or its Row not scanned,
// leaves a result unread: nothing is stored, and the error says why,
// whether the statement travelled with BEGIN or came later.
func TestFunctionReturningWithUnreadResultsStoresNothing(t *testing.T) {
	t.Parallel()
	unread := map[string]func(ctx context.Context, tx pgx.Tx) error{
		"rows not closed": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Query(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, 1) RETURNING id`, "c1")
			return err
		},
		"row not scanned": func(ctx context.Context, tx pgx.Tx) error {
			_ = tx.QueryRow(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, 1) RETURNING id`, "c1")
			return nil
		},
	}
	for name, leave := range unread {
		for _, first := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/first=%v", name, first), func(t *testing.T) {
				t.Parallel()
				e := newEnv(t, nil)
				ctx := ctxT(t)
				r, _ := e.countingRunnerIn(t, nil, pgx.QueryExecModeExec)
				_, err := r.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
					if !first {
						if err := takeKey(ctx, tx); err != nil {
							return txn.Response{}, err
						}
					}
					if err := leave(ctx, tx); err != nil {
						return txn.Response{}, err
					}
					return txn.Response{Status: 201}, nil
				})
				require.ErrorIs(t, err, txn.ErrInvalidUse)
				require.ErrorContains(t, err, "not closed or a Row not scanned")
				require.Zero(t, e.Count(t, `SELECT count(*) FROM charges`))
				require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
			})
		}
	}
}

// pgx reads its options from the front of the arguments in any order: an
// exec mode after pgx.NamedArgs still chooses the protocol, here the simple
// one, in which one string may hold several statements.
func TestExecModeAfterNamedArgsIsHonoured(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, _ := e.countingRunnerIn(t, nil, pgx.QueryExecModeExec)
	resp, err := r.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		_, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES (@ref, 1); INSERT INTO charges (ref, amount) VALUES ('b', 1)`,
			pgx.NamedArgs{"ref": "a"}, pgx.QueryExecModeSimpleProtocol)
		if err != nil {
			return txn.Response{}, err
		}
		return txn.Response{Status: 201}, nil
	})
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, 2, e.Count(t, `SELECT count(*) FROM charges`))
}

// In the simple protocol pgx joins a batch into one string, so a first
// statement there starts the transaction on its own and means what it
// means on a plain pgx.Tx of the same pool: a prepared statement run by
// its name, the last command tag of a multi-statement string, a query that
// is only a comment.
func TestFirstStatementInTheSimpleProtocolRunsAsOnAPlainTx(t *testing.T) {
	t.Parallel()
	cases := map[string]func(ctx context.Context, tx pgx.Tx) (string, error){
		"prepared statement by name": func(ctx context.Context, tx pgx.Tx) (string, error) {
			tag, err := tx.Exec(ctx, "ins_charge", "c1")
			return tag.String(), err
		},
		"multi-statement command tag": func(ctx context.Context, tx pgx.Tx) (string, error) {
			tag, err := tx.Exec(ctx, `SELECT $1::int; INSERT INTO charges (ref, amount) VALUES ('c1', 1)`, 1)
			return tag.String(), err
		},
		"comment-only query": func(ctx context.Context, tx pgx.Tx) (string, error) {
			rows, err := tx.Query(ctx, `-- nothing`)
			if err != nil {
				return "", err
			}
			rows.Close()
			return rows.CommandTag().String(), rows.Err()
		},
	}
	for name, stmt := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			ctx := ctxT(t)
			pool := e.NewPool(t, func(c *pgxpool.Config) {
				c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
				c.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
					_, err := conn.Prepare(ctx, "ins_charge", `INSERT INTO charges (ref, amount) VALUES ($1, 1)`)
					return err
				}
			})
			plain, err := pool.Begin(ctx)
			require.NoError(t, err)
			want, err := stmt(ctx, plain)
			require.NoError(t, err, "on a plain pgx.Tx")
			require.NoError(t, plain.Rollback(ctx))

			r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
			require.NoError(t, err)
			var got string
			_, err = r.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				var serr error
				got, serr = stmt(ctx, tx)
				return txn.Response{Status: 201}, serr
			})
			require.NoError(t, err)
			require.Equal(t, want, got)

			// A workflow phase on a stored key: its first statement goes out
			// with BEGIN in the other modes; here it must not either.
			got = ""
			wf := txn.NewWorkflow("simple_"+strings.ReplaceAll(name, " ", "_"), func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
				if _, err := txn.Atomic(ctx, a, "first", func(ctx context.Context, tx pgx.Tx) (int, error) {
					_, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ('first', 1)`)
					return 0, err
				}); err != nil {
					return txn.Response{}, err
				}
				return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
					var serr error
					got, serr = stmt(ctx, tx)
					return txn.Response{Status: 201}, serr
				})
			})
			require.NoError(t, e.reg.Register(wf))
			_, err = r.RunWorkflow(ctx, rideKey("w1"), wf)
			require.NoError(t, err)
			require.Equal(t, want, got, "in a workflow phase on a stored key")
		})
	}
}

// A connection lost during the batch that carries the first statement
// (here the statement ends its own backend) is an outage, however the
// function took the statement's error: not a function that ended the
// transaction itself.
func TestConnectionLostWithTheFirstStatementIsUnavailable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, _ := e.countingRunnerIn(t, nil, pgx.QueryExecModeExec)
	_, err := r.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		_, ferr := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid()) WHERE $1::int = 1`, 1)
		require.Error(t, ferr)
		return txn.Response{Status: 201}, nil // the error swallowed
	})
	require.ErrorIs(t, err, txn.ErrUnavailable)
	require.NotErrorIs(t, err, txn.ErrInvalidUse)
	require.Zero(t, e.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

// A pool's BeforeConnect may give each connection its own exec mode; the
// connection's mode, not the pool's, decides whether a statement travels
// with BEGIN, so a twin still gets ErrKeyInUse at once.
func TestExecModeSetPerConnectionIsHonoured(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	pool := e.NewPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
		c.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
			cc.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
			return nil
		}
	})
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	release := holdKeyWithTableLock(ctx, t, e, chargeKey("k1", 1))
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	var calls atomic.Int64
	_, err = r.Run(short, chargeKey("k1", 1), insertCharge(&calls, "twin", 1))
	require.ErrorIs(t, err, txn.ErrKeyInUse, "at once, not after a wait on the holder's table lock")
	require.NoError(t, release())
}
