// Package pgbouncer runs a real PgBouncer in transaction pooling mode in
// front of a PostgreSQL server, for tests: configuration, user list, log and
// pid file live in a fresh temporary directory, removed by Stop.
//
// Any database name a client asks for is passed through to the server (a
// "*" entry), so a test can have a database of its own (pgtest.NewDatabase)
// and reach it through the bouncer: PgBouncer 1.18 does not pass a
// search_path (or any options) startup parameter on, so a schema per test
// cannot be chosen per connection.
//
// The configuration is deliberately unkind to session state:
// server_round_robin = 1 hands consecutive transactions of one client to
// different server connections whenever several are idle, so that anything
// relying on a session (a session advisory lock, a named prepared statement,
// a SET, a statement described in one round trip and executed in the next)
// fails at once rather than now and then.
package pgbouncer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/internal/connstr"
	"github.com/atomicphase/atomicphase/internal/pgcluster"
)

// errExited reports a PgBouncer that exited while starting.
var errExited = errors.New("pgbouncer: exited while starting")

// ErrNotInstalled reports that no pgbouncer binary was found.
var ErrNotInstalled = errors.New("pgbouncer: not installed (Debian, Ubuntu: apt-get install pgbouncer; or set PGBOUNCER to its path)")

// Options tunes the bouncer. The zero value suits the tests.
type Options struct {
	// PoolSize is default_pool_size: server connections per database and
	// user. Default: 20.
	PoolSize int
	// Settings are extra [pgbouncer] settings (name -> value).
	Settings map[string]string
}

// Bouncer is a running PgBouncer.
type Bouncer struct {
	dir     string
	port    int
	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
}

// Find returns the path of the pgbouncer binary: $PGBOUNCER, else the first
// pgbouncer on PATH or in the system folders Debian installs it to.
func Find() (string, error) {
	if p := os.Getenv("PGBOUNCER"); p != "" {
		return p, nil
	}
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer", "/usr/local/bin/pgbouncer", "/opt/homebrew/bin/pgbouncer"} {
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
			return p, nil
		}
	}
	return "", ErrNotInstalled
}

// Start runs a PgBouncer in front of the server serverConnString points at
// (URL or keyword/value), logging in to it as that string's user with its
// password. Clients connect to Addr as the same user, without a password,
// and name any database of the server.
func Start(ctx context.Context, serverConnString string, opts Options) (*Bouncer, error) {
	bin, err := Find()
	if err != nil {
		return nil, err
	}
	server, err := pgx.ParseConfig(serverConnString)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: server connection string: %w", err)
	}
	if server.TLSConfig != nil && !hasPlainFallback(server) {
		return nil, errors.New("pgbouncer: the test server requires TLS; the harness connects without")
	}
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		// PgBouncer refuses to run as root.
		if cred, err = pgcluster.UnprivilegedCredential(); err != nil {
			return nil, fmt.Errorf("pgbouncer: %w", err)
		}
	}
	dir, err := pgcluster.MkdirTemp("apgb", cred)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: %w", err)
	}
	// The free port is found by binding and releasing it, so another
	// process may take it before PgBouncer binds it: try a few.
	for attempt := 1; ; attempt++ {
		b := &Bouncer{dir: dir, done: make(chan struct{})}
		err := b.start(ctx, bin, server, opts, cred)
		if err == nil {
			return b, nil
		}
		if !errors.Is(err, errExited) || attempt == 3 {
			_ = os.RemoveAll(dir)
			return nil, err
		}
	}
}

func hasPlainFallback(cfg *pgx.ConnConfig) bool {
	for _, fb := range cfg.Fallbacks {
		if fb.TLSConfig == nil {
			return true
		}
	}
	return false
}

// quote quotes a value for a PgBouncer connection string or setting.
func quote(v string) string {
	return "'" + strings.ReplaceAll(v, "'", "''") + "'"
}

