package torture

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

// The business code of TestLinearizability: its tables, its keys, the
// functions the runners run, and the payment provider they call.

const linSchema = `
-- One row per committed effect: the execution that wrote it, and for which request.
CREATE TABLE lin_effects (key text NOT NULL, effect text NOT NULL, execution text NOT NULL, variant text NOT NULL);
-- The row contended functions read and write, and a fault goroutine writes, so that SERIALIZABLE fails some with 40001.
CREATE TABLE lin_hot (id int PRIMARY KEY, n bigint NOT NULL);
INSERT INTO lin_hot VALUES (1, 0);
-- The payment provider: every call logged; one charge per foreign key, whatever the repeats.
CREATE TABLE lin_provider_calls (foreign_key text NOT NULL, idem_key text NOT NULL);
CREATE TABLE lin_charges (foreign_key text PRIMARY KEY, idem_key text NOT NULL, charge_id text NOT NULL);`

// linKey is a key of the storm: a Run's or a workflow's.
type linKey struct {
	name string
	kind callKind // callRun or callWorkflow
}

// linKeyAt is the i-th key of a round.
func linKeyAt(round, i int) linKey {
	kind := callRun
	if i%2 == 1 {
		kind = callWorkflow
	}
	return linKey{name: fmt.Sprintf("r%04d-k%d", round, i), kind: kind}
}

// request is the key with variant's params: A is the key's usual request,
// B another one under the same key.
func (k linKey) request(variant string) txn.Key {
	return txn.Key{Scope: linScope, Value: k.name, Method: "POST", Path: "/" + string(k.kind),
		Params: []byte(`{"sku":"book","variant":"` + variant + `"}`)}
}

// linApp is the business code the runners run: a single-phase function and
// a workflow whose every phase writes an effect row under a fresh execution
// id, and a deduplicating payment provider.
type linApp struct {
	pool   *pgxpool.Pool // the provider's connections
	wf     *txn.Workflow
	counts *counter
}

func newLinApp(t *testing.T, pool *pgxpool.Pool, reg *txn.Registry, counts *counter) *linApp {
	app := &linApp{pool: pool, counts: counts}
	app.wf = txn.NewWorkflow("lin_order", app.order)
	require.NoError(t, reg.Register(app.wf))
	return app
}

// runFunc is the single-phase operation for key and variant; a hot one
// always meets the contended row.
func (app *linApp) runFunc(key, variant string, hot bool) txn.Func {
	return func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		execution, err := app.execute(ctx, tx, key, "run", variant, hot)
		if err != nil {
			return txn.Response{}, err
		}
		return linResponse(execution, answerBody{Variant: variant, Execution: execution})
	}
}

// order is the workflow: an order row (Atomic), a charge (Foreign), a
// finish row and the answer (Finish).
func (app *linApp) order(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
	_, key := a.Key()
	var params struct{ Variant string }
	if err := json.Unmarshal(a.Params(), &params); err != nil {
		return txn.Response{}, err
	}
	order, err := txn.Atomic(ctx, a, "order_created", func(ctx context.Context, tx pgx.Tx) (string, error) {
		return app.execute(ctx, tx, key, "order", params.Variant, false)
	})
	if err != nil {
		return txn.Response{}, err
	}
	charge, err := txn.Foreign(ctx, a, "charged", func(ctx context.Context, foreignKey string) (string, error) {
		return app.charge(ctx, foreignKey, key)
	})
	if err != nil {
		return txn.Response{}, err
	}
	return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		finish, err := app.execute(ctx, tx, key, "finish", params.Variant, false)
		if err != nil {
			return txn.Response{}, err
		}
		return linResponse(finish, answerBody{Variant: params.Variant, Order: order, Charge: charge, Finish: finish})
	})
}

// execute is one run of a phase's function in tx: it writes the effect row
// of a new execution, then meets the faults: now and then a statement
// slower than the lease, and for a third of the runs (all of them if hot)
// a read and a write of the shared row, which SERIALIZABLE fails when
// another run wrote it since.
func (app *linApp) execute(ctx context.Context, tx pgx.Tx, key, effect, variant string, hot bool) (string, error) {
	app.counts.add("function runs")
	execution := uuid.NewString()
	if _, err := tx.Exec(ctx, `INSERT INTO lin_effects VALUES ($1, $2, $3, $4)`, key, effect, execution, variant); err != nil {
		return "", err
	}
	if rand.IntN(25) == 0 {
		app.counts.add("fault: phase slower than the lease")
		if _, err := tx.Exec(ctx, `SELECT pg_sleep($1)`, linSlowPhase.Seconds()); err != nil {
			return "", err
		}
	}
	if hot || rand.IntN(3) == 0 {
		app.counts.add("fault: contended row")
		// The pause widens the window in which another run commits a
		// write (the fault goroutine's every 10 ms); a hot run's is
		// wider, so that it fails again on retry.
		pause := 5 * time.Millisecond
		if hot {
			pause = 50 * time.Millisecond
		}
		var n int64
		if err := tx.QueryRow(ctx, `SELECT n FROM lin_hot, pg_sleep($1) WHERE id = 1`, pause.Seconds()).Scan(&n); err != nil {
			return "", err
		}
		if _, err := tx.Exec(ctx, `UPDATE lin_hot SET n = $1 WHERE id = 1`, n+1); err != nil {
			return "", err
		}
	}
	return execution, nil
}

// charge is the payment provider: it logs every call and charges once per
// foreign key, answering every repeat with the first charge's id. Now and
// then it is slower than the lease.
func (app *linApp) charge(ctx context.Context, foreignKey, key string) (string, error) {
	if _, err := app.pool.Exec(ctx, `INSERT INTO lin_provider_calls VALUES ($1, $2)`, foreignKey, key); err != nil {
		return "", err
	}
	if _, err := app.pool.Exec(ctx, `INSERT INTO lin_charges VALUES ($1, $2, $3) ON CONFLICT (foreign_key) DO NOTHING`,
		foreignKey, key, "ch_"+uuid.NewString()); err != nil {
		return "", err
	}
	if rand.IntN(25) == 0 {
		app.counts.add("fault: foreign call slower than the lease")
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(linSlowPhase):
		}
	}
	var id string
	err := app.pool.QueryRow(ctx, `SELECT charge_id FROM lin_charges WHERE foreign_key = $1`, foreignKey).Scan(&id)
	return id, err
}

// linResponse is an answer that names its execution in the body and in a header.
func linResponse(execution string, body answerBody) (txn.Response, error) {
	resp, err := txn.JSON(http.StatusCreated, body)
	if err != nil {
		return resp, err
	}
	resp.Header.Set("X-Execution", execution)
	return resp, nil
}
