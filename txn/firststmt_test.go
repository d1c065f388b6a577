package txn_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

// prepareCounter is a queryCounter that also counts prepares sent.
type prepareCounter struct {
	queryCounter
	prepares atomic.Int64
}

func (c *prepareCounter) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return ctx
}

// TracePrepareEnd counts the prepares that went to the server: not those
// pgx answered from its record (AlreadyPrepared), nor those on a context
// already done, which send nothing (see the txn package's stillPrepared).
func (c *prepareCounter) TracePrepareEnd(_ context.Context, _ *pgx.Conn, data pgx.TracePrepareEndData) {
	if !data.AlreadyPrepared && !errors.Is(data.Err, context.Canceled) {
		c.prepares.Add(1)
	}
}

// oneConnRunner returns a runner on a pool of one connection in pgx's
// default mode (cache_statement), counting round trips and prepares.
func (e *env) oneConnRunner(t *testing.T, configure func(*pgxpool.Config)) (*txn.Runner, *prepareCounter) {
	t.Helper()
	pc := &prepareCounter{}
	pool := e.NewPool(t, func(c *pgxpool.Config) {
		c.MaxConns = 1
		c.ConnConfig.Tracer = pc
		c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
		if configure != nil {
			configure(c)
		}
	})
	r, err := txn.New(pool, &txn.Config{Workflows: e.reg})
	require.NoError(t, err)
	return r, pc
}

// roundTrips runs run and returns the round trips and prepares it made.
func (c *prepareCounter) roundTrips(run func()) (int64, int64) {
	n, p := c.n.Load(), c.prepares.Load()
	run()
	return c.n.Load() - n, c.prepares.Load() - p
}

// In pgx's default mode a Run prepares its function's first statement
// itself, after the key is taken (4 round trips and the prepare, as pgx
// would pay to prepare it); the next Run on the connection whose first
// statement is the same sends it with BEGIN and the key: 3 round trips, as
// in the exec mode, and no prepare.
func TestFirstStatementPreparedByOneRunTravelsWithBeginInTheNext(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, pc := e.oneConnRunner(t, nil)
	var calls atomic.Int64
	var prepared int
	fn := func(ref string) txn.Func {
		return func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount) VALUES ($1, 1)`, ref); err != nil {
				return txn.Response{}, err
			}
			calls.Add(1)
			// Read with QueryExecModeExec: it neither travels nor prepares.
			err := tx.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE $1`,
				pgx.QueryExecModeExec, "%-- atomicphase: first statement").Scan(&prepared)
			return txn.Response{Status: 201}, err
		}
	}
	// Warm the connection's statement cache with the Run's own statements.
	_, err := r.Run(ctx, chargeKey("k0", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		return txn.Response{Status: 201}, takeKey(ctx, tx)
	})
	require.NoError(t, err)

	rt, prepares := pc.roundTrips(func() {
		_, err := r.Run(ctx, chargeKey("k1", 1), fn("c1"))
		require.NoError(t, err)
	})
	require.Equal(t, int64(5), rt, "the read, BEGIN with the key, the statement, the count, the response with COMMIT")
	require.Equal(t, int64(1), prepares, "the first statement, after the key")
	require.Equal(t, 1, prepared)

	rt, prepares = pc.roundTrips(func() {
		_, err := r.Run(ctx, chargeKey("k2", 1), fn("c2"))
		require.NoError(t, err)
	})
	require.Equal(t, int64(4), rt, "the read, BEGIN with the key and the statement, the count, the response with COMMIT")
	require.Zero(t, prepares)
	require.Equal(t, 1, prepared)

	require.Equal(t, int64(2), calls.Load())
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'c1'`))
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'c2'`))
	require.Equal(t, 201, *readKey(t, e.Pool, "acct_1", "k2").RespStatus)
}

