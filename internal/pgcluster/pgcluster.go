// Package pgcluster starts a throwaway PostgreSQL cluster from the PostgreSQL
// binaries installed on the machine (initdb and pg_ctl), listening only on a
// Unix socket in a fresh temporary directory, and removes it on Stop.
//
// The test harness and the examples use it when no database URL is given and
// no Docker engine answers, so that a machine with PostgreSQL installed but not
// running can still run everything.
package pgcluster

import (
	"bytes"
	"cmp"
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
var ErrNoBinaries = errors.New("pgcluster: PostgreSQL server binaries (initdb, pg_ctl) not found; install PostgreSQL or set PG_BINDIR")

// Options tunes the cluster. The zero value is a cluster fit for tests.
type Options struct {
	// Durable keeps fsync on. Default false: a throwaway cluster trades
	// crash safety of the host for speed.
	Durable bool
	// Settings are extra server settings (name -> value), passed as -c flags.
	Settings map[string]string
	// Port is the server's port, which names its socket file. Default 5432:
	// the server listens only on a socket in its own directory, so clusters
	// never collide; give a primary and its standby different ports to tell
	// their connection strings apart.
	Port int
}

// Cluster is a running throwaway cluster.
type Cluster struct {
	dir     string
	dataDir string
	sockDir string
	bindir  string
	cred    *syscall.Credential
	port    int
	options string // server settings as pg_ctl -o flags, reused on restart
	killed  bool   // Kill ended its processes: nothing left to stop
}

// Start creates and starts a cluster. Call Stop to shut it down and delete it.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	return create(ctx, opts, func(c *Cluster) error {
		return c.run(ctx, "initdb", "-D", c.dataDir, "-U", "postgres", "-A", "trust",
			"-E", "UTF8", "--no-locale", "--no-sync")
	})
}

// StartStandby creates a streaming-replication standby of c with
// pg_basebackup -R (a base backup that writes primary_conninfo and
// standby.signal) and starts it, in a directory of its own. For synchronous
// replication, set synchronous_standby_names on the primary's Settings; give
// the standby a Port other than the primary's. Call Stop to remove it.
func (c *Cluster) StartStandby(ctx context.Context, opts Options) (*Cluster, error) {
	return create(ctx, opts, func(s *Cluster) error {
		return s.run(ctx, "pg_basebackup", "-D", s.dataDir, "-R", "-X", "stream", "-c", "fast", "--no-sync",
			"-h", c.sockDir, "-p", strconv.Itoa(c.port), "-U", "postgres")
	})
}

// create makes a cluster's directory, fills its data directory with
// initData and starts the server; on failure it removes the directory.
func create(ctx context.Context, opts Options, initData func(*Cluster) error) (*Cluster, error) {
	c, err := newCluster(opts)
	if err != nil {
		return nil, err
	}
	if err := initData(c); err != nil {
		_ = os.RemoveAll(c.dir)
		return nil, err
	}
	if err := c.start(ctx, opts); err != nil {
		_ = os.RemoveAll(c.dir)
		return nil, err
	}
	return c, nil
}

func newCluster(opts Options) (*Cluster, error) {
	bindir, err := findBinDir()
	if err != nil {
		return nil, err
	}
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		// initdb and postgres refuse to run as root: run them as an
		// unprivileged user that owns the directory.
		if cred, err = unprivilegedCredential(); err != nil {
			return nil, err
		}
	}
	// Short path: Unix socket paths are limited to about 100 bytes.
	dir, err := MkdirTemp("apg", cred)
	if err != nil {
		return nil, err
	}
	return &Cluster{dir: dir, dataDir: filepath.Join(dir, "data"), sockDir: dir, bindir: bindir, cred: cred,
		port: cmp.Or(opts.Port, 5432)}, nil
}

// start starts the server on c.dataDir with opts' settings.
func (c *Cluster) start(ctx context.Context, opts Options) error {
	settings := map[string]string{
		"listen_addresses":          "''",
		"unix_socket_directories":   "'" + c.sockDir + "'",
		"port":                      strconv.Itoa(c.port),
		"max_connections":           "200",
		"shared_buffers":            "128MB",
		"max_locks_per_transaction": "256",
	}
	if !opts.Durable {
		settings["fsync"] = "off"
		settings["synchronous_commit"] = "off"
		settings["full_page_writes"] = "off"
	}
	for k, v := range opts.Settings {
		settings[k] = v
	}
	names := make([]string, 0, len(settings))
	for k := range settings {
		names = append(names, k)
	}
	sort.Strings(names)
	var o strings.Builder
	for _, k := range names {
		fmt.Fprintf(&o, " -c %s=%s", k, settings[k])
	}
	c.options = o.String()
	if err := c.run(ctx, "pg_ctl", "-D", c.dataDir, "-l", filepath.Join(c.dir, "server.log"),
		"-w", "-t", "60", "-o", c.options, "start"); err != nil {
		logTail, _ := os.ReadFile(filepath.Join(c.dir, "server.log"))
		return fmt.Errorf("%w\nserver log:\n%s", err, logTail)
	}
	return nil
}

