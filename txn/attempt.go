package txn

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/failure"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/phasectx"
	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/internal/txnhook"
)

// Attempt is one run of a workflow under a key: the first attempt, a client
// retry or a recovery resume. It holds the key's lease while it runs. It is
// passed to the WorkflowFunc and must not be used after it returns.
type Attempt struct {
	r        *Runner
	req      request
	workflow string
	id       int64       // the key row's id; 0 until this attempt's insert returned it
	newID    int64       // for a key not stored yet, the id its insert takes (allotted by the lookup)
	seed     pgtype.Int8 // the key row's foreign-key seed; NULL: derive from id
	tid      pgtype.TID  // the key row's current ctid, for fenced updates
	token    uuid.UUID
	number   int
	start    string
	point    string
	results  map[string]json.RawMessage // committed phases' results, exact bytes
	seen     map[string]bool
	called   bool      // a Foreign phase's function was called
	closed   bool      // Finish ran
	finished *Response // stored by Finish
	tooOld   *Response // stored instead of a foreign call: the key is past MaxAge
	// endedBySQL: a phase's function ended its transaction through SQL, and
	// the key was failed (see Runner.failEndedKey); nothing more runs.
	endedBySQL bool

	// stored: the key row is this attempt's (taken over, or inserted by a
	// committed transaction). A first attempt starts without it and
	// inserts the key with its first commit (see newkey.go); raced: that
	// insert found the key taken by a concurrent attempt.
	stored, raced bool
	// eager: the call lost a key's insert before, and may be waiting for
	// its holder in a loop; the key's insert goes out before the first
	// phase runs (insertBefore), not its lock with its first statement, so
	// that a call that keeps losing runs nothing of the phase. A first
	// phase's commit that met a serialization failure makes the attempt
	// eager too: the key may have been committed since its snapshot, and
	// the insert's ON CONFLICT then tells.
	eager bool
	// atCommit: the transaction in flight took the key's lock only, and
	// inserts the key row with its commit (insertAtCommit); xid and
	// started are that transaction's id and its server's start, for
	// Runner.settleUnsure.
	atCommit bool
	xid      int64
	started  time.Time
	// outcome: KeyOutcome, read with the ROLLBACK of a first phase that
	// ended with its function's error (rollbackAndReadOutcome); nil when
	// settleUnsure is to read it on the pool.
	outcome *db.KeyOutcomeRow
	// noPrepare: preparing a phase's first statement failed once (see
	// errRunAgain); the attempt's later transactions prepare nothing.
	noPrepare     bool
	uncertain     bool      // a first commit may have taken effect unseen
	reusedExpired bool      // the insert replaced a tombstone (ExpiredKeyNewOperation)
	began         time.Time // when the attempt started: a first attempt's key is younger
	leaseAt       time.Time // the last commit that set the lease began no earlier
	// pending holds the members (`"name":result`, comma-separated) of
	// foreign calls made since the last commit; the next commit records
	// them, pendingPoint (the last of them) as the recovery point.
	pending      []byte
	pendingPoint string
}

// Params returns the request's params as canonical JSON (object keys
// sorted, insignificant whitespace removed, number literals as the client
// wrote them): the same bytes on the first attempt and on every retry and
// resume.
func (a *Attempt) Params() json.RawMessage { return json.RawMessage(a.req.params) }

// Key returns the scope and value of the idempotency key being run.
func (a *Attempt) Key() (scope, value string) { return a.req.key.Scope, a.req.key.Value }

// Number is 1 for the first attempt and grows with each retry or resume
// that takes the key over.
func (a *Attempt) Number() int { return a.number }

// ResumedFrom is the recovery point this attempt started from:
// RecoveryPointStarted for a fresh key, else the last phase committed before
// it.
func (a *Attempt) ResumedFrom() string { return a.start }

