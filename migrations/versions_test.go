package migrations_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/migrations"
)

// permanentGaps are the versions that are missing on purpose, for good.
//
// 7: version 00008 shipped while 00007 did not exist. A 00007 added later
// would sit below versions databases have already applied: goose refuses
// such an out-of-order migration (unless every deploy passes
// -allow-missing), and so does migrations.Up. So 7 stays empty forever.
//
// Never add to this list: a new migration takes the next number after the
// newest file.
var permanentGaps = []int64{7}

var fileName = regexp.MustCompile(`^(\d{5})_[a-z0-9_]+\.sql$`)

// checkVersions returns an error naming every problem of a list of
// migration file names: a name not of the form 00NNN_name.sql, a version
// used twice, a version missing that is not a permanent gap, or a
// permanent gap that has been filled.
func checkVersions(names []string) error {
	var problems []string
	seen := map[int64]string{}
	var top int64
	for _, name := range names {
		m := fileName.FindStringSubmatch(name)
		if m == nil {
			problems = append(problems, name+" is not named 00NNN_lower_snake_case.sql")
			continue
		}
		v, _ := strconv.ParseInt(m[1], 10, 64)
		if other, ok := seen[v]; ok {
			problems = append(problems, fmt.Sprintf("%s and %s have the same version %d", other, name, v))
		}
		seen[v] = name
		top = max(top, v)
	}
	for v := int64(1); v <= top; v++ {
		_, present := seen[v]
		gap := slices.Contains(permanentGaps, v)
		switch {
		case gap && present:
			problems = append(problems, fmt.Sprintf("%s fills the permanent gap at version %d: it would apply out of order on every database past it; give it the next number after the newest file", seen[v], v))
		case !gap && !present:
			problems = append(problems, fmt.Sprintf("version %d is missing: migrations are numbered without gaps (the only permanent gaps are %v)", v, permanentGaps))
		}
	}
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("%q", problems)
}

// The migration files are numbered 1, 2, 3, ... with no gap but the
// permanent ones and no version twice, both the embedded ones and those in
// the folder (the goose CLI reads the folder).
func TestMigrationVersionsHaveNoGapButThePermanentOnesAndNoDuplicate(t *testing.T) {
	t.Parallel()
	require.NoError(t, checkVersions(files(t)), "embedded files")
	entries, err := os.ReadDir(migrationsDir(t))
	require.NoError(t, err)
	var onDisk []string
	for _, e := range entries {
		if filepath.Ext(e.Name()) == ".sql" {
			onDisk = append(onDisk, e.Name())
		}
	}
	require.Equal(t, files(t), onDisk, "every .sql file in the folder is embedded")
	require.NoError(t, checkVersions(onDisk), "files in the folder")
}

// checkVersions catches what it is there to catch.
func TestCheckVersionsRefusesGapsDuplicatesAndAFilledPermanentGap(t *testing.T) {
	t.Parallel()
	ok := []string{"00001_a.sql", "00002_b.sql", "00003_c.sql", "00004_d.sql", "00005_e.sql", "00006_f.sql", "00008_h.sql", "00009_i.sql"}
	require.NoError(t, checkVersions(ok))
	for name, tc := range map[string]struct {
		names []string
		want  string
	}{
		"new gap":             {append(slices.Clone(ok), "00011_k.sql"), "version 10 is missing"},
		"gap at the start":    {ok[1:], "version 1 is missing"},
		"duplicate":           {append(slices.Clone(ok), "00009_other.sql"), "have the same version 9"},
		"permanent gap taken": {append(slices.Clone(ok), "00007_g.sql"), "fills the permanent gap at version 7"},
		"bad name":            {append(slices.Clone(ok), "0010_j.sql"), "is not named"},
	} {
		require.ErrorContains(t, checkVersions(tc.names), tc.want, name)
	}
}

// A database migrated up to the version below the permanent gap (as one
// was before 00008 shipped) is brought up to date across the gap, by
// migrations.Up and by the goose CLI alike, and neither records the
// missing version.
func TestUpAndGooseCLIMigrateAcrossThePermanentGap(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	below := permanentGaps[0] - 1
	require.Contains(t, allVersions(t), below)

	byUp := freshDatabase(t)
	require.NoError(t, migrations.Up(ctx, byUp.Pool))
	require.NoError(t, migrations.DownTo(ctx, byUp.Pool, below))
	require.Equal(t, below, slices.Max(appliedVersions(t, byUp)))
	require.NoError(t, migrations.Up(ctx, byUp.Pool))
	require.NoError(t, migrations.Check(ctx, byUp.Pool))

	byCLI := freshDatabase(t)
	code, out := runGoose(t, byCLI, nil, withTable, "up-to", strconv.FormatInt(below, 10))
	require.Zero(t, code, out)
	require.Equal(t, below, slices.Max(appliedVersions(t, byCLI)))
	code, out = runGoose(t, byCLI, nil, withTable, "up")
	require.Zero(t, code, out)
	require.NoError(t, migrations.Check(ctx, byCLI.Pool))
	code, out = runGoose(t, byCLI, nil, withTable, "status")
	require.Zero(t, code, out)
	require.NotContains(t, out, "Pending", out)

	for _, applied := range [][]int64{appliedVersions(t, byUp), appliedVersions(t, byCLI)} {
		require.Equal(t, allVersions(t), applied)
		for _, gap := range permanentGaps {
			require.NotContains(t, applied, gap)
		}
	}
}