// ConnString returns a connection string for database name on this cluster.
func (c *Cluster) ConnString(database string) string {
	return fmt.Sprintf("host=%s port=%d user=postgres dbname=%s sslmode=disable", c.sockDir, c.port, database)
}

// ConnStringReadWrite returns a multi-host connection string for database
// on the given clusters, in order, with target_session_attrs=read-write: a
// client connects to whichever of them is the primary now, as after a
// failover it must.
func ConnStringReadWrite(database string, clusters ...*Cluster) string {
	hosts := make([]string, len(clusters))
	ports := make([]string, len(clusters))
	for i, c := range clusters {
		hosts[i], ports[i] = c.sockDir, strconv.Itoa(c.port)
	}
	return fmt.Sprintf("host=%s port=%s user=postgres dbname=%s sslmode=disable target_session_attrs=read-write",
		strings.Join(hosts, ","), strings.Join(ports, ","), database)
}

// Promote promotes a standby to a primary (pg_ctl promote) and waits until
// it accepts writes.
func (c *Cluster) Promote(ctx context.Context) error {
	return c.run(ctx, "pg_ctl", "-D", c.dataDir, "-w", "-t", "60", "promote")
}

// DataDir returns the cluster's data directory.
func (c *Cluster) DataDir() string { return c.dataDir }

// Restart stops the server with the given shutdown mode ("smart", "fast" or
// "immediate") and starts it again on the same data directory.
func (c *Cluster) Restart(ctx context.Context, mode string) error {
	if err := c.run(ctx, "pg_ctl", "-D", c.dataDir, "-m", mode, "-w", "stop"); err != nil {
		return err
	}
	return c.run(ctx, "pg_ctl", "-D", c.dataDir, "-l", filepath.Join(c.dir, "server.log"), "-w", "-t", "60", "-o", c.options, "start")
}

// Stop shuts the server down immediately and deletes its directory.
func (c *Cluster) Stop() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var err error
	if !c.killed {
		err = c.run(ctx, "pg_ctl", "-D", c.dataDir, "-m", "immediate", "-w", "stop")
	}
	if rmErr := os.RemoveAll(c.dir); err == nil {
		err = rmErr
	}
	return err
}

func (c *Cluster) run(ctx context.Context, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, filepath.Join(c.bindir, name), args...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	cmd.Dir = c.dir
	// The server outlives this command; keep it out of our process group so
	// a terminal's Ctrl-C reaches us first and we stop it cleanly.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: c.cred}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("pgcluster: %s: %w: %s", name, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// MkdirTemp creates a temporary directory for a server program run with
// cred (nil: as this process), owned by cred's user, in os.TempDir(); or in
// /tmp when the user could not reach a directory there (a private TMPDIR of
// root's, such as mktemp -d makes).
func MkdirTemp(prefix string, cred *syscall.Credential) (string, error) {
	bases := []string{os.TempDir()}
	if cred != nil && filepath.Clean(os.TempDir()) != "/tmp" {
		bases = append(bases, "/tmp")
	}
	var closed []string
	for _, base := range bases {
		if cred != nil && !reachable(base, cred) {
			closed = append(closed, base)
			continue
		}
		dir, err := os.MkdirTemp(base, prefix)
		if err != nil {
			return "", fmt.Errorf("pgcluster: temp dir: %w", err)
		}
		if cred != nil {
			if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
				_ = os.RemoveAll(dir)
				return "", fmt.Errorf("pgcluster: chown: %w", err)
			}
		}
		return dir, nil
	}
	return "", fmt.Errorf("pgcluster: user %d cannot reach a temp dir (%s); set TMPDIR to a directory it can reach",
		cred.Uid, strings.Join(closed, ", "))
}

// reachable reports whether cred's user may traverse every directory from
// the root down to dir.
func reachable(dir string, cred *syscall.Credential) bool {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return false
	}
	for p := dir; ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
		if err != nil {
			return false
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return true
		}
		mode := fi.Mode().Perm()
		switch {
		case st.Uid == cred.Uid:
			if mode&0o100 == 0 {
				return false
			}
		case st.Gid == cred.Gid:
			if mode&0o010 == 0 {
				return false
			}
		case mode&0o001 == 0:
			return false
		}
		if p == filepath.Dir(p) {
			return true
		}
	}
}

// UnprivilegedCredential returns the user (postgres, else nobody) to run
// server programs as when this process runs as root, which PostgreSQL and
// PgBouncer refuse to run as.
func UnprivilegedCredential() (*syscall.Credential, error) { return unprivilegedCredential() }

func unprivilegedCredential() (*syscall.Credential, error) {
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
	return nil, errors.New("pgcluster: running as root and no unprivileged user (postgres, nobody) to run PostgreSQL as")
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
	sort.Slice(candidates, func(i, j int) bool { return versionOf(candidates[i]) > versionOf(candidates[j]) })
	candidates = append(candidates, "/usr/local/pgsql/bin", "/opt/homebrew/bin", "/usr/local/bin", "/usr/bin")
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			candidates = append([]string{filepath.Dir(real)}, candidates...)
		}
	}
	for _, dir := range candidates {
		if has(dir) {
			return dir, nil
		}
	}
	return "", ErrNoBinaries
}

func versionOf(bindir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(bindir)))
	return v
}
