package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"

	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/monitor"
)

// Bounds of the HTTP side.
const (
	// requestTimeout bounds the database reads of one request.
	requestTimeout = 5 * time.Second
	// shutdownTimeout bounds the wait for requests in flight at a stop.
	shutdownTimeout = 5 * time.Second
)

// httpServer serves /metrics, /healthz and the status page.
type httpServer struct {
	srv     *http.Server
	done    chan struct{}
	mp      *sdkmetric.MeterProvider
	gauges  *monitor.Gauges
	address string
}

// startHTTP listens on addr and serves in the background. It installs an
// OpenTelemetry SDK meter provider, exported in the Prometheus format at
// /metrics, as the global provider, so that the library's instruments in
// this process (recovery, cleanup) and the gauges are exported.
func startHTTP(addr string, pool *pgxpool.Pool, r *reaper, log *slog.Logger) (*httpServer, error) {
	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	exporter, err := otelprom.New(otelprom.WithRegisterer(registry))
	if err != nil {
		return nil, fmt.Errorf("metrics exporter: %w", err)
	}
	mp := sdkmetric.NewMeterProvider(
		sdkmetric.WithReader(exporter),
		sdkmetric.WithResource(resource.NewSchemaless(attribute.String("service.name", "atomicphase-reaper"))),
	)
	otel.SetMeterProvider(mp)
	gauges, err := monitor.RegisterGauges(pool, &monitor.Config{
		MeterProvider: mp, StalledAfter: r.stalledAfter, QueryTimeout: requestTimeout, Logger: log,
	})
	if err != nil {
		_ = mp.Shutdown(context.Background())
		return nil, err
	}

	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{
		ErrorLog:      slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		ErrorHandling: promhttp.ContinueOnError,
		Timeout:       requestTimeout,
	}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, req *http.Request) {
		health(w, req, pool)
	})
	mux.Handle("GET /{$}", &statusPage{pool: pool, reaper: r, log: log})

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		_ = gauges.Unregister()
		_ = mp.Shutdown(context.Background())
		return nil, err
	}
	s := &httpServer{
		srv: &http.Server{
			Handler:           securityHeaders(mux),
			ReadHeaderTimeout: 5 * time.Second,
			ReadTimeout:       10 * time.Second,
			WriteTimeout:      30 * time.Second,
			IdleTimeout:       time.Minute,
			ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		},
		done:    make(chan struct{}),
		mp:      mp,
		gauges:  gauges,
		address: ln.Addr().String(),
	}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("reaper: http server stopped", "error", err.Error())
		}
	}()
	return s, nil
}

// stop lets requests in flight finish, within shutdownTimeout, and
// releases the metrics.
func (s *httpServer) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	if err := s.srv.Shutdown(ctx); err != nil {
		_ = s.srv.Close()
	}
	<-s.done
	_ = s.gauges.Unregister()
	_ = s.mp.Shutdown(ctx)
}

// securityHeaders makes every answer uncacheable and forbids the browser
// any script, frame or remote resource: the status page is one document
// with inline styles and nothing else.
func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cache-Control", "no-store")
		next.ServeHTTP(w, r)
	})
}

// health answers 200 when the database answers and has every migration
// this build embeds, 503 otherwise, with a JSON body saying which.
func health(w http.ResponseWriter, req *http.Request, pool *pgxpool.Pool) {
	ctx, cancel := context.WithTimeout(req.Context(), requestTimeout)
	defer cancel()
	status, body := http.StatusOK, map[string]string{"status": "ok"}
	if err := pool.Ping(ctx); err != nil {
		status, body = http.StatusServiceUnavailable, map[string]string{"status": "unavailable", "database": "unreachable", "error": err.Error()}
	} else if err := migrations.Check(ctx, pool); err != nil {
		body = map[string]string{"status": "unavailable", "database": "reachable", "schema": "behind", "error": err.Error()}
		if !errors.Is(err, migrations.ErrSchemaBehind) {
			body["schema"] = "unknown"
		}
		status = http.StatusServiceUnavailable
	} else {
		body["database"] = "reachable"
		body["schema"] = "current"
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}