// ForeignKey returns the idempotency key to pass to a foreign system for the
// phase named phase, derived from the key's scope, value, workflow and phase
// and the row's seed: the same on every retry and resume of this operation,
// also when a failover lost the key row and the client's retry runs the
// operation again; and different for a new operation that reuses the key
// value after cleanup (the seed comes from its tombstone). Rows written
// before migration 00010 have no seed and derive it from the row's id.
func (a *Attempt) ForeignKey(phase string) string {
	h := sha256.New()
	var n [8]byte
	if a.seed.Valid {
		h.Write([]byte("atomicphase/foreign/v2\x00"))
		h.Write(binary.BigEndian.AppendUint64(n[:0], uint64(a.seed.Int64)))
	} else {
		h.Write([]byte("atomicphase/foreign/v1\x00"))
		h.Write(binary.BigEndian.AppendUint64(n[:0], uint64(a.id)))
	}
	for _, s := range []string{a.req.key.Scope, a.req.key.Value, a.workflow, phase} {
		h.Write(binary.BigEndian.AppendUint64(n[:0], uint64(len(s))))
		h.Write([]byte(s))
	}
	return "ap_" + hex.EncodeToString(h.Sum(nil))
}

// unstarted reports that nothing took effect under the key yet: this
// attempt inserted it or will (every takeover counts an attempt, and an
// earlier attempt may have called a foreign system without recording it),
// no phase committed and no foreign call was made, and no first commit
// whose outcome is unknown was sent.
func (a *Attempt) unstarted() bool {
	return a.number == 1 && a.point == pointStarted && !a.called && !a.uncertain
}

func (a *Attempt) enter(name string) error {
	switch {
	case a.closed:
		return fmt.Errorf("%w: phase %q after Finish", ErrInvalidUse, name)
	case a.tooOld != nil:
		return fmt.Errorf("phase %q: %w", name, errTooOld)
	case a.endedBySQL:
		return fmt.Errorf("phase %q: %w", name, errEndedBySQL)
	case name == "" || len(name) > 200 || !utf8.ValidString(name) || strings.IndexByte(name, 0) >= 0:
		return fmt.Errorf("%w: phase name must be 1-200 bytes of UTF-8 without NUL", ErrInvalidUse)
	case name == pointStarted || name == pointFinished:
		return fmt.Errorf("%w: phase name %q is reserved", ErrInvalidUse, name)
	case a.seen[name]:
		return fmt.Errorf("%w: phase %q used twice in one workflow", ErrInvalidUse, name)
	}
	a.seen[name] = true
	return nil
}

// errTooOld is returned by a Foreign phase of a key older than
// Config.MaxAge: the key was failed instead of the call being made, and
// the workflow's answer is that stored failure, whatever it returns.
var errTooOld = errors.New("key is older than MaxAge: failed with a stored response instead of calling out")

// startPhase checks a phase about to run (Atomic and Foreign): done is true
// when the phase must not run, with err for misuse, or with the stored
// result of an earlier attempt that committed it.
func startPhase[T any](a *Attempt, name string, nilFunc bool) (v T, done bool, err error) {
	if nilFunc {
		return v, true, fmt.Errorf("txn: phase %q: %w: nil func", name, ErrInvalidUse)
	}
	if err := a.enter(name); err != nil {
		return v, true, fmt.Errorf("txn: %w", err)
	}
	raw, ok := a.results[name]
	if !ok {
		return v, false, nil
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		return v, true, fmt.Errorf("txn: phase %q: decode stored result into %T: %w", name, v, err)
	}
	return v, true, nil
}

