package monitor_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/opstest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// sqlRecorder keeps the SQL text and arguments of the last query a pool
// sent, so that the test can EXPLAIN exactly what the generated code runs.
type sqlRecorder struct {
	mu   sync.Mutex
	sql  string
	args []any
}

func (r *sqlRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	r.sql, r.args = data.SQL, data.Args
	r.mu.Unlock()
	return ctx
}

func (r *sqlRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *sqlRecorder) last() (string, []any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sql, r.args
}

// Every query behind the gauges, the status page, the admin command and
// Redrive reads partial (or unique) indexes, never a whole table, on
// tables holding 100,000 published messages and 100,000 finished keys
// beside a handful of rows that matter. The plans are logged (go test -v
// -run PartialIndexes ./monitor). The Snapshot statement's, on PostgreSQL
// 15 (before a VACUUM sets the visibility map, dead letters are counted
// through a bitmap of their index rather than an index-only scan):
//
//	Nested Loop
//	  InitPlan 1 (returns $0)
//	    ->  Aggregate
//	          ->  Bitmap Heap Scan on outbox_messages outbox_messages_1
//	                Recheck Cond: (dead_at IS NOT NULL)
//	                ->  Bitmap Index Scan on outbox_messages_dead_idx
//	  InitPlan 2 (returns $1)
//	    ->  Aggregate
//	          ->  Index Only Scan using idempotency_keys_failed_idx on idempotency_keys idempotency_keys_1
//	  ->  Aggregate
//	        ->  Index Scan using outbox_messages_pending_idx on outbox_messages
//	  ->  Aggregate
//	        ->  Index Scan using idempotency_keys_running_created_at_idx on idempotency_keys
func TestOperatorQueriesReadPartialIndexesNotTables(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := pgtest.New(t)
	rec := &sqlRecorder{}
	pool := d.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = rec })
	seed(t, d)
	opstest.Fill(t, d.Pool, 100_000, 100_000)
	q := db.New(pool)
	keyID := opstest.InsertKey(t, d.Pool, opstest.Key{Key: "with-messages", Status: "finished"})
	_, err := d.Pool.Exec(ctx, "ANALYZE outbox_messages, idempotency_keys")
	require.NoError(t, err)

	for _, c := range []struct {
		name string
		run  func() error
		// index: the plan uses each of these indexes, or at least one
		// when the first is "any of".
		index []string
	}{
		{"Snapshot", func() error { _, err := q.Snapshot(ctx, 60); return err },
			[]string{"outbox_messages_pending_idx", "outbox_messages_dead_idx",
				"idempotency_keys_running_created_at_idx", "idempotency_keys_failed_idx"}},
		{"RecentFailedKeys", func() error { _, err := q.RecentFailedKeys(ctx, 20); return err },
			[]string{"idempotency_keys_failed_idx"}},
		{"RecentDeadLetters", func() error {
			_, err := q.RecentDeadLetters(ctx, db.RecentDeadLettersParams{Topic: "", MaxRows: 20})
			return err
		}, []string{"outbox_messages_dead_idx"}},
		{"RecentDeadLetters of a topic", func() error {
			_, err := q.RecentDeadLetters(ctx, db.RecentDeadLettersParams{Topic: "receipts", MaxRows: 20})
			return err
		}, []string{"outbox_messages_dead_idx"}},
		{"CountDeadLetters", func() error { _, err := q.CountDeadLetters(ctx, "receipts"); return err },
			[]string{"outbox_messages_dead_idx"}},
		{"TopicBacklog", func() error { _, err := q.TopicBacklog(ctx); return err },
			[]string{"outbox_messages_pending_idx", "outbox_messages_dead_idx"}},
		{"ListStalledKeys", func() error {
			_, err := q.ListStalledKeys(ctx, db.ListStalledKeysParams{StalledAfterSeconds: 60, MaxRows: 100})
			return err
		}, []string{"idempotency_keys_running_created_at_idx"}},
		{"KeyDetail", func() error {
			_, err := q.KeyDetail(ctx, db.KeyDetailParams{Scope: "", Key: "stalled-old"})
			return err
		}, []string{"idempotency_keys_scope_key_uniq"}},
		{"KeyMessages", func() error {
			_, err := q.KeyMessages(ctx, db.KeyMessagesParams{IdempotencyKeyID: pgtype.Int8{Int64: keyID, Valid: true}, MaxRows: 100})
			return err
		}, []string{"outbox_messages_idempotency_key_id_idx"}},
		{"FailKeyByOperator", func() error {
			_, err := q.FailKeyByOperator(ctx, db.FailKeyByOperatorParams{Scope: "nobody", Key: "none",
				ResponseStatus: 500, ResponseHeaders: "{}", ResponseBody: []byte("{}"), FailureReason: "operator"})
			return ignoreNoRows(err)
		}, []string{"any of", "idempotency_keys_scope_key_uniq", "idempotency_keys_running_created_at_idx"}},
		{"RedriveMessages", func() error {
			_, err := q.RedriveMessages(ctx, db.RedriveMessagesParams{RowIds: []int64{-1}, MessageIds: []string{uuid.NewString()}})
			return err
		}, []string{"outbox_messages_dead_idx"}},
		{"RedriveDeadBatch", func() error {
			_, err := q.RedriveDeadBatch(ctx, db.RedriveDeadBatchParams{DeadBefore: time.Now().Add(-24 * time.Hour), Topic: "receipts", BatchSize: 1000})
			return err
		}, []string{"outbox_messages_dead_idx"}},
	} {
		require.NoError(t, c.run(), c.name)
		sql, args := rec.last()
		plan := explain(t, d.Pool, sql, args)
		t.Logf("%s:\n%s", c.name, plan)
		require.NotContains(t, plan, "Seq Scan", "%s scans a table:\n%s", c.name, plan)
		if c.index[0] == "any of" {
			require.True(t, slices.ContainsFunc(c.index[1:], func(idx string) bool { return strings.Contains(plan, idx) }),
				"%s uses none of %v:\n%s", c.name, c.index[1:], plan)
			continue
		}
		for _, idx := range c.index {
			require.Contains(t, plan, idx, "%s does not use %s:\n%s", c.name, idx, plan)
		}
	}
}

func ignoreNoRows(err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	return err
}

// explain returns the plan of sql with args, without running it.
func explain(t *testing.T, pool *pgxpool.Pool, sql string, args []any) string {
	t.Helper()
	rows, err := pool.Query(context.Background(), "EXPLAIN (COSTS OFF) "+sql, args...)
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return strings.Join(lines, "\n")
}
