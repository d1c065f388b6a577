package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// connectTimeout bounds connecting to the database.
const connectTimeout = 10 * time.Second

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// env is what a command runs with.
type env struct {
	ctx            context.Context
	stdin          io.Reader
	stdout, stderr io.Writer
	databaseURL    string
	json           bool
	yes            bool
	pool           *pgxpool.Pool // connected by connect
}

// command is one subcommand.
type command struct {
	name, args, summary string
	// define defines the command's own flags and returns the function
	// that does the work, with the flags' values and the positional
	// arguments.
	define func(fs *flag.FlagSet) func(e *env, args []string) error
	// writes: the command changes data, so it takes --yes.
	writes bool
}

var commands = []*command{
	keysShow, keysStalled, keysFail,
	outboxStatus, outboxDead, outboxRedrive,
	migrationsExport,
}

// run is the whole command, minus signal handling: it returns the exit
// code.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	e := &env{ctx: ctx, stdin: stdin, stdout: stdout, stderr: stderr}
	defer func() {
		if e.pool != nil {
			e.pool.Close()
		}
	}()
	err := dispatch(e, args)
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		return exitOK
	case errors.Is(err, errUsage):
		fmt.Fprintf(stderr, "atomicphase: %s\nRun 'atomicphase help' for usage.\n", oneLine(err.Error()))
		return exitUsage
	default:
		fmt.Fprintf(stderr, "atomicphase: %s\n", oneLine(err.Error()))
		return exitFailure
	}
}

func dispatch(e *env, args []string) error {
	top := flag.NewFlagSet("atomicphase", flag.ContinueOnError)
	top.SetOutput(io.Discard)
	globalFlags(e, top)
	if err := top.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			usage(e.stdout)
			return err
		}
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	args = top.Args()
	if len(args) == 0 || args[0] == "help" {
		usage(e.stdout)
		if len(args) == 0 {
			return fmt.Errorf("%w: no command given", errUsage)
		}
		return nil
	}
	var group []*command
	for _, c := range commands {
		if strings.HasPrefix(c.name, args[0]+" ") {
			group = append(group, c)
		}
	}
	if len(group) == 0 {
		return fmt.Errorf("%w: unknown command %q", errUsage, args[0])
	}
	if len(args) < 2 {
		return fmt.Errorf("%w: %s needs a subcommand: %s", errUsage, args[0], subcommands(group))
	}
	for _, c := range group {
		if c.name == args[0]+" "+args[1] {
			return runCommand(e, c, args[2:])
		}
	}
	return fmt.Errorf("%w: unknown command %q: %s takes %s", errUsage, args[0]+" "+args[1], args[0], subcommands(group))
}

func subcommands(group []*command) string {
	var names []string
	for _, c := range group {
		_, sub, _ := strings.Cut(c.name, " ")
		names = append(names, sub)
	}
	return strings.Join(names, ", ")
}

func runCommand(e *env, c *command, args []string) error {
	fs := flag.NewFlagSet("atomicphase "+c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	globalFlags(e, fs)
	if c.writes {
		fs.BoolVar(&e.yes, "yes", false, "do it without asking for confirmation")
	}
	do := c.define(fs)
	pos, err := parseToEnd(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprintf(e.stdout, "Usage: atomicphase %s %s\n\n%s\n\nFlags:\n", c.name, c.args, c.summary)
		fs.SetOutput(e.stdout)
		fs.PrintDefaults()
		return err
	}
	if err != nil {
		return fmt.Errorf("%w: %s: %w", errUsage, c.name, err)
	}
	if err := do(e, pos); err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	return nil
}

func globalFlags(e *env, fs *flag.FlagSet) {
	def := e.databaseURL // given before the command
	if def == "" {
		def = os.Getenv("DATABASE_URL")
	}
	fs.StringVar(&e.databaseURL, "database-url", def, "PostgreSQL connection URL ($DATABASE_URL)")
	if def := fs.Lookup("database-url"); def.DefValue != "" {
		def.DefValue = "$DATABASE_URL" // never print a password
	}
	fs.BoolVar(&e.json, "json", e.json, "print JSON instead of tables")
}

// parseToEnd parses flags wherever they are among the arguments, and
// returns the positional ones; "--" ends the flags.
func parseToEnd(fs *flag.FlagSet, args []string) ([]string, error) {
	var rest []string
	for i, a := range args {
		if a == "--" {
			args, rest = args[:i], args[i+1:]
			break
		}
	}
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			return append(pos, rest...), nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

// connect opens the pool and checks that the database answers. Commands
// call it once their arguments are checked: bad input is a usage error
// whether or not the database answers.
func (e *env) connect() error {
	if e.pool != nil {
		return nil
	}
	if e.databaseURL == "" {
		return fmt.Errorf("%w: no database: set --database-url or DATABASE_URL", errUsage)
	}
	cfg, err := pgxpool.ParseConfig(e.databaseURL)
	if err != nil {
		return fmt.Errorf("%w: invalid database URL: %w", errUsage, err)
	}
	cfg.MaxConns = 2
	if cfg.ConnConfig.ConnectTimeout == 0 || cfg.ConnConfig.ConnectTimeout > connectTimeout {
		cfg.ConnConfig.ConnectTimeout = connectTimeout
	}
	pool, err := pgxpool.NewWithConfig(e.ctx, cfg)
	if err != nil {
		return fmt.Errorf("cannot connect to the database: %w", err)
	}
	e.pool = pool
	ctx, cancel := context.WithTimeout(e.ctx, connectTimeout)
	defer cancel()
	if err := pool.Ping(ctx); err != nil {
		return fmt.Errorf("cannot connect to the database: %w", err)
	}
	return nil
}

func usage(w io.Writer) {
	fmt.Fprint(w, `Usage: atomicphase [--database-url URL] [--json] COMMAND [ARGS] [FLAGS]

Inspect idempotency keys and the outbox of an atomicphase installation,
fail a stuck key, redrive dead letters, export the migrations.

Commands:
`)
	for _, c := range commands {
		fmt.Fprintf(w, "  %-42s %s\n", c.name+" "+c.args, c.summary)
	}
	fmt.Fprint(w, `
Every command takes --database-url (default $DATABASE_URL) and --json.
The writes (keys fail, outbox redrive) ask for confirmation unless --yes.
'atomicphase COMMAND -h' lists a command's flags.

Exit status: 0 done, 1 failure, 2 usage error.
`)
}

// errUsage marks a command line the command cannot run with; run answers
// it with exit status 2.
var errUsage = errors.New("usage error")

// oneLine folds an error message onto one line, its control characters
// escaped.
func oneLine(s string) string {
	return safe(lineBreaks.Replace(strings.TrimSpace(s)))
}

var lineBreaks = strings.NewReplacer(":\n\t", ": ", "\r\n", "; ", "\n\t", "; ", "\n", "; ", "\t", " ")
