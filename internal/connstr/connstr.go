// Package connstr edits PostgreSQL connection strings without touching their
// text: a string, in URL or keyword/value form, is parsed with
// pgx.ParseConfig, changed as a configuration, and rendered back as a
// keyword/value string that pgx (and libpq, for the settings both know)
// reads as the same configuration.
//
// Tests and the examples use it to hand a child process (the reaper, the
// rocketrides service) a connection string scoped to one schema or routed
// through a proxy.
package connstr

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// ErrUnrenderable reports a configuration that has no faithful
// keyword/value form, such as certificate verification, whose files are read
// when the string is parsed and not kept in the configuration.
var ErrUnrenderable = errors.New("connstr: configuration cannot be rendered as a connection string")

// WithSearchPath returns connString with search_path set to schema for every
// session, through the options startup parameter (kept, if connString had
// one). connString may be a URL or keyword/value pairs.
func WithSearchPath(connString, schema string) (string, error) {
	return Edit(connString, func(cfg *pgx.ConnConfig) {
		SetSearchPath(cfg, schema)
	})
}

// SetSearchPath sets search_path to schema in cfg's options startup
// parameter, after any options cfg already has.
func SetSearchPath(cfg *pgx.ConnConfig, schema string) {
	opt := "-c search_path=" + escapeOption(schema)
	if prev := cfg.RuntimeParams["options"]; prev != "" {
		opt = prev + " " + opt
	}
	cfg.RuntimeParams["options"] = opt
}

// escapeOption escapes the characters the server splits the options
// parameter on (white space) and its escape character.
func escapeOption(s string) string {
	var b strings.Builder
	for _, r := range s {
		if r == '\\' || r == ' ' || r == '\t' || r == '\n' || r == '\r' {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// Edit parses connString, lets edit change the configuration, and renders
// the result.
func Edit(connString string, edit func(*pgx.ConnConfig)) (string, error) {
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return "", fmt.Errorf("connstr: %w", err)
	}
	edit(cfg)
	return Format(cfg)
}

// Format renders cfg as a keyword/value connection string: hosts and ports
// (with fallbacks), database, user, password, sslmode, connect_timeout,
// pgx's statement cache settings, and every runtime parameter. It returns
// an error wrapping ErrUnrenderable for TLS that verifies certificates or
// presents one, and for target_session_attrs.
func Format(cfg *pgx.ConnConfig) (string, error) {
	if cfg.ValidateConnect != nil {
		return "", fmt.Errorf("%w: it has target_session_attrs", ErrUnrenderable)
	}
	type target struct {
		host string
		port uint16
	}
	var targets []target
	seen := map[target]bool{}
	add := func(host string, port uint16) {
		t := target{host, port}
		if !seen[t] {
			seen[t] = true
			targets = append(targets, t)
		}
	}
	add(cfg.Host, cfg.Port)
	for _, fb := range cfg.Fallbacks {
		add(fb.Host, fb.Port)
	}

	sslmode, err := sslMode(cfg)
	if err != nil {
		return "", err
	}

	var hosts, ports []string
	for _, t := range targets {
		hosts = append(hosts, t.host)
		ports = append(ports, strconv.Itoa(int(t.port)))
	}
	pairs := [][2]string{
		{"host", strings.Join(hosts, ",")},
		{"port", strings.Join(ports, ",")},
		{"dbname", cfg.Database},
		{"user", cfg.User},
	}
	if cfg.Password != "" {
		pairs = append(pairs, [2]string{"password", cfg.Password})
	}
	pairs = append(pairs, [2]string{"sslmode", sslmode})
	if cfg.ConnectTimeout > 0 {
		secs := int64((cfg.ConnectTimeout + 999_999_999) / 1_000_000_000)
		pairs = append(pairs, [2]string{"connect_timeout", strconv.FormatInt(secs, 10)})
	}
	if cfg.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		name, ok := execModeNames[cfg.DefaultQueryExecMode]
		if !ok {
			return "", fmt.Errorf("%w: unknown query exec mode %v", ErrUnrenderable, cfg.DefaultQueryExecMode)
		}
		pairs = append(pairs, [2]string{"default_query_exec_mode", name})
	}
	if cfg.StatementCacheCapacity != 512 {
		pairs = append(pairs, [2]string{"statement_cache_capacity", strconv.Itoa(cfg.StatementCacheCapacity)})
	}
	if cfg.DescriptionCacheCapacity != 512 {
		pairs = append(pairs, [2]string{"description_cache_capacity", strconv.Itoa(cfg.DescriptionCacheCapacity)})
	}
	for _, k := range slices.Sorted(maps.Keys(cfg.RuntimeParams)) {
		pairs = append(pairs, [2]string{k, cfg.RuntimeParams[k]})
	}

	var b strings.Builder
	for i, p := range pairs {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(p[0])
		b.WriteString("='")
		for _, r := range p[1] {
			if r == '\'' || r == '\\' {
				b.WriteByte('\\')
			}
			b.WriteRune(r)
		}
		b.WriteByte('\'')
	}
	return b.String(), nil
}

// execModeNames are the default_query_exec_mode values pgx.ParseConfig reads.
var execModeNames = map[pgx.QueryExecMode]string{
	pgx.QueryExecModeCacheStatement: "cache_statement",
	pgx.QueryExecModeCacheDescribe:  "cache_describe",
	pgx.QueryExecModeDescribeExec:   "describe_exec",
	pgx.QueryExecModeExec:           "exec",
	pgx.QueryExecModeSimpleProtocol: "simple_protocol",
}

// ExecModeName returns the default_query_exec_mode value that selects mode.
func ExecModeName(mode pgx.QueryExecMode) string { return execModeNames[mode] }

// sslMode names the sslmode that pgx turns into cfg's TLS attempts: the
// primary configuration and, for allow and prefer, a fallback to the same
// host with the other choice.
func sslMode(cfg *pgx.ConnConfig) (string, error) {
	plain := cfg.TLSConfig == nil
	var fallbackPlain, fallbackTLS bool
	for _, fb := range cfg.Fallbacks {
		if fb.Host != cfg.Host || fb.Port != cfg.Port {
			continue
		}
		if fb.TLSConfig == nil {
			fallbackPlain = true
		} else {
			fallbackTLS = true
		}
	}
	switch {
	case plain && fallbackTLS:
		return "allow", nil
	case plain:
		return "disable", nil
	case cfg.TLSConfig.VerifyPeerCertificate != nil || !cfg.TLSConfig.InsecureSkipVerify ||
		len(cfg.TLSConfig.Certificates) > 0 || cfg.TLSConfig.GetClientCertificate != nil:
		return "", fmt.Errorf("%w: it verifies certificates or presents one", ErrUnrenderable)
	case fallbackPlain:
		return "prefer", nil
	default:
		return "require", nil
	}
}
