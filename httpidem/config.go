package httpidem

import (
	"cmp"
	"fmt"
	"log/slog"
	"net/http"
)

// MaxBodyBytesDefault is Config.MaxBodyBytes's default.
const MaxBodyBytesDefault = 1 << 20

// Config configures the middleware. Scope is required; every other field
// has a default.
type Config struct {
	// Scope returns the authenticated principal a request's key belongs to
	// (account, user, tenant): keys are unique only within a scope, so one
	// client never sees another's stored response. An error answers 401, and
	// so does an empty scope unless AllowAnonymous is set. A scope must be at
	// most 255 bytes of UTF-8 without NUL (else 400). Required.
	Scope func(r *http.Request) (string, error)

	// AllowAnonymous lets requests whose Scope is "" run, all in one shared
	// keyspace: any caller without a principal can then replay any other's
	// stored response by sending the same key. Set it only for endpoints
	// whose responses reveal nothing (or whose keys are unguessable and
	// private to each client). Default: false, an empty scope answers 401.
	AllowAnonymous bool

	// Required reports whether a request must carry an Idempotency-Key.
	// GET, HEAD and OPTIONS never need one and are passed through whatever
	// this says. Default: POST and PATCH.
	Required func(r *http.Request) bool

	// MaxBodyBytes is the largest request body accepted; a larger one is
	// answered 413 before anything is stored.
	// Default: MaxBodyBytesDefault (1 MiB).
	MaxBodyBytes int64

	// StoreHeaders are the response headers stored with a response and
	// replayed with it; a keyed response carries only these, so the first
	// answer and every replay are the same. A rejection that is not stored
	// (see txn.Config.Store) is passed through with all its headers.
	// Default: Content-Type and Location.
	StoreHeaders []string

	// Logger receives what the runner does not log: a Scope that failed,
	// and requests the server could not run at all (a workflow not
	// registered, invalid use). Transient failures are logged once, by the
	// runner. Default: slog.Default().
	Logger *slog.Logger
}

// withDefaults returns c with each unset field set to its default.
func (c Config) withDefaults() Config {
	if c.Required == nil {
		c.Required = func(r *http.Request) bool { return r.Method == http.MethodPost || r.Method == http.MethodPatch }
	}
	c.MaxBodyBytes = cmp.Or(c.MaxBodyBytes, MaxBodyBytesDefault)
	if c.StoreHeaders == nil {
		c.StoreHeaders = []string{"Content-Type", "Location"}
	}
	c.Logger = cmp.Or(c.Logger, slog.Default())
	return c
}

// validate reports a missing or out-of-range field, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	switch {
	case c.Scope == nil:
		return fmt.Errorf("%w: %w", ErrInvalidConfig, ErrNoScope)
	case c.MaxBodyBytes < 0:
		return fmt.Errorf("%w: MaxBodyBytes is negative", ErrInvalidConfig)
	}
	return nil
}
