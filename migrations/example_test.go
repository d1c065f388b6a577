package migrations_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
)

// Up applies the pending migrations at process start, in one transaction;
// every replica may call it at once, and a second call finds nothing to do.
// Check only reads: a service that leaves migrating to a deploy step calls
// it instead, and refuses to start on a schema that is behind.
func ExampleUp() {
	db, done := pgtest.Example(false) // an empty schema of its own
	defer done()
	ctx := context.Background()

	err := migrations.Check(ctx, db.Pool)
	fmt.Println("behind before Up:", errors.Is(err, migrations.ErrSchemaBehind))
	for range 2 {
		if err := migrations.Up(ctx, db.Pool); err != nil {
			fmt.Println("up:", err)
			return
		}
	}
	fmt.Println("check after Up:", migrations.Check(ctx, db.Pool))
	// Output:
	// behind before Up: true
	// check after Up: <nil>
}
