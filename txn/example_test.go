package txn_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

// A single-phase endpoint: the key, the order and the response commit in
// one transaction, and a retry with the same key replays the response.
func ExampleRunner_Run() {
	db, done := pgtest.Example(true) // a migrated schema of its own
	defer done()
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (
		id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, sku text NOT NULL, quantity int NOT NULL)`); err != nil {
		panic(err)
	}
	runner, err := txn.New(db.Pool, nil)
	if err != nil {
		panic(err)
	}

	key := txn.Key{
		Scope:  "account_42",       // the authenticated principal
		Value:  "0f8c2b7e-order-1", // the client's Idempotency-Key
		Method: http.MethodPost, Path: "/orders",
		Params: []byte(`{"sku":"book-1","quantity":2}`),
	}
	createOrder := func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO orders (sku, quantity) VALUES ('book-1', 2) RETURNING id`).Scan(&id)
		if err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(http.StatusCreated, map[string]int64{"id": id})
	}
	for range 2 { // the client retries: the second call replays the first's response
		resp, err := runner.Run(ctx, key, createOrder)
		if err != nil {
			fmt.Println("answer", txn.HTTPStatus(err))
			return
		}
		fmt.Println(resp.Status, string(resp.Body), "replayed:", resp.Replayed)
	}
	// Output:
	// 201 {"id":1} replayed: false
	// 201 {"id":1} replayed: true
}

// payments stands for a payment provider that deduplicates charges on the
// idempotency key it is given, as Stripe does.
type payments struct {
	mu      sync.Mutex
	charges map[string]string // idempotency key -> charge id
	down    bool
}

var (
	errDeclinedCard = errors.New("card declined")
	errUnavailable  = errors.New("payment provider unavailable")
)

func (p *payments) charge(_ context.Context, idempotencyKey string, amountCents int64) (string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.down:
		return "", errUnavailable
	case amountCents > 100_000:
		return "", errDeclinedCard
	}
	if id, ok := p.charges[idempotencyKey]; ok {
		return id, nil // a repeated call: the same charge
	}
	id := fmt.Sprintf("ch_%d", len(p.charges)+1)
	p.charges[idempotencyKey] = id
	return id, nil
}

type rideResponse struct {
	ID          int64  `json:"id"`
	AmountCents int64  `json:"amount_cents"`
	ChargeID    string `json:"charge_id,omitempty"`
}

// newCreateRide is a multi-phase workflow: create the ride, charge the card
// at the provider with a key derived from the operation's, then record the
// charge and answer.
func newCreateRide(provider *payments) *txn.Workflow {
	return txn.NewWorkflow("create_ride", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		r, err := txn.Atomic(ctx, a, "ride_created", func(ctx context.Context, tx pgx.Tx) (rideResponse, error) {
			r := rideResponse{AmountCents: 1250}
			err := tx.QueryRow(ctx, `INSERT INTO rides (amount_cents) VALUES ($1) RETURNING id`, r.AmountCents).Scan(&r.ID)
			return r, err
		})
		if err != nil {
			return txn.Response{}, err // transient: the key is released and resumable
		}
		chargeID, err := txn.Foreign(ctx, a, "charge_created", func(ctx context.Context, foreignKey string) (string, error) {
			return provider.charge(ctx, foreignKey, r.AmountCents) // the provider deduplicates on foreignKey
		})
		if errors.Is(err, errDeclinedCard) {
			return txn.JSON(http.StatusPaymentRequired, map[string]string{"error": "card_declined"}) // terminal: stored
		}
		if err != nil {
			return txn.Response{}, err // transient: resumed after ride_created
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			r.ChargeID = chargeID
			if _, err := tx.Exec(ctx, `UPDATE rides SET charge_id = $1 WHERE id = $2`, chargeID, r.ID); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(http.StatusCreated, r)
		})
	})
}

// newRidesRunner gives an example a migrated schema with a rides table, and
// a runner whose registry holds wf.
func newRidesRunner(wf *txn.Workflow) (*txn.Runner, *pgxpool.Pool, func()) {
	db, done := pgtest.Example(true)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE rides (
		id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, amount_cents bigint NOT NULL, charge_id text)`); err != nil {
		panic(err)
	}
	registry := txn.NewRegistry()
	if err := registry.Register(wf); err != nil {
		panic(err)
	}
	runner, err := txn.New(db.Pool, &txn.Config{Workflows: registry})
	if err != nil {
		panic(err)
	}
	return runner, db.Pool, done
}

// A workflow runs each phase once, however often the client retries: the
// retry replays the stored response and the card is charged once.
func ExampleNewWorkflow() {
	provider := &payments{charges: map[string]string{}}
	createRide := newCreateRide(provider)
	runner, _, done := newRidesRunner(createRide) // registers createRide, so recovery can resume it
	defer done()
	ctx := context.Background()

	key := txn.Key{Scope: "user_7", Value: "ride-123", Method: "POST", Path: "/rides"}
	for range 2 {
		resp, err := runner.RunWorkflow(ctx, key, createRide)
		if err != nil {
			fmt.Println("answer", txn.HTTPStatus(err))
			return
		}
		fmt.Println(resp.Status, string(resp.Body), "replayed:", resp.Replayed)
	}
	fmt.Println("charges at the provider:", len(provider.charges))
	// Output:
	// 201 {"id":1,"amount_cents":1250,"charge_id":"ch_1"} replayed: false
	// 201 {"id":1,"amount_cents":1250,"charge_id":"ch_1"} replayed: true
	// charges at the provider: 1
}

// Resume continues an operation whose attempt stopped after a committed
// phase, with its stored request, from that phase: the ride is not created
// twice. The recovery Resumer calls it for stalled keys; an admin tool can
// call it for one.
func ExampleRunner_Resume() {
	provider := &payments{charges: map[string]string{}, down: true}
	createRide := newCreateRide(provider)
	runner, pool, done := newRidesRunner(createRide)
	defer done()
	ctx := context.Background()

	_, err := runner.RunWorkflow(ctx, txn.Key{Scope: "user_7", Value: "ride-9", Method: "POST", Path: "/rides"}, createRide)
	fmt.Println("first attempt:", errors.Is(err, errUnavailable), txn.HTTPStatus(err))

	provider.down = false
	resp, err := runner.Resume(ctx, "user_7", "ride-9")
	if err != nil {
		fmt.Println("resume:", err)
		return
	}
	fmt.Println("resumed:", resp.Status, string(resp.Body))
	var rides int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM rides`).Scan(&rides); err != nil {
		panic(err)
	}
	fmt.Println("rides:", rides, "charges:", len(provider.charges))
	// Output:
	// first attempt: true 500
	// resumed: 201 {"id":1,"amount_cents":1250,"charge_id":"ch_1"}
	// rides: 1 charges: 1
}

// MaxAge bounds how late a foreign call may be repeated, so it must stay
// under the payment providers' 24-hour idempotency window: New rejects
// longer values.
func ExampleNew_maxAgeLimit() {
	pool, err := pgxpool.New(context.Background(), "postgres://localhost/none") // connects lazily
	if err != nil {
		return
	}
	defer pool.Close()
	_, err = txn.New(pool, &txn.Config{MaxAge: 36 * time.Hour})
	fmt.Println(err)
	// Output:
	// txn: new: invalid config: MaxAge 36h0m0s must be shorter than 24h0m0s, the payment providers' idempotency window
}
