package cleanup_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/atomicphase/atomicphase/cleanup"
)

// A Cleaner keeps keys for three days, relayed outbox messages for two
// weeks, and deletes the rest every ten minutes until Stop. Several
// processes may run one: one deletes at a time, the others skip the round.
func ExampleCleaner_Start() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return
	}
	defer pool.Close()
	cleaner, err := cleanup.New(pool, &cleanup.Config{
		TTL:             72 * time.Hour,
		OutboxRetention: 14 * 24 * time.Hour,
		Interval:        10 * time.Minute,
	})
	if err != nil {
		return
	}
	if err := cleaner.Start(ctx); err != nil {
		return
	}
	defer cleaner.Stop()
	// ... serve ...
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
