package txn_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

// provider is an in-process payment provider that deduplicates on the
// idempotency key it is given, as real providers do.
type provider struct {
	mu      sync.Mutex
	charges map[string]string // foreign key -> charge id
	calls   atomic.Int64
}

func newProvider() *provider { return &provider{charges: map[string]string{}} }

func (p *provider) charge(foreignKey string) string {
	p.calls.Add(1)
	p.mu.Lock()
	defer p.mu.Unlock()
	if id, ok := p.charges[foreignKey]; ok {
		return id
	}
	id := fmt.Sprintf("ch_%d", len(p.charges)+1)
	p.charges[foreignKey] = id
	return id
}

func (p *provider) distinct() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.charges)
}

var errInjected = errors.New("injected transient failure")

// rideFlow is a 3-phase workflow (atomic, foreign, final atomic) with hooks
// that fail or block it at chosen points. It counts each phase's executions.
type rideFlow struct {
	wf       *txn.Workflow
	prov     *provider
	p1, p3   atomic.Int64 // phase body executions (including rolled-back ones)
	failAt   atomic.Value // string: "after_p1", "after_p2", "in_p3", "foreign"
	hook     func(point string, a *txn.Attempt)
	declined bool
}

type ride struct {
	ID     int64 `json:"id"`
	Amount int   `json:"amount"`
}

func newRideFlow(t *testing.T, reg *txn.Registry, name string) *rideFlow {
	t.Helper()
	f := &rideFlow{prov: newProvider()}
	f.failAt.Store("")
	f.wf = txn.NewWorkflow(name, func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		var in struct {
			Amount int `json:"amount"`
		}
		if err := jsonUnmarshal(a.Params(), &in); err != nil {
			return txn.JSON(400, map[string]string{"error": "bad params"})
		}
		r, err := txn.Atomic(ctx, a, "ride_created", func(ctx context.Context, tx pgx.Tx) (ride, error) {
			f.p1.Add(1)
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO charges (ref, amount, attempt) VALUES ('ride', $1, $2) RETURNING id`, in.Amount, a.Number()).Scan(&id)
			return ride{ID: id, Amount: in.Amount}, err
		})
		if err != nil {
			return txn.Response{}, err
		}
		f.at("after_p1", a)
		if f.failAt.Load() == "after_p1" {
			return txn.Response{}, errInjected
		}
		charge, err := txn.Foreign(ctx, a, "charge_created", func(ctx context.Context, fk string) (string, error) {
			if f.failAt.Load() == "foreign" {
				return "", errInjected
			}
			if f.declined {
				return "", errDeclined
			}
			return f.prov.charge(fk), nil
		})
		if errors.Is(err, errDeclined) {
			return txn.JSON(402, map[string]string{"error": "card_declined"})
		}
		if err != nil {
			return txn.Response{}, err
		}
		f.at("after_p2", a)
		if f.failAt.Load() == "after_p2" {
			return txn.Response{}, errInjected
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			f.p3.Add(1)
			f.at("in_p3", a)
			if f.failAt.Load() == "in_p3" {
				return txn.Response{}, errInjected
			}
			if _, err := tx.Exec(ctx, `INSERT INTO charges (ref, amount, attempt) VALUES ($1, $2, $3)`, charge, r.Amount, a.Number()); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(201, map[string]any{"ride_id": r.ID, "charge_id": charge, "amount": r.Amount})
		})
	})
	require.NoError(t, reg.Register(f.wf))
	return f
}

var errDeclined = errors.New("card declined")

func (f *rideFlow) at(point string, a *txn.Attempt) {
	if f.hook != nil {
		f.hook(point, a)
	}
}

func rideKey(value string) txn.Key {
	return txn.Key{Scope: "user_1", Value: value, Method: "POST", Path: "/rides", Params: []byte(`{"amount": 1250}`)}
}