// Rule 4 with a first statement that travels with BEGIN in pgx's default
// mode: the key's insert still fails before the statement runs, so a twin
// gets ErrKeyInUse at once, not after a wait on its holder's table lock.
func TestPreparedFirstStatementStillLosesTheKeyAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, pc := e.oneConnRunner(t, nil)
	var calls atomic.Int64
	_, err := r.Run(ctx, chargeKey("k0", 1), insertCharge(&calls, "warm", 1))
	require.NoError(t, err)
	_, err = r.Run(ctx, chargeKey("k0b", 1), insertCharge(&calls, "warm", 1))
	require.NoError(t, err)

	release := holdKeyWithTableLock(ctx, t, e, chargeKey("k1", 1))
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	rt, prepares := pc.roundTrips(func() {
		_, err = r.Run(short, chargeKey("k1", 1), insertCharge(&calls, "twin", 1))
	})
	require.ErrorIs(t, err, txn.ErrKeyInUse, "at once, not after a wait on the holder's table lock")
	require.Equal(t, int64(4), rt, "the read, BEGIN with the key and the statement, the ROLLBACK, the read that answers")
	require.Zero(t, prepares, "the statement was sent by its prepared text")
	require.NoError(t, release())
	require.Equal(t, int64(3), calls.Load(), "the twin's function ran; its statement did not")
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'twin'`))

	// The statement was skipped, not failed: it still travels.
	rt, _ = pc.roundTrips(func() {
		_, err = r.Run(ctx, chargeKey("k2", 1), insertCharge(&calls, "after", 1))
	})
	require.NoError(t, err)
	require.Equal(t, int64(3), rt)
}

// A first statement whose plan the table changed under (a column added
// under SELECT *) fails once, as it does on a plain pgx.Tx in the same
// mode, and runs on the next Run; from then on it goes out as on any
// pgx.Tx on that connection.
func TestPreparedFirstStatementWhoseTableChangedFailsOnceAsOnAPlainTx(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	_, err := e.Pool.Exec(ctx, `CREATE TABLE plans (id int PRIMARY KEY); INSERT INTO plans VALUES (1)`)
	require.NoError(t, err)
	r, pc := e.oneConnRunner(t, nil)
	read := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		rows, err := tx.Query(ctx, `SELECT * FROM plans WHERE id = $1`, 1)
		if err != nil {
			return txn.Response{}, err
		}
		n := 0
		for rows.Next() {
			n++
		}
		if err := rows.Err(); err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(200, map[string]int{"rows": n})
	}
	for i := range 2 {
		_, err := r.Run(ctx, chargeKey(fmt.Sprintf("warm%d", i), 1), read)
		require.NoError(t, err)
	}
	_, err = e.Pool.Exec(ctx, `ALTER TABLE plans ADD COLUMN note text`)
	require.NoError(t, err)

	// On a plain pgx.Tx of a pool in the same mode, with the statement cached.
	plainPool := e.NewPool(t, func(c *pgxpool.Config) {
		c.MaxConns = 1
		c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
	})
	plain := func() error {
		return pgx.BeginFunc(ctx, plainPool, func(tx pgx.Tx) error {
			_, err := read(ctx, tx)
			return err
		})
	}
	_, err = e.Pool.Exec(ctx, `ALTER TABLE plans DROP COLUMN note`)
	require.NoError(t, err)
	require.NoError(t, plain())
	_, err = e.Pool.Exec(ctx, `ALTER TABLE plans ADD COLUMN note text`)
	require.NoError(t, err)
	plainErr := plain()
	require.Error(t, plainErr, "a plain pgx.Tx fails once")
	require.NoError(t, plain(), "and runs the next time")

	_, err = r.Run(ctx, chargeKey("k1", 1), read)
	require.Error(t, err)
	require.Contains(t, err.Error(), "cached plan must not change result type")
	require.Contains(t, plainErr.Error(), "cached plan must not change result type")
	var resp txn.Response
	rt, prepares := pc.roundTrips(func() {
		resp, err = r.Run(ctx, chargeKey("k1", 1), read)
	})
	require.NoError(t, err)
	require.JSONEq(t, `{"rows":1}`, string(resp.Body))
	require.Equal(t, int64(4), rt, "the read, BEGIN with the key, the statement, the response with COMMIT")
	require.Equal(t, int64(1), prepares, "pgx's own cache prepares the statement again")
}

// A statement run by the name of one prepared on the connection (here by
// AfterConnect) is not prepared again under another text: it runs as on
// any pgx.Tx, every time; by a `Run` and by a workflow's first phase. A
// name with whitespace looks like SQL and is tried as a statement once:
// the run is rolled back before any of the function's statements ran and
// runs again, and from then on the name runs as on any pgx.Tx.
func TestFirstStatementRunByItsPreparedNameRunsAsOnAPlainTx(t *testing.T) {
	t.Parallel()
	for label, name := range map[string]string{"name": "ins_charge", "name_with_a_space": "ins charge"} {
		for _, entry := range []string{"run", "workflow"} {
			t.Run(label+"/"+entry, func(t *testing.T) {
				t.Parallel()
				e := newEnv(t, nil)
				ctx := ctxT(t)
				r, _ := e.oneConnRunner(t, func(c *pgxpool.Config) {
					c.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
						_, err := conn.Prepare(ctx, name, `INSERT INTO charges (ref, amount) VALUES ($1, 1)`)
						return err
					}
				})
				var calls atomic.Int64
				body := func(ctx context.Context, tx pgx.Tx, ref string) error {
					calls.Add(1)
					tag, err := tx.Exec(ctx, name, ref)
					if err == nil && tag.String() != "INSERT 0 1" {
						err = fmt.Errorf("tag %q", tag)
					}
					return err
				}
				var ref string
				wf := txn.NewWorkflow("by_name", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
					if _, err := txn.Atomic(ctx, a, "charged", func(ctx context.Context, tx pgx.Tx) (int, error) {
						return 1, body(ctx, tx, ref)
					}); err != nil {
						return txn.Response{}, err
					}
					return a.Finish(ctx, func(context.Context, pgx.Tx) (txn.Response, error) { return txn.JSON(201, "done") })
				})
				require.NoError(t, e.reg.Register(wf))
				for i := range 3 {
					ref = fmt.Sprintf("c%d", i)
					key := chargeKey(fmt.Sprintf("k%d", i), 1)
					var err error
					if entry == "run" {
						_, err = r.Run(ctx, key, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
							return txn.Response{Status: 201}, body(ctx, tx, ref)
						})
					} else {
						_, err = r.RunWorkflow(ctx, key, wf)
					}
					require.NoError(t, err)
				}
				require.Equal(t, 3, e.Count(t, `SELECT count(*) FROM charges`))
				require.LessOrEqual(t, calls.Load(), int64(4), "at most one run again, once on the connection")
			})
		}
	}
}

// A connection prepares at most 64 first statements; past them a first
// statement goes out as on any pgx.Tx (4 round trips), and those prepared
// still travel.
func TestFirstStatementsPreparedOnAConnectionAreBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, pc := e.oneConnRunner(t, nil)
	run := func(key string, amount int) int64 {
		rt, _ := pc.roundTrips(func() {
			_, err := r.Run(ctx, chargeKey(key, 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
				_, err := tx.Exec(ctx, fmt.Sprintf(`INSERT INTO charges (ref, amount) VALUES ($1, %d)`, amount), key)
				return txn.Response{Status: 201}, err
			})
			require.NoError(t, err)
		})
		return rt
	}
	for i := range 64 {
		run(fmt.Sprintf("a%d", i), i)
	}
	require.Equal(t, int64(3), run("b0", 0), "a prepared one travels")
	require.Equal(t, int64(3), run("b63", 63), "so does the 64th")
	require.Equal(t, int64(4), run("b64", 64), "the 65th is not prepared")
	require.Equal(t, int64(4), run("c64", 64), "nor the next time")
	require.Equal(t, 68, e.Count(t, `SELECT count(*) FROM charges`))
}

// An argument pgx cannot encode, on a first statement that would travel
// by its prepared text, fails that statement only, as on any pgx.Tx: the
// transaction stays usable and the run commits what the function wrote.
func TestPreparedFirstStatementThatCannotBeEncodedLeavesTheTransactionUsable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	r, _ := e.oneConnRunner(t, nil)
	insert := `INSERT INTO charges (ref, amount) VALUES ($1, 1)`
	for i := range 2 {
		_, err := r.Run(ctx, chargeKey(fmt.Sprintf("warm%d", i), 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			_, err := tx.Exec(ctx, insert, "warm")
			return txn.Response{Status: 201}, err
		})
		require.NoError(t, err)
	}
	var encodeErr, countErr error
	resp, err := r.Run(ctx, chargeKey("k1", 1), func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		_, encodeErr = tx.Exec(ctx, insert, make(chan int))
		_, countErr = tx.Exec(ctx, insert, "c1", "one too many")
		if _, err := tx.Exec(ctx, insert, "c1"); err != nil {
			return txn.Response{}, err
		}
		return txn.Response{Status: 201}, nil
	})
	require.Error(t, encodeErr)
	require.Error(t, countErr)
	require.NoError(t, err)
	require.Equal(t, 201, resp.Status)
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'c1'`))
}

