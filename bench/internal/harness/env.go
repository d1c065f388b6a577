// Package harness runs the benchmark scenarios: it provides the database
// and the NATS server, drives a closed-loop load at a fixed concurrency for
// a fixed time, and summarises throughput and latency.
package harness

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/atomicphase/atomicphase/internal/pgcluster"
)

// Environment variables the harness reads.
const (
	// EnvDatabaseURL names the database to benchmark against (created if
	// missing). Without it a throwaway cluster is started from the local
	// PostgreSQL binaries.
	EnvDatabaseURL = "BENCH_DATABASE_URL"
	// EnvNATSURL names a JetStream-enabled NATS server. Without it an
	// in-process server is started.
	EnvNATSURL = "BENCH_NATS_URL"
)

// Env is the database and broker one benchmark run uses.
type Env struct {
	// DatabaseURL connects to the benchmark database.
	DatabaseURL string
	// NATSURL connects to a JetStream-enabled NATS server.
	NATSURL string
	// Source says where the database came from, for the report.
	Source string
	// ExecMode is the pgx query exec mode of every pool NewPool opens; the
	// zero value is pgx's default, cache_statement.
	ExecMode pgx.QueryExecMode

	stops []func()
}

// Discard is a logger that drops everything, given to every library under
// test so that none pays for log output.
var Discard = slog.New(slog.DiscardHandler)

// Setup provides the database (and, if needNATS, the NATS server).
// pgSettings are extra settings for a throwaway cluster (ignored with
// BENCH_DATABASE_URL).
func Setup(ctx context.Context, needNATS bool, pgSettings map[string]string) (*Env, error) {
	e := &Env{}
	if u := os.Getenv(EnvDatabaseURL); u != "" {
		if err := createDatabase(ctx, u); err != nil {
			return nil, err
		}
		e.DatabaseURL, e.Source = u, EnvDatabaseURL
	} else {
		settings := clusterSettings()
		for k, v := range pgSettings {
			settings[k] = v
		}
		srv, err := pgcluster.Start(ctx, pgcluster.Options{Durable: true, Settings: settings})
		if err != nil {
			return nil, err
		}
		e.stops = append(e.stops, func() { _ = srv.Stop() })
		if err := createDatabase(ctx, srv.ConnString("bench")); err != nil {
			e.Close()
			return nil, err
		}
		e.DatabaseURL, e.Source = srv.ConnString("bench"), "throwaway local cluster"
	}
	if needNATS {
		if u := os.Getenv(EnvNATSURL); u != "" {
			e.NATSURL = u
		} else {
			dir, err := os.MkdirTemp("", "apbench-nats")
			if err != nil {
				e.Close()
				return nil, err
			}
			s, err := server.NewServer(&server.Options{
				Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true,
				StoreDir: dir, NoLog: true, NoSigs: true,
			})
			if err != nil {
				e.Close()
				return nil, err
			}
			s.Start()
			e.stops = append(e.stops, func() { s.Shutdown(); s.WaitForShutdown(); _ = os.RemoveAll(dir) })
			if !s.ReadyForConnections(10 * time.Second) {
				e.Close()
				return nil, errors.New("harness: in-process NATS server did not start")
			}
			e.NATSURL = s.ClientURL()
		}
	}
	return e, nil
}

// Close stops whatever Setup started.
func (e *Env) Close() {
	for i := len(e.stops) - 1; i >= 0; i-- {
		e.stops[i]()
	}
	e.stops = nil
}

// createDatabase creates the database connString names if it does not exist,
// connecting to the server's postgres database to do so.
func createDatabase(ctx context.Context, connString string) error {
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return fmt.Errorf("harness: parse database URL: %w", err)
	}
	name := cfg.Database
	if name == "" {
		return errors.New("harness: the database URL names no database")
	}
	cfg.Database = "postgres"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("harness: connect to %s: %w", redact(connString), err)
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return fmt.Errorf("harness: look up database: %w", err)
	}
	if exists {
		return nil
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("harness: create database %s: %w", name, err)
	}
	return nil
}

func redact(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.User == nil {
		return s
	}
	if _, ok := u.User.Password(); ok {
		u.User = url.UserPassword(u.User.Username(), "xxx")
	}
	return u.String()
}

// NewPool opens a pool of at most maxConns connections whose queries are
// counted by the returned tracer.
func (e *Env) NewPool(ctx context.Context, maxConns int) (*pgxpool.Pool, *Counter, error) {
	cfg, err := pgxpool.ParseConfig(e.DatabaseURL)
	if err != nil {
		return nil, nil, err
	}
	cfg.MaxConns = int32(maxConns)
	cfg.MinConns = 0
	if e.ExecMode != 0 {
		cfg.ConnConfig.DefaultQueryExecMode = e.ExecMode
	}
	ctr := &Counter{}
	cfg.ConnConfig.Tracer = ctr
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, nil, err
	}
	return pool, ctr, nil
}

// ServerInfo describes the database server for the report.
func (e *Env) ServerInfo(ctx context.Context) string {
	conn, err := pgx.Connect(ctx, e.DatabaseURL)
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	defer conn.Close(ctx)
	var parts []string
	var v string
	if err := conn.QueryRow(ctx, "SHOW server_version").Scan(&v); err == nil {
		parts = append(parts, "PostgreSQL "+strings.Fields(v)[0])
	}
	for _, s := range []string{"fsync", "synchronous_commit", "full_page_writes", "shared_buffers", "max_connections", "wal_level"} {
		var val string
		if err := conn.QueryRow(ctx, "SELECT current_setting($1)", s).Scan(&val); err == nil {
			parts = append(parts, s+"="+val)
		}
	}
	return strings.Join(parts, ", ")
}

// clusterSettings are the throwaway cluster's settings for benchmarks:
// durable commits (fsync, synchronous_commit and full_page_writes stay on,
// so figures are honest), room for every scenario's connections, and a WAL
// budget large enough that bulk loads between cells do not force
// checkpoints (each cell starts with an explicit CHECKPOINT).
func clusterSettings() map[string]string {
	return map[string]string{
		"max_connections": "300",
		"shared_buffers":  "128MB",
		"max_wal_size":    "2GB",
	}
}
