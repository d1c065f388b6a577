// Package opstest writes idempotency keys and outbox messages in given
// states straight into a test schema, for the tests of the operator
// tooling (gauges, status page, admin command, redrive). Times are set
// from the database clock, relative to now().
package opstest

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Key describes an idempotency key row.
type Key struct {
	Scope, Key string
	// Workflow: "" for a single-phase key.
	Workflow string
	// Status: running (default), finished or failed.
	Status string
	// RecoveryPoint: default "started", or "finished" for a terminal key.
	RecoveryPoint string
	// Attempts: default 1.
	Attempts int
	// Age: created this long ago. Idle: last run this long ago (default Age).
	Age, Idle time.Duration
	// Lease: > 0 a live lease for that long; < 0 a lease expired that long
	// ago; 0 no lease.
	Lease time.Duration
	// PhaseResults: the phase_results_raw object, if any.
	PhaseResults string
	// Params: the canonical params (default "{}").
	Params string
	// FailureReason: for a failed key (default "max_age").
	FailureReason string
	// ResponseStatus and ResponseBody of a terminal key (default 201, "{}"
	// for finished, 500 and a problem for failed).
	ResponseStatus int
	ResponseBody   string
	// FinishedAgo: a terminal key finished this long ago (default Idle).
	FinishedAgo time.Duration
}

// InsertKey inserts k and returns its id.
func InsertKey(tb testing.TB, pool *pgxpool.Pool, k Key) int64 {
	tb.Helper()
	if k.Status == "" {
		k.Status = "running"
	}
	if k.Attempts == 0 {
		k.Attempts = 1
	}
	if k.Idle == 0 {
		k.Idle = k.Age
	}
	if k.FinishedAgo == 0 {
		k.FinishedAgo = k.Idle
	}
	if k.Params == "" {
		k.Params = "{}"
	}
	if k.RecoveryPoint == "" {
		k.RecoveryPoint = "started"
		if k.Status != "running" {
			k.RecoveryPoint = "finished"
		}
	}
	var reason *string
	var status *int
	var body []byte
	terminal := k.Status != "running"
	if terminal {
		s := k.ResponseStatus
		if s == 0 {
			s = 201
			if k.Status == "failed" {
				s = 500
			}
		}
		status = &s
		body = []byte(k.ResponseBody)
		if k.ResponseBody == "" {
			body = []byte("{}")
		}
	}
	if k.Status == "failed" {
		r := k.FailureReason
		if r == "" {
			r = "max_age"
		}
		reason = &r
	}
	var phaseResults []byte
	if k.PhaseResults != "" {
		phaseResults = []byte(k.PhaseResults)
	}
	var id int64
	err := pool.QueryRow(context.Background(), `
		INSERT INTO idempotency_keys (scope, key, fingerprint, request_method, request_path, request_params_raw,
			workflow, recovery_point, phase_results, phase_results_raw, status, lease_token, leased_until, attempts,
			created_at, last_run_at, finished_at, response_status, response_headers, response_body, failure_reason)
		VALUES ($1, $2, sha256(convert_to($2::text, 'UTF8')), 'POST', '/rides', $3, $4, $5, '{}', $6, $7,
			CASE WHEN $8::float8 <> 0 THEN gen_random_uuid() END,
			CASE WHEN $8::float8 <> 0 THEN now() + make_interval(secs => $8::float8) END,
			$9, now() - make_interval(secs => $10::float8), now() - make_interval(secs => $11::float8),
			CASE WHEN $12::boolean THEN now() - make_interval(secs => $13::float8) END,
			$14, CASE WHEN $12::boolean THEN '{"Content-Type":["application/json"]}'::jsonb END, $15, $16)
		RETURNING id`,
		k.Scope, k.Key, []byte(k.Params), k.Workflow, k.RecoveryPoint, phaseResults, k.Status,
		k.Lease.Seconds(), k.Attempts, k.Age.Seconds(), k.Idle.Seconds(),
		terminal, k.FinishedAgo.Seconds(), status, body, reason).Scan(&id)
	if err != nil {
		tb.Fatalf("opstest: insert key %q: %v", k.Key, err)
	}
	return id
}

// Message describes an outbox message row.
type Message struct {
	Topic       string // default "receipts"
	OrderingKey string
	Payload     string
	// State: pending (default), published or dead.
	State string
	// Age: staged this long ago. DoneAgo: published or dead-lettered this
	// long ago (default 0: now).
	Age, DoneAgo time.Duration
	Attempts     int
	LastError    string
	// KeyID links the message to the key that staged it.
	KeyID int64
}

// InsertMessage inserts m and returns its row id and message id.
func InsertMessage(tb testing.TB, pool *pgxpool.Pool, m Message) (int64, uuid.UUID) {
	tb.Helper()
	if m.Topic == "" {
		m.Topic = "receipts"
	}
	if m.State == "" {
		m.State = "pending"
	}
	var ordering, lastError *string
	if m.OrderingKey != "" {
		ordering = &m.OrderingKey
	}
	if m.LastError != "" {
		lastError = &m.LastError
	}
	var keyID *int64
	if m.KeyID != 0 {
		keyID = &m.KeyID
	}
	var id int64
	var messageID uuid.UUID
	err := pool.QueryRow(context.Background(), `
		INSERT INTO outbox_messages (idempotency_key_id, topic, ordering_key, payload, created_at, available_at,
			attempts, last_error, published_at, dead_at)
		VALUES ($1, $2, $3, $4, now() - make_interval(secs => $5::float8), now() - make_interval(secs => $5::float8),
			$6, $7,
			CASE WHEN $8 = 'published' THEN now() - make_interval(secs => $9::float8) END,
			CASE WHEN $8 = 'dead' THEN now() - make_interval(secs => $9::float8) END)
		RETURNING id, message_id`,
		keyID, m.Topic, ordering, []byte(m.Payload), m.Age.Seconds(), m.Attempts, lastError, m.State,
		m.DoneAgo.Seconds()).Scan(&id, &messageID)
	if err != nil {
		tb.Fatalf("opstest: insert message: %v", err)
	}
	return id, messageID
}

// Fill adds published messages and finished keys in bulk (generate_series),
// then analyzes both tables: the bulk of a real installation, that
// operator queries must not scan.
func Fill(tb testing.TB, pool *pgxpool.Pool, published, finished int) {
	tb.Helper()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `
		INSERT INTO outbox_messages (topic, payload, created_at, available_at, attempts, published_at)
		SELECT 'bulk', '\x00', now() - interval '1 hour', now() - interval '1 hour', 1, now() - interval '59 minutes'
		FROM generate_series(1, $1::integer)`, published); err != nil {
		tb.Fatalf("opstest: fill messages: %v", err)
	}
	if _, err := pool.Exec(ctx, `
		INSERT INTO idempotency_keys (scope, key, fingerprint, request_method, request_path, request_params_raw,
			recovery_point, status, attempts, created_at, last_run_at, finished_at, response_status, response_headers, response_body)
		SELECT 'bulk', 'bulk-' || i, sha256(i::text::bytea), 'POST', '/rides', '\x7b7d', 'finished', 'finished', 1,
			now() - interval '2 hours', now() - interval '2 hours', now() - interval '2 hours', 201, '{}', '\x7b7d'
		FROM generate_series(1, $1::integer) AS i`, finished); err != nil {
		tb.Fatalf("opstest: fill keys: %v", err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE outbox_messages, idempotency_keys`); err != nil {
		tb.Fatalf("opstest: analyze: %v", err)
	}
}
