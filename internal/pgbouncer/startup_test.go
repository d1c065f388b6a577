package pgbouncer_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// PgBouncer 1.18 refuses a connection that sends search_path or options as
// a startup parameter, which is why the tests behind it use a database of
// their own and the README sets search_path on the role.
func TestPgBouncer118RefusesSearchPathAndOptionsStartupParameters(t *testing.T) {
	t.Parallel()
	b := startBouncer(t)
	d := pgtest.NewDatabase(t)
	for name, param := range map[string][2]string{
		"search_path": {"search_path", "public"},
		"options":     {"options", "-c search_path=public"},
	} {
		cfg, err := b.Config(d.URL, d.Database, pgx.QueryExecModeExec)
		require.NoError(t, err)
		cfg.RuntimeParams[param[0]] = param[1]
		conn, err := pgx.ConnectConfig(context.Background(), cfg)
		if err == nil {
			_ = conn.Close(context.Background())
		}
		require.ErrorContains(t, err, "unsupported startup parameter", name)
	}
}
