// Package pgserver starts a throwaway PostgreSQL cluster for the benchmarks
// from the server binaries installed on the machine (initdb and pg_ctl). The
// cluster listens only on a Unix socket in a fresh temporary directory and is
// deleted by Stop.
//
// Unlike a test cluster, it keeps fsync and synchronous_commit on: the
// figures it produces include the cost of a durable commit, as in production.
package pgserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// ErrNoBinaries reports that initdb and pg_ctl could not be found.
var ErrNoBinaries = errors.New("pgserver: PostgreSQL server binaries (initdb, pg_ctl) not found; install PostgreSQL, set PG_BINDIR, or set BENCH_DATABASE_URL")

// Server is a running throwaway cluster.
type Server struct {
	dir     string
	dataDir string
	bindir  string
	cred    *syscall.Credential
}

// DefaultSettings are the server settings Start uses unless overridden:
// durable commits, room for the connections of every scenario, and a WAL
// budget large enough that bulk loads between cells do not force
// checkpoints (each cell starts with an explicit CHECKPOINT).
func DefaultSettings() map[string]string {
	return map[string]string{
		"fsync":              "on",
		"synchronous_commit": "on",
		"full_page_writes":   "on",
		"max_connections":    "300",
		"shared_buffers":     "128MB",
		"max_wal_size":       "2GB",
		"listen_addresses":   "''",
	}
}

// Start creates and starts a cluster with DefaultSettings overridden by
// settings. Call Stop to shut it down and delete it.
func Start(ctx context.Context, settings map[string]string) (*Server, error) {
	bindir, err := findBinDir()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "apbench") // short: socket paths are limited to ~100 bytes
	if err != nil {
		return nil, fmt.Errorf("pgserver: temp dir: %w", err)
	}
	s := &Server{dir: dir, dataDir: filepath.Join(dir, "data"), bindir: bindir}
	if os.Geteuid() == 0 {
		// initdb and postgres refuse to run as root.
		cred, err := unprivileged()
		if err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
		s.cred = cred
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("pgserver: chown: %w", err)
		}
	}
	if err := s.run(ctx, "initdb", "-D", s.dataDir, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale"); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	all := DefaultSettings()
	all["unix_socket_directories"] = "'" + dir + "'"
	for k, v := range settings {
		all[k] = v
	}
	names := make([]string, 0, len(all))
	for k := range all {
		names = append(names, k)
	}
	sort.Strings(names)
	var o strings.Builder
	for _, k := range names {
		fmt.Fprintf(&o, " -c %s=%s", k, all[k])
	}
	logFile := filepath.Join(dir, "server.log")
	if err := s.run(ctx, "pg_ctl", "-D", s.dataDir, "-l", logFile, "-w", "-t", "60", "-o", o.String(), "start"); err != nil {
		tail, _ := os.ReadFile(logFile)
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("%w\nserver log:\n%s", err, tail)
	}
	return s, nil
}

// URL returns a connection string for database on this cluster.
func (s *Server) URL(database string) string {
	return fmt.Sprintf("host=%s port=5432 user=postgres dbname=%s sslmode=disable", s.dir, database)
}

// Stop shuts the server down and deletes its directory.
func (s *Server) Stop() error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err := s.run(ctx, "pg_ctl", "-D", s.dataDir, "-m", "fast", "-w", "stop")
	if rmErr := os.RemoveAll(s.dir); err == nil {
		err = rmErr
	}
	return err
}

func (s *Server) run(ctx context.Context, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, filepath.Join(s.bindir, name), args...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	cmd.Dir = s.dir
	// Own process group: a terminal's Ctrl-C reaches the harness first,
	// which then stops the server cleanly.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.cred}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("pgserver: %s: %w: %s", name, err, strings.TrimSpace(out.String()))
	}
	return nil
}

func unprivileged() (*syscall.Credential, error) {
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			continue
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil || uid == 0 {
			continue
		}
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
	}
	return nil, errors.New("pgserver: running as root and no unprivileged user (postgres, nobody) to run PostgreSQL as")
}

func findBinDir() (string, error) {
	has := func(dir string) bool {
		for _, b := range []string{"initdb", "pg_ctl", "postgres"} {
			if fi, err := os.Stat(filepath.Join(dir, b)); err != nil || fi.IsDir() {
				return false
			}
		}
		return true
	}
	if dir := os.Getenv("PG_BINDIR"); dir != "" {
		if has(dir) {
			return dir, nil
		}
		return "", fmt.Errorf("%w (PG_BINDIR=%s lacks them)", ErrNoBinaries, dir)
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		if dir := strings.TrimSpace(string(out)); has(dir) {
			return dir, nil
		}
	}
	// Debian and Ubuntu keep server binaries out of PATH, one folder per version.
	candidates, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(candidates, func(i, j int) bool { return version(candidates[i]) > version(candidates[j]) })
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			candidates = append([]string{filepath.Dir(real)}, candidates...)
		}
	}
	candidates = append(candidates, "/usr/local/pgsql/bin", "/opt/homebrew/bin", "/usr/local/bin", "/usr/bin")
	for _, dir := range candidates {
		if has(dir) {
			return dir, nil
		}
	}
	return "", ErrNoBinaries
}

func version(bindir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(bindir)))
	return v
}
