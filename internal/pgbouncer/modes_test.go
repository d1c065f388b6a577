package pgbouncer_test

import (
	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/internal/connstr"
)

// allModes are pgx's query exec modes; straight to PostgreSQL every public
// path works in each.
var allModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement,
	pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec,
	pgx.QueryExecModeSimpleProtocol,
}

// bouncerModes are the modes that can work behind PgBouncer 1.18 in
// transaction pooling mode, for any pgx client: each query is a single
// round trip, with the unnamed statement or a simple query.
var bouncerModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeExec,
	pgx.QueryExecModeSimpleProtocol,
}

func modeName(mode pgx.QueryExecMode) string { return connstr.ExecModeName(mode) }
