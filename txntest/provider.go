package txntest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Fault is a failure the Provider injects into a call (see
// Provider.FailNext).
type Fault int

// The faults.
const (
	// NoFault: the call is served normally.
	NoFault Fault = iota
	// Unavailable: the call fails with ErrUnavailable before anything
	// happens, like a 503 from a provider that is down.
	Unavailable
	// ReplyLost: the effect takes place (or is found done under the key),
	// then the call fails with ErrReplyLost, like a connection that drops
	// before the answer arrives.
	ReplyLost
)

func (f Fault) String() string {
	switch f {
	case NoFault:
		return "no fault"
	case Unavailable:
		return "a 503 before the effect"
	case ReplyLost:
		return "the effect, then a lost reply"
	}
	return fmt.Sprintf("Fault(%d)", int(f))
}

// Outcome is what the Provider did with a call.
type Outcome string

// The outcomes of a call.
const (
	// OutcomeEffect: the call performed a new effect.
	OutcomeEffect Outcome = "effect"
	// OutcomeReplayed: an effect under the same key and request existed;
	// the call returned its result and did nothing else.
	OutcomeReplayed Outcome = "replayed"
	// OutcomeRejected: the key was first used with another request
	// (ErrKeyReused); nothing was done.
	OutcomeRejected Outcome = "rejected"
	// OutcomeUnavailable: an injected 503 (ErrUnavailable); nothing was done.
	OutcomeUnavailable Outcome = "unavailable"
)

// Call is one call the Provider received, in the order received.
type Call struct {
	// Key is the idempotency key the call carried.
	Key string
	// Request is the call's request, JSON encoded.
	Request json.RawMessage
	// Outcome is what the Provider did.
	Outcome Outcome
	// ReplyLost is true when the reply was lost after the outcome (an
	// injected ReplyLost fault): the caller got ErrReplyLost.
	ReplyLost bool
}

// Effect is one effect the Provider performed (a charge, say): one per
// idempotency key.
type Effect struct {
	// ID identifies the effect; it is derived from the key, so the same
	// key gives the same ID in every run.
	ID string
	// Key is the idempotency key it was performed under.
	Key string
	// Request is the request that performed it, JSON encoded.
	Request json.RawMessage
}

// Provider is a fake foreign service (a payment provider, an e-mail
// service) for the workflows under test. Like a real payment provider it
// performs one effect per idempotency key: a call with a key already used
// for the same request returns the first call's result and does nothing
// else, and a key already used for another request is refused
// (ErrKeyReused). It records every call with its key.
//
// The Provider keeps its record in two tables of the pool's schema
// (txntest_provider_effects and txntest_provider_calls), written through
// its own connections apart from any transaction of the workflow, the way
// another system's database is apart from the service's: what it did
// survives the death of the process that called it, which is what
// CrashEveryBoundary needs. Faults injected with FailNext apply to calls
// made through this Provider value only.
//
// A Provider is safe for concurrent use.
type Provider struct {
	pool   *pgxpool.Pool
	onCall func(key string) // CrashEveryBoundary's watcher, else nil

	mu     sync.Mutex
	faults []Fault
}

const providerSchema = `
CREATE TABLE IF NOT EXISTS txntest_provider_effects (
	key        text PRIMARY KEY,
	id         text NOT NULL,
	request    text NOT NULL,
	created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS txntest_provider_calls (
	n          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	key        text NOT NULL,
	request    text NOT NULL,
	outcome    text NOT NULL,
	reply_lost boolean NOT NULL,
	at         timestamptz NOT NULL DEFAULT clock_timestamp()
)`

// The provider's tables: one row per call (rows that legitimately multiply
// when a call is repeated after a crash), one per effect.
const (
	providerCallsTable   = "txntest_provider_calls"
	providerEffectsTable = "txntest_provider_effects"
)

// NewProvider returns a Provider keeping its record in pool's schema,
// creating its tables there if they do not exist. CrashEveryBoundary
// gives each run a Provider of its own (Env.Provider); use NewProvider
// for tests of your own.
func NewProvider(tb testing.TB, pool *pgxpool.Pool) *Provider {
	tb.Helper()
	if _, err := pool.Exec(context.Background(), providerSchema); err != nil {
		tb.Fatalf("txntest: new provider: create its tables: %v", err)
	}
	return &Provider{pool: pool}
}

// FailNext makes the next calls fail with faults, one fault per call in
// order (NoFault serves a call normally); later calls are served normally.
// For example FailNext(NoFault, ReplyLost) serves the next call and loses
// the reply of the one after it.
func (p *Provider) FailNext(faults ...Fault) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faults = append(p.faults, faults...)
}

func (p *Provider) nextFault() Fault {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.faults) == 0 {
		return NoFault
	}
	f := p.faults[0]
	p.faults = p.faults[1:]
	return f
}

