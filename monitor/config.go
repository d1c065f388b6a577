package monitor

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"
)

// The defaults of Config's fields, used for the fields left zero.
const (
	// StalledAfterDefault is the Resumer's default ResumeDelay
	// (recovery.ResumeDelayDefault).
	StalledAfterDefault = time.Minute
	QueryTimeoutDefault = 5 * time.Second
)

// Config configures Read and RegisterGauges. The zero value is usable;
// every field states its default.
type Config struct {
	// MeterProvider is where RegisterGauges registers the gauges.
	// Default: the global provider, otel.GetMeterProvider().
	MeterProvider metric.MeterProvider

	// StalledAfter is how long after its last run a running key with a free
	// or expired lease counts as stalled: give it the Resumer's
	// ResumeDelay. Default: StalledAfterDefault (1 minute).
	StalledAfter time.Duration

	// QueryTimeout bounds each read the gauges make at a collection.
	// Default: QueryTimeoutDefault (5 seconds).
	QueryTimeout time.Duration

	// Logger receives a warning when a collection cannot read the figures
	// (the gauges then report nothing for that collection). Default:
	// slog.Default().
	Logger *slog.Logger
}

// withDefaults returns *c (the zero Config when c is nil) with each zero
// field set to its default.
func (c *Config) withDefaults() Config {
	var cfg Config
	if c != nil {
		cfg = *c
	}
	cfg.StalledAfter = cmp.Or(cfg.StalledAfter, StalledAfterDefault)
	cfg.QueryTimeout = cmp.Or(cfg.QueryTimeout, QueryTimeoutDefault)
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	return cfg
}

// validate reports a field outside its documented range, wrapping
// ErrInvalidConfig. It checks c after withDefaults.
func (c Config) validate() error {
	switch {
	case c.StalledAfter < 0:
		return fmt.Errorf("%w: StalledAfter %v is negative", ErrInvalidConfig, c.StalledAfter)
	case c.QueryTimeout < 0:
		return fmt.Errorf("%w: QueryTimeout %v is negative", ErrInvalidConfig, c.QueryTimeout)
	}
	return nil
}