// Atomic runs fn as a phase in one SERIALIZABLE transaction that also
// records the phase as the key's recovery point with fn's result (JSON
// encoded), fenced by the attempt's lease. If the phase already committed
// in an earlier attempt, fn does not run and its stored result is returned.
// Serialization failures and deadlocks retry this phase only (fn runs
// again; only one run commits), including those fn's statements met and fn
// swallowed. An error from fn rolls the phase back and is returned. tx
// cannot be committed or rolled back by fn (ErrInvalidUse).
//
// The result is always the JSON round trip of fn's value, stored as the
// exact bytes encoding/json produced, so an attempt that runs the phase and
// one that resumes after it see the same value.
func Atomic[T any](ctx context.Context, a *Attempt, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	if v, done, err := startPhase[T](a, name, fn == nil); done {
		return v, err
	}
	ctx, span, start := a.r.startSpan(ctx, telemetry.SpanPhaseAtomic)
	before := retriesOf(ctx)
	v, err := runAtomic(ctx, a, name, fn)
	a.phaseEnded(ctx, span, start, name, telemetry.PhaseAtomic, before, err)
	return v, err
}

func runAtomic[T any](ctx context.Context, a *Attempt, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	var zero T
	var raw []byte
	var tid pgtype.TID
	err := a.inTx(ctx, insertAtCommit, func(tx *lazyTx) (func(q *db.Queries) error, error) {
		utx := newUserTx(tx)
		v, err := guard(func() (T, error) { return fn(phasectx.WithKeyID(ctx, a.keyID()), utx) })
		if serr := utx.settle(ctx); serr != nil {
			return nil, serr // whatever fn made of it (txOnce fails an ended key)
		}
		if rerr := utx.retry(); rerr != nil {
			return nil, rerr // whatever fn made of it
		}
		if err != nil {
			return nil, err
		}
		if err := utx.usable(); err != nil {
			return nil, err
		}
		raw, err = json.Marshal(v)
		if err != nil {
			return nil, fmt.Errorf("%w: encode result: %w", ErrInvalidUse, err)
		}
		commit, err := a.phaseStmt(ctx, name, raw, &tid, utx)
		if err == nil {
			a.at(txnhook.BeforeCommit, txnhook.CommitPhase, name, "")
		}
		return commit, err
	})
	if err != nil {
		return zero, fmt.Errorf("txn: phase %q: %w", name, err)
	}
	a.at(txnhook.AfterCommit, txnhook.CommitPhase, name, "")
	a.tid = tid // only now: a rolled-back try leaves the row where it was
	a.pending, a.pendingPoint = nil, ""
	return recordResult[T](a, name, raw)
}

// Foreign runs fn, a call to a system outside the database (a payment
// provider, an e-mail service), outside any transaction, then commits its
// result (JSON encoded, stored as the exact bytes, so any value encoding/json
// produces is recorded, \u0000 and huge numbers included) as the key's
// recovery point. fn receives a foreign key, the same on every retry and
// resume; pass it to the provider as its idempotency key so that a call
// repeated after a crash is deduplicated there. If the phase already
// committed, fn does not run and its stored result is returned. An error
// from fn is returned and nothing is stored: return a terminal Response from
// the workflow for a definitive failure (e.g. card declined), or the error
// to leave the key resumable.
//
// The result is recorded with the next commit of the workflow (the next
// Atomic phase or Finish, or the terminal response; a release after an
// error records it too), not in a transaction of its own: a death before
// that repeats the call under the same foreign key, which the provider
// deduplicates.
//
// Before calling fn, the lease is checked and extended, unless this attempt
// created the key and its last commit began less than half a LeaseDuration
// ago (and less than half of MaxAge after the attempt began): then the
// lease is known to be held for at least half a LeaseDuration more, and
// the key to be younger than MaxAge, and a read (no commit) only checks
// that the key row still holds this attempt's token and last phase; with
// Config.FailoverKeepsCommits, not even that. If the key is older than
// Config.MaxAge, fn is not called: the key is failed with a stored problem
// response, which becomes the workflow's answer. A Foreign phase that comes
// first inserts the key before the call.
func Foreign[T any](ctx context.Context, a *Attempt, name string, fn func(ctx context.Context, foreignKey string) (T, error)) (T, error) {
	if v, done, err := startPhase[T](a, name, fn == nil); done {
		return v, err
	}
	ctx, span, start := a.r.startSpan(ctx, telemetry.SpanPhaseForeign)
	before := retriesOf(ctx)
	v, err := runForeign(ctx, a, name, fn)
	a.phaseEnded(ctx, span, start, name, telemetry.PhaseForeign, before, err)
	return v, err
}

