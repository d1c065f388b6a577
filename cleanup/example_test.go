package cleanup_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/cleanup"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

// finishKeys runs n operations to their stored responses, and ages the
// first old of them by age, as time would.
func finishKeys(ctx context.Context, pool *pgxpool.Pool, n, old int, age time.Duration) {
	runner, err := txn.New(pool, nil)
	if err != nil {
		panic(err)
	}
	for i := range n {
		key := txn.Key{Scope: "user_1", Value: fmt.Sprintf("key-%d", i), Method: "POST", Path: "/orders"}
		if _, err := runner.Run(ctx, key, func(context.Context, pgx.Tx) (txn.Response, error) {
			return txn.JSON(201, i)
		}); err != nil {
			panic(err)
		}
	}
	if _, err := pool.Exec(ctx, `UPDATE idempotency_keys SET finished_at = finished_at - make_interval(secs => $1)
		WHERE key = ANY($2)`, age.Seconds(), oldKeys(old)); err != nil {
		panic(err)
	}
}

func oldKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("key-%d", i)
	}
	return keys
}

// RunOnce deletes, in bounded batches, the keys that finished longer ago
// than the TTL (and relayed outbox messages past their retention); DryRun
// counts them without deleting anything.
func ExampleCleaner_RunOnce() {
	db, done := pgtest.Example(true) // a migrated schema of its own
	defer done()
	ctx := context.Background()
	finishKeys(ctx, db.Pool, 5, 3, 48*time.Hour) // 5 finished keys, 3 of them two days ago

	cleaner, err := cleanup.New(db.Pool, &cleanup.Config{TTL: 24 * time.Hour, BatchSize: 2})
	if err != nil {
		panic(err)
	}
	would, err := cleaner.DryRun(ctx)
	fmt.Println("would delete:", would.KeysDeleted, err)
	rep, err := cleaner.RunOnce(ctx)
	fmt.Println("deleted:", rep.KeysDeleted, "in batches:", rep.Batches, err)
	rep, err = cleaner.RunOnce(ctx)
	fmt.Println("then:", rep.KeysDeleted, err)
	// Output:
	// would delete: 3 <nil>
	// deleted: 3 in batches: 2 <nil>
	// then: 0 <nil>
}

// A Cleaner keeps keys for three days and relayed outbox messages for two
// weeks, and deletes what is older every ten minutes until Stop. Several
// processes may run one: one deletes at a time, the others skip the round.
func ExampleCleaner_Start() {
	db, done := pgtest.Example(true)
	defer done()
	ctx := context.Background()
	finishKeys(ctx, db.Pool, 3, 2, 4*24*time.Hour) // 3 finished keys, 2 of them four days ago

	cleaner, err := cleanup.New(db.Pool, &cleanup.Config{
		TTL:             72 * time.Hour,
		OutboxRetention: 14 * 24 * time.Hour,
		Interval:        10 * time.Minute,
	})
	if err != nil {
		panic(err)
	}
	if err := cleaner.Start(ctx); err != nil { // a round at once, then every Interval
		panic(err)
	}
	defer cleaner.Stop()

	// The service goes on; here, wait for the first round to delete.
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if rep, err := cleaner.DryRun(ctx); err != nil || rep.KeysDeleted == 0 {
			break
		}
	}
	var left int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&left); err != nil {
		panic(err)
	}
	fmt.Println("keys left:", left)
	// Output:
	// keys left: 1
}

// The TTL is a published policy, so New rejects values outside 24 hours to
// 7 days.
func ExampleNew_invalidTTL() {
	pool, err := pgxpool.New(context.Background(), "postgres://localhost/none") // connects lazily
	if err != nil {
		return
	}
	defer pool.Close()
	_, err = cleanup.New(pool, &cleanup.Config{TTL: time.Hour})
	fmt.Println(err)
	// Output:
	// cleanup: new: invalid config: TTL 1h0m0s is outside the expiry window of 24h0m0s to 168h0m0s
}