func (b *Bouncer) start(ctx context.Context, bin string, server *pgx.ConnConfig, opts Options, cred *syscall.Credential) error {
	port, err := freePort()
	if err != nil {
		return err
	}
	b.port = port

	target := "host=" + quote(server.Host) + " port=" + strconv.Itoa(int(server.Port)) + " user=" + quote(server.User)
	if server.Password != "" {
		target += " password=" + quote(server.Password)
	}
	settings := map[string]string{
		"listen_addr":        "127.0.0.1",
		"listen_port":        strconv.Itoa(port),
		"unix_socket_dir":    "",
		"auth_type":          "trust",
		"auth_file":          filepath.Join(b.dir, "userlist.txt"),
		"pool_mode":          "transaction",
		"default_pool_size":  strconv.Itoa(max(opts.PoolSize, 0)),
		"max_client_conn":    "2000",
		"max_db_connections": "0",
		"server_round_robin": "1",
		"logfile":            filepath.Join(b.dir, "pgbouncer.log"),
		"pidfile":            filepath.Join(b.dir, "pgbouncer.pid"),
		"admin_users":        server.User,
		"server_login_retry": "1",
		"log_connections":    "0",
		"log_disconnections": "0",
	}
	if opts.PoolSize == 0 {
		settings["default_pool_size"] = "20"
	}
	for k, v := range opts.Settings {
		settings[k] = v
	}
	var ini bytes.Buffer
	fmt.Fprintf(&ini, "[databases]\n* = %s\n\n[pgbouncer]\n", target)
	for _, k := range slices.Sorted(maps.Keys(settings)) {
		fmt.Fprintf(&ini, "%s = %s\n", k, settings[k])
	}
	iniPath := filepath.Join(b.dir, "pgbouncer.ini")
	if err := os.WriteFile(iniPath, ini.Bytes(), 0o600); err != nil {
		return fmt.Errorf("pgbouncer: write config: %w", err)
	}
	users := fmt.Sprintf("%q \"\"\n", server.User)
	if err := os.WriteFile(settings["auth_file"], []byte(users), 0o600); err != nil {
		return fmt.Errorf("pgbouncer: write user list: %w", err)
	}

	cmd := exec.Command(bin, iniPath)
	cmd.Dir = b.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if cred != nil {
		cmd.SysProcAttr.Credential = cred
		for _, p := range []string{iniPath, settings["auth_file"]} {
			if err := os.Chown(p, int(cred.Uid), int(cred.Gid)); err != nil {
				return fmt.Errorf("pgbouncer: chown: %w", err)
			}
		}
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pgbouncer: start %s: %w", bin, err)
	}
	b.cmd = cmd
	go func() {
		b.waitErr = cmd.Wait()
		close(b.done)
	}()

	// Ready when a query through it reaches the server.
	probe := server.Copy()
	probe.Host, probe.Port, probe.Password = "127.0.0.1", uint16(port), ""
	probe.TLSConfig, probe.Fallbacks = nil, nil
	probe.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := ping(ctx, probe)
		if err == nil {
			return nil
		}
		select {
		case <-b.done:
			logText, _ := os.ReadFile(settings["logfile"])
			return fmt.Errorf("%w: %v\n%s%s", errExited, b.waitErr, out.String(), logText)
		default:
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			b.Stop()
			logText, _ := os.ReadFile(settings["logfile"])
			return fmt.Errorf("pgbouncer: not ready: %w\n%s", err, logText)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func ping(ctx context.Context, cfg *pgx.ConnConfig) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, "SELECT 1")
	return err
}

// Addr returns the host:port clients connect to.
func (b *Bouncer) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port)) }

// Port returns the port clients connect to.
func (b *Bouncer) Port() int { return b.port }

// Config returns a client configuration that reaches database through the
// bouncer: serverConnString's user and settings with the bouncer's address,
// no TLS, and mode as pgx's default query exec mode.
func (b *Bouncer) Config(serverConnString, database string, mode pgx.QueryExecMode) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(serverConnString)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: %w", err)
	}
	cfg.Host, cfg.Port, cfg.Password = "127.0.0.1", uint16(b.port), ""
	cfg.TLSConfig, cfg.Fallbacks = nil, nil
	if database != "" {
		cfg.Database = database
	}
	cfg.DefaultQueryExecMode = mode
	return cfg, nil
}

// ConnString is Config rendered as a connection string, for other processes.
func (b *Bouncer) ConnString(serverConnString, database string, mode pgx.QueryExecMode) (string, error) {
	cfg, err := b.Config(serverConnString, database, mode)
	if err != nil {
		return "", err
	}
	return connstr.Format(cfg)
}

// Log returns what PgBouncer logged so far.
func (b *Bouncer) Log() string {
	text, _ := os.ReadFile(filepath.Join(b.dir, "pgbouncer.log"))
	return string(text)
}

// Stop shuts PgBouncer down and removes its directory.
func (b *Bouncer) Stop() {
	if b.cmd != nil && b.cmd.Process != nil {
		_ = b.cmd.Process.Signal(syscall.SIGINT) // immediate shutdown
		select {
		case <-b.done:
		case <-time.After(10 * time.Second):
			_ = b.cmd.Process.Kill()
			<-b.done
		}
	}
	_ = os.RemoveAll(b.dir)
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgbouncer: free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}