func runForeign[T any](ctx context.Context, a *Attempt, name string, fn func(ctx context.Context, foreignKey string) (T, error)) (T, error) {
	var zero T
	if !a.stored {
		if err := a.insertKey(ctx); err != nil {
			return zero, fmt.Errorf("txn: phase %q: %w", name, err)
		}
	}
	switch {
	case !a.leaseFresh():
		if err := a.extendLease(ctx, name); err != nil {
			return zero, err
		}
	case !a.r.cfg.FailoverKeepsCommits:
		// The lease set by this attempt's last commit is held, but a
		// failover to an asynchronous standby may have lost that commit:
		// a read (no commit) makes sure the key is where this attempt
		// left it before a call is built on it. A commit lost after the
		// read is found by the next one, whose fence checks the recovery
		// point.
		if err := a.relocate(ctx); err != nil {
			return zero, fmt.Errorf("txn: phase %q: check lease: %w", name, err)
		}
	}
	if err := ctx.Err(); err != nil {
		// Without a lease check, nothing else would notice before the call.
		return zero, fmt.Errorf("txn: phase %q: %w", name, err)
	}
	a.called = true
	fk := a.ForeignKey(name)
	a.at(txnhook.BeforeCall, 0, name, fk)
	v, err := guard(func() (T, error) { return fn(ctx, fk) })
	a.at(txnhook.AfterCall, 0, name, fk)
	if err != nil {
		return zero, err
	}
	raw, err := json.Marshal(v)
	if err != nil {
		return zero, fmt.Errorf("txn: phase %q: %w: encode result: %w", name, ErrInvalidUse, err)
	}
	// Recorded by the next commit.
	member, err := phaseMember(name, raw)
	if err != nil {
		return zero, fmt.Errorf("txn: phase %q: %w", name, err)
	}
	if len(a.pending) > 0 {
		a.pending = append(a.pending, ',')
	}
	a.pending = append(a.pending, member...)
	a.pendingPoint = name
	a.results[name] = raw
	if err := json.Unmarshal(raw, &v); err != nil {
		return zero, fmt.Errorf("txn: phase %q: %w: result does not decode into %T: %w", name, ErrInvalidUse, v, err)
	}
	return v, nil
}

// leaseFresh reports that a Foreign phase may call out without extending
// the lease first (a read still checks the key, unless
// Config.FailoverKeepsCommits): this attempt created the key (so it is younger than the
// attempt) and the commit that last set the lease began less than half a
// LeaseDuration ago, both by the local monotonic clock. The database set
// leased_until from its clock during that commit, after it began, so at
// least half the lease is left, and the key is younger than half of MaxAge.
// Durations are measured here, never times: the lease and the age are still
// the database's (rule 9), this only bounds them from below.
func (a *Attempt) leaseFresh() bool {
	return a.number == 1 && a.stored && !a.leaseAt.IsZero() &&
		time.Since(a.began) < a.r.cfg.MaxAge/2 && time.Since(a.leaseAt) < a.r.cfg.LeaseDuration/2
}

