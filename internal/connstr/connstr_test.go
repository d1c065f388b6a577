package connstr_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/connstr"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func parse(t *testing.T, s string) *pgx.ConnConfig {
	t.Helper()
	cfg, err := pgx.ParseConfig(s)
	require.NoError(t, err, s)
	return cfg
}

// same asserts that a and b connect to the same places the same way.
func same(t *testing.T, a, b *pgx.ConnConfig) {
	t.Helper()
	require.Equal(t, a.Host, b.Host)
	require.Equal(t, a.Port, b.Port)
	require.Equal(t, a.Database, b.Database)
	require.Equal(t, a.User, b.User)
	require.Equal(t, a.Password, b.Password)
	require.Equal(t, a.ConnectTimeout, b.ConnectTimeout)
	require.Equal(t, a.RuntimeParams, b.RuntimeParams)
	require.Equal(t, a.DefaultQueryExecMode, b.DefaultQueryExecMode)
	require.Equal(t, a.StatementCacheCapacity, b.StatementCacheCapacity)
	require.Equal(t, a.DescriptionCacheCapacity, b.DescriptionCacheCapacity)
	require.Equal(t, a.TLSConfig == nil, b.TLSConfig == nil)
	require.Len(t, b.Fallbacks, len(a.Fallbacks))
	for i := range a.Fallbacks {
		require.Equal(t, a.Fallbacks[i].Host, b.Fallbacks[i].Host)
		require.Equal(t, a.Fallbacks[i].Port, b.Fallbacks[i].Port)
		require.Equal(t, a.Fallbacks[i].TLSConfig == nil, b.Fallbacks[i].TLSConfig == nil)
	}
}

func TestFormatRoundTripsBothForms(t *testing.T) {
	t.Parallel()
	for _, s := range []string{
		"postgres://postgres@127.0.0.1:5432/test?sslmode=disable",
		"postgres://u%27s%20name:p%40ss%5C%27word%20x@db.example:6432/my%20db?sslmode=require&application_name=it%27s&connect_timeout=7",
		"postgres://u@h1:5432,h2:5433/db?sslmode=prefer",
		"postgres://u@h1/db?sslmode=allow",
		"postgres://u@h1/db", // sslmode defaults to prefer
		"host=/tmp/apg123 port=5432 user=postgres dbname=postgres sslmode=disable",
		"host=/tmp/apg123 user=postgres dbname=postgres sslmode=disable default_query_exec_mode=simple_protocol statement_cache_capacity=0 description_cache_capacity=7",
		"host=localhost user=postgres password='a b\\'c\\\\d' dbname=x options='-c work_mem=4MB' sslmode=disable",
	} {
		orig := parse(t, s)
		out, err := connstr.Format(orig)
		require.NoError(t, err, s)
		same(t, orig, parse(t, out))
	}
}

func TestWithSearchPathKeepsOptionsInEitherForm(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"postgres://u@h/db?sslmode=disable":                                      "-c search_path=s1",
		"host=/tmp/apg1 port=5432 user=postgres dbname=postgres sslmode=disable": "-c search_path=s1",
		"postgres://u@h/db?sslmode=disable&options=-c%20work_mem%3D4MB":          "-c work_mem=4MB -c search_path=s1",
	} {
		out, err := connstr.WithSearchPath(in, "s1")
		require.NoError(t, err)
		cfg := parse(t, out)
		require.Equal(t, want, cfg.RuntimeParams["options"], in)
		_, has := cfg.RuntimeParams["search_path"]
		require.False(t, has)
	}
	_, err := connstr.WithSearchPath("postgres://x:y@[::1", "s1")
	require.Error(t, err, "an invalid string is reported, not passed on")
}

func TestFormatRefusesWhatItCannotRender(t *testing.T) {
	t.Parallel()
	_, err := connstr.Format(parse(t, "postgres://u@h/db?sslmode=verify-full"))
	require.ErrorIs(t, err, connstr.ErrUnrenderable)
	_, err = connstr.Format(parse(t, "postgres://u@h/db?sslmode=disable&target_session_attrs=read-write"))
	require.ErrorIs(t, err, connstr.ErrUnrenderable)
}

// The test server's own connection string (a URL under CI, keyword/value
// for a throwaway local cluster) scoped to a schema connects there.
func TestWithSearchPathConnectsToTheSchema(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	s, err := connstr.WithSearchPath(d.URL, d.Schema)
	require.NoError(t, err)
	conn, err := pgx.Connect(context.Background(), s)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var path string
	require.NoError(t, conn.QueryRow(context.Background(), "SELECT current_schema()").Scan(&path))
	require.Equal(t, d.Schema, path)
}