// Call performs the effect that request (encoded as JSON) asks for under
// key, once per key, and returns the effect's ID: a new effect for a new
// key, the same ID without a new effect for a key already used with the
// same request. It fails with ErrNoKey for an empty key, ErrKeyReused for
// a key used with another request, and with ErrUnavailable or
// ErrReplyLost when FailNext injected that fault. Every call is recorded.
//
// Pass it the foreign key a txn.Foreign phase receives, and a request built
// only from the operation's params and committed results, so that a call
// repeated on a later attempt is the same call.
func (p *Provider) Call(ctx context.Context, key string, request any) (string, error) {
	if key == "" {
		return "", fmt.Errorf("txntest: provider call: %w", ErrNoKey)
	}
	if p.onCall != nil {
		p.onCall(key)
	}
	body, err := json.Marshal(request)
	if err != nil {
		return "", fmt.Errorf("txntest: provider call: encode request: %w", err)
	}
	fault := p.nextFault()
	if fault == Unavailable {
		if err := p.record(ctx, p.pool, key, body, OutcomeUnavailable, false); err != nil {
			return "", fmt.Errorf("txntest: provider call: record it: %w", err)
		}
		return "", fmt.Errorf("txntest: provider call: %w", ErrUnavailable)
	}
	var id string
	var outcome Outcome
	err = pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		id = effectID(key)
		tag, err := tx.Exec(ctx, `INSERT INTO txntest_provider_effects (key, id, request) VALUES ($1, $2, $3)
			ON CONFLICT (key) DO NOTHING`, key, id, string(body))
		if err != nil {
			return err
		}
		outcome = OutcomeEffect
		if tag.RowsAffected() == 0 {
			// Read committed: this statement sees the row the insert
			// conflicted with, even one committed after the insert began.
			var first string
			if err := tx.QueryRow(ctx, `SELECT id, request FROM txntest_provider_effects WHERE key = $1`, key).
				Scan(&id, &first); err != nil {
				return err
			}
			outcome = OutcomeReplayed
			if first != string(body) {
				outcome = OutcomeRejected
			}
		}
		return p.record(ctx, tx, key, body, outcome, fault == ReplyLost)
	})
	switch {
	case err != nil:
		return "", fmt.Errorf("txntest: provider call: %w", err)
	case outcome == OutcomeRejected:
		return "", fmt.Errorf("txntest: provider call: %w (key %q)", ErrKeyReused, key)
	case fault == ReplyLost:
		return "", fmt.Errorf("txntest: provider call: %w", ErrReplyLost)
	}
	return id, nil
}

type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// record logs a call.
func (p *Provider) record(ctx context.Context, db execer, key string, body []byte, outcome Outcome, replyLost bool) error {
	_, err := db.Exec(ctx, `INSERT INTO txntest_provider_calls (key, request, outcome, reply_lost) VALUES ($1, $2, $3, $4)`,
		key, string(body), string(outcome), replyLost)
	return err
}

// effectID derives an effect's ID from its key: the same in every run.
func effectID(key string) string {
	sum := sha256.Sum256([]byte("txntest/provider\x00" + key))
	return "fx_" + hex.EncodeToString(sum[:12])
}

// Calls returns the calls the Provider received, in order.
func (p *Provider) Calls(tb testing.TB) []Call {
	tb.Helper()
	calls, err := p.calls(context.Background())
	if err != nil {
		tb.Fatalf("%v", err)
	}
	return calls
}

func (p *Provider) calls(ctx context.Context) ([]Call, error) {
	rows, err := p.pool.Query(ctx, `SELECT key, request, outcome, reply_lost FROM txntest_provider_calls ORDER BY n`)
	if err != nil {
		return nil, fmt.Errorf("txntest: provider calls: %w", err)
	}
	calls, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Call, error) {
		var c Call
		var req, outcome string
		err := row.Scan(&c.Key, &req, &outcome, &c.ReplyLost)
		c.Request, c.Outcome = json.RawMessage(req), Outcome(outcome)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("txntest: provider calls: %w", err)
	}
	return calls, nil
}

// Effects returns the effects the Provider performed, in the order
// performed: one per key.
func (p *Provider) Effects(tb testing.TB) []Effect {
	tb.Helper()
	effects, err := p.effects(context.Background())
	if err != nil {
		tb.Fatalf("%v", err)
	}
	return effects
}

func (p *Provider) effects(ctx context.Context) ([]Effect, error) {
	rows, err := p.pool.Query(ctx, `SELECT id, key, request FROM txntest_provider_effects ORDER BY created_at, key`)
	if err != nil {
		return nil, fmt.Errorf("txntest: provider effects: %w", err)
	}
	effects, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Effect, error) {
		var e Effect
		var req string
		err := row.Scan(&e.ID, &e.Key, &req)
		e.Request = json.RawMessage(req)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("txntest: provider effects: %w", err)
	}
	return effects, nil
}