// extendLease checks and extends the lease before a foreign call, recording
// the results of earlier foreign calls not committed yet: a holder that lost
// its key must not call the provider on the operation's behalf, and nobody
// calls it for a key past MaxAge (then the key is failed instead, and
// a.tooOld set).
func (a *Attempt) extendLease(ctx context.Context, name string) error {
	var tooOld *Response
	sent := time.Now()
	tid, err := a.fenced(ctx, func(tid pgtype.TID) (pgtype.TID, error) {
		row, err := a.r.q.ExtendLease(ctx, db.ExtendLeaseParams{
			Tid: tid, ID: a.id, LeaseToken: a.nullToken(), Point: a.point, LeaseSeconds: a.r.cfg.LeaseDuration.Seconds(),
			MaxAgeSeconds: a.r.cfg.MaxAge.Seconds(), FailureStatus: failure.Status,
			FailureHeaders: failure.Header, FailureBody: a.r.maxAgeBody,
			Member: a.pending, Phase: a.pendingPoint,
		})
		if err == nil && row.Failed {
			resp, derr := storedResponse(row.ResponseStatus.Int32, row.ResponseHeaders, row.ResponseBody)
			if derr != nil {
				return row.Ctid, derr
			}
			tooOld = &resp
		}
		return row.Ctid, err
	})
	if tooOld != nil {
		tooOld.Replayed = false
		a.tooOld = tooOld
		a.r.noteTooOld(ctx, a.req, a.workflow)
		return fmt.Errorf("txn: phase %q: %w", name, errTooOld)
	}
	if err != nil {
		return fmt.Errorf("txn: phase %q: extend lease: %w", name, err)
	}
	a.tid = tid
	a.leaseAt = sent
	if len(a.pending) > 0 {
		a.point = a.pendingPoint
		a.pending, a.pendingPoint = nil, ""
	}
	return nil
}

// phaseMember is the member `"name":raw` appended to the stored results.
func phaseMember(name string, raw []byte) ([]byte, error) {
	var member bytes.Buffer
	member.Grow(len(name) + len(raw) + 3)
	if err := writeString(&member, name); err != nil {
		return nil, fmt.Errorf("%w: phase name: %w", ErrInvalidUse, err)
	}
	member.WriteByte(':')
	member.Write(raw)
	return member.Bytes(), nil
}

// phaseStmt is the fenced statement that records the phase name with its
// result, after the results of foreign calls not committed yet, and extends
// the lease; it sets *tid to the row's new ctid. It goes out with COMMIT
// (commitWith); explain reports the function's failed statement if the
// transaction was aborted by one.
func (a *Attempt) phaseStmt(ctx context.Context, name string, raw []byte, tid *pgtype.TID, utx *userTx) (func(q *db.Queries) error, error) {
	member, err := phaseMember(name, raw)
	if err != nil {
		return nil, err
	}
	if len(a.pending) > 0 {
		member = append(append(append([]byte(nil), a.pending...), ','), member...)
	}
	params := db.CommitPhaseParams{
		LeaseToken: a.nullToken(), Phase: name, Member: member, LeaseSeconds: a.r.cfg.LeaseDuration.Seconds(),
	}
	if a.atCommit {
		ins := a.insertAtPhaseParams(name, member)
		return func(q *db.Queries) error {
			a.id = a.newID // kept for the release, should the COMMIT's answer be lost
			row, err := q.InsertKeyAtPhase(ctx, ins)
			*tid, a.reusedExpired = row.Ctid, row.ReusedExpired
			if err != nil {
				return utx.explain(err)
			}
			return nil
		}, nil
	}
	return func(q *db.Queries) error {
		// Read now: a first phase's key insert may have gone out after fn.
		params.Tid, params.ID, params.Point = a.tid, a.id, a.point
		row, err := q.CommitPhase(ctx, params)
		*tid = row.Ctid
		if err != nil {
			return utx.explain(err)
		}
		return nil
	}, nil
}

func (a *Attempt) nullToken() uuid.NullUUID { return uuid.NullUUID{UUID: a.token, Valid: true} }

// keyID is the key row's id: the one stored, or for a key not stored yet,
// the one its insert takes.
func (a *Attempt) keyID() int64 { return cmp.Or(a.id, a.newID) }

// fenced runs a lease-fenced UPDATE on its own (autocommit) that addresses
// the key row by its ctid and returns the row's new ctid. Addressing by
// ctid keeps SERIALIZABLE phases from taking predicate locks on
// primary-key btree pages, which would make unrelated keys conflict with
// each other. If the row is not at its last known ctid (no row, or the
// division_by_zero of a statement that fails rather than match nothing), it
// is located (Attempt.relocate) and the update tried there.
func (a *Attempt) fenced(ctx context.Context, update func(pgtype.TID) (pgtype.TID, error)) (pgtype.TID, error) {
	tid, err := update(a.tid)
	if !notFound(err) {
		return tid, err
	}
	if err := a.relocate(ctx); err != nil {
		return tid, err
	}
	tid, err = update(a.tid)
	if notFound(err) {
		return tid, ErrLeaseLost
	}
	return tid, err
}

