package txntest

import (
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ownedSequences lists the sequences of the current schema that belong to
// a column (identity and serial columns), with that column.
const ownedSequences = `
SELECT s.oid::regclass::text, format('%I.%I', tn.nspname, t.relname), quote_ident(a.attname)
FROM pg_class s
JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = s.oid
                AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')
JOIN pg_class t ON t.oid = d.refobjid
JOIN pg_namespace tn ON tn.oid = t.relnamespace
JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = d.refobjsubid
WHERE s.relkind = 'S' AND s.relnamespace = current_schema()::regnamespace
ORDER BY 1`

// rewindSequences sets every identity and serial sequence of the schema
// back to the highest value its column holds (or its start when the table
// is empty), undoing the values a rolled-back transaction drew.
func rewindSequences(ctx context.Context, pool *pgxpool.Pool) error {
	rows, err := pool.Query(ctx, ownedSequences)
	if err != nil {
		return fmt.Errorf("txntest: rewind sequences: %w", err)
	}
	type owned struct{ seq, table, column string }
	list, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (owned, error) {
		var o owned
		err := row.Scan(&o.seq, &o.table, &o.column)
		return o, err
	})
	if err != nil {
		return fmt.Errorf("txntest: rewind sequences: %w", err)
	}
	for _, o := range list {
		// The names come from the catalog, quoted by it.
		sql := fmt.Sprintf(`SELECT setval($1::regclass,
			coalesce(max(%[2]s)::bigint, (SELECT seqstart FROM pg_sequence WHERE seqrelid = $1::regclass)),
			max(%[2]s) IS NOT NULL) FROM %[1]s`, o.table, o.column)
		if _, err := pool.Exec(ctx, sql, o.seq); err != nil {
			return fmt.Errorf("txntest: rewind sequence %s: %w", o.seq, err)
		}
	}
	return nil
}

// rowCounts counts the rows of every table of the current schema, except
// the provider's (compared on their own) and the tables ignored.
func rowCounts(ctx context.Context, pool *pgxpool.Pool, ignore []string) (map[string]int64, error) {
	rows, err := pool.Query(ctx, `
		SELECT c.relname::text,
		       (xpath('/row/n/text()', query_to_xml(format('SELECT count(*) AS n FROM %I.%I', n.nspname, c.relname),
		                                            false, true, '')))[1]::text::bigint
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind IN ('r', 'p') AND n.oid = current_schema()::regnamespace`)
	if err != nil {
		return nil, fmt.Errorf("txntest: count rows: %w", err)
	}
	counts := map[string]int64{}
	var table string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&table, &n}, func() error {
		if table != providerCallsTable && table != providerEffectsTable && !slices.Contains(ignore, table) {
			counts[table] = n
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("txntest: count rows: %w", err)
	}
	return counts, nil
}
