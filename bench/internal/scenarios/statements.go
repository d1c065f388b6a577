package scenarios

import (
	"context"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Statement statistics: with pg_stat_statements preloaded on the server
// (for a throwaway cluster: -pg shared_preload_libraries=pg_stat_statements)
// and Suite.Statements set, each cell's busiest statements are written there,
// with their mean planning time (0 unless pg_stat_statements.track_planning).

// enableStatements creates the extension if the server preloads it.
func enableStatements(ctx context.Context, pool *pgxpool.Pool) bool {
	var libs string
	if err := pool.QueryRow(ctx, "SELECT current_setting('shared_preload_libraries')").Scan(&libs); err != nil {
		return false
	}
	if !strings.Contains(libs, "pg_stat_statements") {
		return false
	}
	_, err := pool.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
	return err == nil
}

func (s *Suite) resetStatements(ctx context.Context, pool *pgxpool.Pool) {
	if s.Statements == nil || !s.statementsOn {
		return
	}
	_, _ = pool.Exec(ctx, "SELECT pg_stat_statements_reset()")
}

var spaces = regexp.MustCompile(`\s+`)

// dumpStatements writes the cell's statements by total execution time.
func (s *Suite) dumpStatements(ctx context.Context, pool *pgxpool.Pool, title string, ops int) {
	if s.Statements == nil || !s.statementsOn {
		return
	}
	rows, err := pool.Query(ctx, `
		SELECT calls, total_exec_time, mean_exec_time, total_plan_time / greatest(plans, 1), rows, shared_blks_hit + shared_blks_read, wal_bytes, query
		FROM pg_stat_statements
		WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
		ORDER BY total_exec_time DESC LIMIT 15`)
	if err != nil {
		fmt.Fprintf(s.Statements, "%s: %v\n", title, err)
		return
	}
	defer rows.Close()
	w := s.Statements
	fmt.Fprintf(w, "\n#### %s (%d ops measured)\n\n| calls/op | mean ms | plan ms | total ms | rows/call | blocks/call | WAL B/call | query |\n|--:|--:|--:|--:|--:|--:|--:|---|\n", title, ops)
	for rows.Next() {
		var calls, rws, blks int64
		var total, mean, plan float64
		var wal float64
		var q string
		if err := rows.Scan(&calls, &total, &mean, &plan, &rws, &blks, &wal, &q); err != nil {
			fmt.Fprintf(w, "%v\n", err)
			return
		}
		q = spaces.ReplaceAllString(q, " ")
		if len(q) > 140 {
			q = q[:140] + "…"
		}
		perOp := 0.0
		if ops > 0 {
			perOp = float64(calls) / float64(ops)
		}
		fmt.Fprintf(w, "| %.2f | %.3f | %.3f | %.0f | %.1f | %.1f | %.0f | `%s` |\n", perOp, mean, plan, total,
			float64(rws)/float64(max(calls, 1)), float64(blks)/float64(max(calls, 1)), wal/float64(max(calls, 1)), strings.ReplaceAll(q, "|", "\\|"))
	}
}