// notFound reports a fenced update that found no row where it looked.
func notFound(err error) bool {
	return errors.Is(err, pgx.ErrNoRows) || errors.Is(err, errRowMoved) || pgerr.Code(err) == pgerr.DivisionByZero
}

// relocate finds the key row this attempt holds the lease of, when it is
// not at its last known ctid: ErrLeaseLost if there is none (the lease was
// taken over, or the key failed), errLostCommit if its recovery point is
// not the last phase this attempt committed (a failover lost that commit).
func (a *Attempt) relocate(ctx context.Context) error {
	cur, err := a.r.q.LocateHeldKey(ctx, db.LocateHeldKeyParams{ID: a.id, LeaseToken: a.nullToken()})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return ErrLeaseLost
	case err != nil:
		return err
	case cur.RecoveryPoint != a.point:
		return fmt.Errorf("%w (the key is at %q, this attempt committed %q)", errLostCommit, cur.RecoveryPoint, a.point)
	}
	a.tid = cur.Ctid
	return nil
}

// recordResult notes a committed phase and returns its JSON round trip.
func recordResult[T any](a *Attempt, name string, raw []byte) (T, error) {
	a.results[name] = raw
	a.point = name
	var v T
	if err := json.Unmarshal(raw, &v); err != nil {
		return v, fmt.Errorf("txn: phase %q: %w: result does not decode into %T: %w", name, ErrInvalidUse, v, err)
	}
	return v, nil
}

// Finish runs the workflow's final atomic phase: fn's writes, the terminal
// response and the key's finished status commit in one SERIALIZABLE
// transaction, fenced by the lease. Return its result from the WorkflowFunc.
// fn may run more than once, as an Atomic phase's function may.
//
// If nothing took effect under the key yet (see Config.Store) and
// Config.Store does not store fn's response, fn's writes are rolled back
// and the response is returned unstored; the workflow's return leaves no
// key behind, so a corrected request can retry with the same key.
func (a *Attempt) Finish(ctx context.Context, fn Func) (Response, error) {
	switch {
	case fn == nil:
		return Response{}, fmt.Errorf("txn: finish: %w: nil func", ErrInvalidUse)
	case a.closed:
		return Response{}, fmt.Errorf("txn: finish: %w: called twice", ErrInvalidUse)
	case a.tooOld != nil:
		return Response{}, fmt.Errorf("txn: finish: %w", errTooOld)
	case a.endedBySQL:
		return Response{}, fmt.Errorf("txn: finish: %w", errEndedBySQL)
	}
	a.closed = true
	ctx, span, start := a.r.startSpan(ctx, telemetry.SpanPhaseFinish)
	before := retriesOf(ctx)
	resp, err := a.finish(ctx, fn)
	a.phaseEnded(ctx, span, start, "finish", telemetry.PhaseFinish, before, err)
	return resp, err
}

