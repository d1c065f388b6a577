package migrations_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/migrations"
)

// readmeGooseCommands returns the lines of the README's shell block that
// shows how to run the goose CLI on these migrations, except the go install
// line: the tests use the goose CLI they built, at the same version.
func readmeGooseCommands(t *testing.T) []string {
	t.Helper()
	readme, err := os.ReadFile(filepath.Join(migrationsDir(t), "..", "README.md"))
	require.NoError(t, err)
	for _, block := range strings.Split(string(readme), "```sh\n")[1:] {
		block, _, _ = strings.Cut(block, "```")
		if !strings.Contains(block, "go list -m -f") {
			continue
		}
		var lines []string
		for line := range strings.Lines(block) {
			line = strings.TrimSpace(line)
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			if strings.HasPrefix(line, "go install ") {
				require.Contains(t, line, "github.com/pressly/goose/v3/cmd/goose@"+gooseVersion(t),
					"the README installs the goose CLI at the version in go.mod")
				continue
			}
			lines = append(lines, line)
		}
		return lines
	}
	t.Fatal("README.md has no shell block with go list -m -f")
	return nil
}

// gooseVersion returns the goose version go.mod requires.
func gooseVersion(t *testing.T) string {
	t.Helper()
	gomod, err := os.ReadFile(filepath.Join(migrationsDir(t), "..", "go.mod"))
	require.NoError(t, err)
	for line := range strings.Lines(string(gomod)) {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "github.com/pressly/goose/v3" {
			return f[1]
		}
	}
	t.Fatal("go.mod does not require goose")
	return ""
}

// The README's commands find the migration files of the atomicphase module
// a service requires, and apply them with the goose CLI.
func TestReadmeGooseCommandsMigrateFromTheModuleFiles(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	commands := readmeGooseCommands(t)
	require.NotEmpty(t, commands)
	gooseDir := filepath.Dir(buildGoose(t))
	repo, err := filepath.Abs(filepath.Join(migrationsDir(t), ".."))
	require.NoError(t, err)

	// A service's module that requires atomicphase (here, this checkout).
	service := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(service, "go.mod"), []byte(
		"module example.com/payments\n\ngo 1.26.0\n\nrequire github.com/atomicphase/atomicphase v0.0.0\n\n"+
			"replace github.com/atomicphase/atomicphase => "+repo+"\n"), 0o644))
	sum, err := os.ReadFile(filepath.Join(repo, "go.sum"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(service, "go.sum"), sum, 0o644))

	d := freshDatabase(t)
	cmd := exec.Command("sh", "-ec", strings.Join(commands, "\n"))
	cmd.Dir = service
	cmd.Env = append(os.Environ(), "PATH="+gooseDir+string(os.PathListSeparator)+os.Getenv("PATH"),
		"DATABASE_URL="+d.URL, "GOFLAGS=-mod=mod", "GOPROXY=off")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s\n%s", strings.Join(commands, "\n"), out)
	require.Contains(t, string(out), "successfully migrated database")
	require.NoError(t, migrations.Check(ctx, d.Pool))
}