// Prepared statements dropped on a connection outside a Run (pgx's
// DeallocateAll, here in a pool's AfterRelease hook, on every release) are
// not taken for prepared: each Run prepares its first statement again
// after the key (pgx would prepare it before BEGIN and the key, taking the
// statement's table locks first), so a twin still gets ErrKeyInUse at
// once.
func TestFirstStatementDeallocatedOutsideARunIsPreparedAgainAfterTheKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	var deallocations atomic.Int64
	r, _ := e.oneConnRunner(t, func(c *pgxpool.Config) {
		c.AfterRelease = func(conn *pgx.Conn) bool {
			deallocations.Add(1)
			return conn.DeallocateAll(context.Background()) == nil
		}
	})
	var calls atomic.Int64
	for _, k := range []string{"k0", "k0b", "k0c"} {
		_, err := r.Run(ctx, chargeKey(k, 1), insertCharge(&calls, "warm", 1))
		require.NoError(t, err)
	}

	release := holdKeyWithTableLock(ctx, t, e, chargeKey("k1", 1))
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	_, err := r.Run(short, chargeKey("k1", 1), insertCharge(&calls, "twin", 1))
	require.ErrorIs(t, err, txn.ErrKeyInUse, "at once, not after a wait on the holder's table lock")
	require.NoError(t, release())
	require.Zero(t, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'twin'`))
	require.GreaterOrEqual(t, deallocations.Load(), int64(3))

	_, err = r.Run(ctx, chargeKey("k2", 1), insertCharge(&calls, "after", 1))
	require.NoError(t, err)
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM charges WHERE ref = 'after'`))
}