func (a *Attempt) finish(ctx context.Context, fn Func) (Response, error) {
	var resp Response
	stored := true
	err := a.inTx(ctx, insertAtCommit, func(tx *lazyTx) (func(q *db.Queries) error, error) {
		utx := newUserTx(tx)
		var err error
		resp, err = guard(func() (Response, error) { return fn(phasectx.WithKeyID(ctx, a.keyID()), utx) })
		if serr := utx.settle(ctx); serr != nil {
			return nil, serr
		}
		if rerr := utx.retry(); rerr != nil {
			return nil, rerr // whatever fn made of it
		}
		if err != nil {
			return nil, err
		}
		if err := resp.validate(); err != nil {
			return nil, err
		}
		if err := utx.usable(); err != nil {
			return nil, err
		}
		if stored = a.r.cfg.Store(resp.Status) || !a.unstarted(); !stored {
			return nil, errNotStored // rolls fn's writes back
		}
		commit, err := a.storeStmt(ctx, resp, pointFinished)
		if err != nil {
			return nil, err
		}
		a.at(txnhook.BeforeCommit, txnhook.CommitResponse, "", "")
		return func(q *db.Queries) error { return utx.explain(commit(q)) }, nil
	})
	if err != nil && !(errors.Is(err, errNotStored) && !stored) {
		return Response{}, fmt.Errorf("txn: finish: %w", err)
	}
	resp.Replayed = false
	if stored {
		a.at(txnhook.AfterCommit, txnhook.CommitResponse, "", "")
		a.finished = &resp
		a.point = pointFinished
		a.pending, a.pendingPoint = nil, ""
	}
	return resp, nil
}

// errNotStored rolls back a final phase whose response is not stored.
var errNotStored = errors.New("response not stored")

// finishParams is the fenced FinishKey that writes the terminal response
// and releases the lease, with the results of foreign calls not committed
// yet, at the attempt's last known ctid; the caller sets Point, the
// attempt's last commit, when it sends it.
func (a *Attempt) finishParams(resp Response, point string) (db.FinishKeyParams, error) {
	if err := resp.validate(); err != nil {
		return db.FinishKeyParams{}, err
	}
	header, err := resp.encodedHeader()
	if err != nil {
		return db.FinishKeyParams{}, err
	}
	return db.FinishKeyParams{
		Tid: a.tid, ID: a.id, LeaseToken: a.nullToken(), RecoveryPoint: point, Member: a.pending,
		ResponseStatus: int4(resp.Status), ResponseHeaders: string(header), ResponseBody: resp.Body,
	}, nil
}

// storeStmt is finishParams' statement, to go out with COMMIT; or, for a
// first commit that inserts the key with it (insertAtCommit), the key's
// insert, finished, with the response.
func (a *Attempt) storeStmt(ctx context.Context, resp Response, point string) (func(q *db.Queries) error, error) {
	params, err := a.finishParams(resp, point)
	if err != nil {
		return nil, err
	}
	if a.atCommit {
		ins := db.InsertFinishedKeyParams{
			ID: a.newID, Scope: a.req.key.Scope, Key: a.req.key.Value, Fingerprint: a.req.fingerprint,
			RequestMethod: a.req.key.Method, RequestPath: a.req.key.Path, RequestParams: a.req.params,
			Workflow: a.workflow, ResponseStatus: params.ResponseStatus.Int32, ResponseHeaders: params.ResponseHeaders,
			ResponseBody: params.ResponseBody, RejectExpired: a.r.cfg.ExpiredKeyPolicy == ExpiredKeyReject,
		}
		return func(q *db.Queries) (err error) {
			a.id = a.newID // kept for the release, should the COMMIT's answer be lost
			a.reusedExpired, err = q.InsertFinishedKey(ctx, ins)
			return err
		}, nil
	}
	return func(q *db.Queries) error {
		// Read now: a key insert may have gone out after the statement was built.
		params.Tid, params.ID, params.Point = a.tid, a.id, a.point
		_, err := q.FinishKey(ctx, params)
		return err
	}, nil
}

// storeAlone runs finishParams' statement on its own, fenced.
func (a *Attempt) storeAlone(ctx context.Context, resp Response, point string) error {
	params, err := a.finishParams(resp, point)
	if err != nil {
		return err
	}
	_, err = a.fenced(ctx, func(tid pgtype.TID) (pgtype.TID, error) {
		params.Tid, params.Point = tid, a.point
		row, err := a.r.q.FinishKey(ctx, params)
		return row.Ctid, err
	})
	if err != nil && !errors.Is(err, ErrLeaseLost) {
		return fmt.Errorf("store response: %w", err)
	}
	return err
}
