package txn

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"sort"
	"sync"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/phasectx"
)

// Key statuses and reserved recovery points, as stored.
const (
	statusRunning = "running"
	pointStarted  = "started"
	pointFinished = "finished"
)

// WorkflowFunc is a multi-phase operation. It calls Atomic and Foreign phases
// in order and returns the terminal response, usually from Attempt.Finish.
// The same function runs on the first attempt, on a client retry and on a
// recovery resume: phases already committed are skipped and their stored
// results returned, so it reads linearly. Returning an error (not a
// Response) leaves the key resumable at its last committed phase.
type WorkflowFunc func(ctx context.Context, a *Attempt) (Response, error)

// Workflow is a named multi-phase operation. Register it in a Registry so
// that recovery can resume it by name.
type Workflow struct {
	name string
	fn   WorkflowFunc
}

// NewWorkflow names fn. The name is stored with every key the workflow runs
// under, so keep it stable across deploys. Registry.Register validates it.
func NewWorkflow(name string, fn WorkflowFunc) *Workflow {
	return &Workflow{name: name, fn: fn}
}

// Name returns the workflow's name.
func (w *Workflow) Name() string { return w.name }

// Registry maps workflow names to workflows. It is safe for concurrent use.
type Registry struct {
	mu sync.RWMutex
	m  map[string]*Workflow
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{m: make(map[string]*Workflow)} }

// Register adds workflows. A nil workflow or function, an empty or
// over-long name, or a name already registered is an error wrapping
// ErrInvalidUse, and nothing is added.
func (r *Registry) Register(workflows ...*Workflow) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := make(map[string]bool)
	for _, w := range workflows {
		switch {
		case w == nil || w.fn == nil:
			return fmt.Errorf("txn: register: %w: nil workflow or function", ErrInvalidUse)
		case w.name == "" || len(w.name) > 200:
			return fmt.Errorf("txn: register: %w: workflow name must be 1-200 bytes", ErrInvalidUse)
		case r.m[w.name] != nil || seen[w.name]:
			return fmt.Errorf("txn: register: %w: workflow %q already registered", ErrInvalidUse, w.name)
		}
		seen[w.name] = true
	}
	for _, w := range workflows {
		r.m[w.name] = w
	}
	return nil
}

// Lookup returns the workflow registered under name.
func (r *Registry) Lookup(name string) (*Workflow, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	w, ok := r.m[name]
	return w, ok
}

// Names returns the registered names, sorted.
func (r *Registry) Names() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	names := make([]string, 0, len(r.m))
	for n := range r.m {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Attempt is one run of a workflow under a key: the first attempt, a client
// retry or a recovery resume. It holds the key's lease while it runs. It is
// passed to the WorkflowFunc and must not be used after it returns.
type Attempt struct {
	r        *Runner
	req      request
	workflow string
	id       int64
	tid      pgtype.TID // the key row's current ctid, for fenced updates
	token    uuid.UUID
	number   int
	start    string
	point    string
	results  map[string]json.RawMessage
	seen     map[string]bool
	finished *Response
}

// Params returns the request's params as JSON: the caller's on the request
// path, the stored ones on a resume.
func (a *Attempt) Params() json.RawMessage { return json.RawMessage(a.req.params) }

// Key returns the scope and value of the idempotency key being run.
func (a *Attempt) Key() (scope, value string) { return a.req.key.Scope, a.req.key.Value }

// Number is 1 for the first attempt and grows with each retry or resume
// that takes the key over.
func (a *Attempt) Number() int { return a.number }

// ResumedFrom is the recovery point this attempt started from: "started"
// for a fresh key, else the last phase committed before it.
func (a *Attempt) ResumedFrom() string { return a.start }

// ForeignKey returns the idempotency key to pass to a foreign system for the
// phase named phase: derived from the key's row, so it is the same on every
// retry and resume of this operation, and different for a new operation
// that reuses the key value after the old one expired.
func (a *Attempt) ForeignKey(phase string) string {
	h := sha256.New()
	h.Write([]byte("atomicphase/foreign/v1\x00"))
	var id [8]byte
	binary.BigEndian.PutUint64(id[:], uint64(a.id))
	h.Write(id[:])
	for _, s := range []string{a.req.key.Scope, a.req.key.Value, a.workflow, phase} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	return "ap_" + hex.EncodeToString(h.Sum(nil))
}

func (a *Attempt) enter(name string) error {
	switch {
	case a.finished != nil:
		return fmt.Errorf("%w: phase %q after Finish", ErrInvalidUse, name)
	case name == "" || len(name) > 200:
		return fmt.Errorf("%w: phase name must be 1-200 bytes", ErrInvalidUse)
	case name == pointStarted || name == pointFinished:
		return fmt.Errorf("%w: phase name %q is reserved", ErrInvalidUse, name)
	case a.seen[name]:
		return fmt.Errorf("%w: phase %q used twice in one workflow", ErrInvalidUse, name)
	}
	a.seen[name] = true
	return nil
}

func storedResult[T any](a *Attempt, name string) (T, bool, error) {
	var v T
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
// Serialization failures retry this phase only. An error from fn rolls the
// phase back and is returned.
//
// The result is always the JSON round trip of fn's value, so an attempt
// that runs the phase and one that resumes after it see the same value.
func Atomic[T any](ctx context.Context, a *Attempt, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	var zero T
	if fn == nil {
		return zero, fmt.Errorf("txn: phase %q: %w: nil func", name, ErrInvalidUse)
	}
	if err := a.enter(name); err != nil {
		return zero, fmt.Errorf("txn: phase: %w", err)
	}
	if v, ok, err := storedResult[T](a, name); ok {
		return v, err
	}
	var raw []byte
	var tid pgtype.TID
	err := a.r.inTx(ctx, func(tx pgx.Tx) error {
		v, err := callPhase(phasectx.WithKeyID(ctx, a.id), tx, fn)
		if err != nil {
			return err
		}
		raw, err = json.Marshal(v)
		if err != nil {
			return fmt.Errorf("%w: encode result: %w", ErrInvalidUse, err)
		}
		tid, err = a.commitPhase(ctx, a.r.q.WithTx(tx), name, raw)
		return err
	})
	if err != nil {
		return zero, fmt.Errorf("txn: phase %q: %w", name, err)
	}
	a.tid = tid // only now: a rolled-back try leaves the row where it was
	return recordResult[T](a, name, raw)
}

// Foreign runs fn, a call to a system outside the database (a payment
// provider, an e-mail service), outside any transaction, then commits its
// result (JSON encoded) as the key's recovery point. fn receives a foreign
// key, the same on every retry and resume; pass it to the provider as its
// idempotency key so that a call repeated after a crash is deduplicated
// there. If the phase already committed, fn does not run and its stored
// result is returned. An error from fn is returned and nothing is stored:
// return a terminal Response from the workflow for a definitive failure
// (e.g. card declined), or the error to leave the key resumable.
func Foreign[T any](ctx context.Context, a *Attempt, name string, fn func(ctx context.Context, foreignKey string) (T, error)) (T, error) {
	var zero T
	if fn == nil {
		return zero, fmt.Errorf("txn: phase %q: %w: nil func", name, ErrInvalidUse)
	}
	if err := a.enter(name); err != nil {
		return zero, fmt.Errorf("txn: phase: %w", err)
	}
	if v, ok, err := storedResult[T](a, name); ok {
		return v, err
	}
	// Check and extend the lease before calling out: a holder that lost
	// its key must not call the provider on the operation's behalf.
	tid, err := a.fenced(ctx, a.r.q, func(tid pgtype.TID) (pgtype.TID, error) {
		return a.r.q.ExtendLease(ctx, db.ExtendLeaseParams{
			Tid: tid, ID: a.id, LeaseToken: a.nullToken(), LeaseSeconds: a.r.cfg.LeaseDuration.Seconds(),
		})
	})
	if err != nil {
		return zero, fmt.Errorf("txn: phase %q: extend lease: %w", name, err)
	}
	a.tid = tid
	v, err := callForeign(ctx, a.ForeignKey(name), fn)
	if err != nil {
		return zero, err
	}
	raw, err := json.Marshal(v)
	if err != nil {
		return zero, fmt.Errorf("txn: phase %q: %w: encode result: %w", name, ErrInvalidUse, err)
	}
	// One UPDATE in its own transaction records the result, fenced.
	tid, err = a.commitPhase(ctx, a.r.q, name, raw)
	if err != nil {
		return zero, fmt.Errorf("txn: phase %q: %w", name, err)
	}
	a.tid = tid
	return recordResult[T](a, name, raw)
}

func callForeign[T any](ctx context.Context, fk string, fn func(context.Context, string) (T, error)) (v T, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return fn(ctx, fk)
}

func (a *Attempt) commitPhase(ctx context.Context, q *db.Queries, name string, raw []byte) (pgtype.TID, error) {
	tid, err := a.fenced(ctx, q, func(tid pgtype.TID) (pgtype.TID, error) {
		return q.CommitPhase(ctx, db.CommitPhaseParams{
			Tid: tid, ID: a.id, LeaseToken: a.nullToken(),
			Phase: name, Result: raw, LeaseSeconds: a.r.cfg.LeaseDuration.Seconds(),
		})
	})
	if err != nil {
		return tid, fmt.Errorf("record phase: %w", err)
	}
	return tid, nil
}

func (a *Attempt) nullToken() uuid.NullUUID { return uuid.NullUUID{UUID: a.token, Valid: true} }

// fenced runs a lease-fenced UPDATE that addresses the key row by its ctid
// and returns the row's new ctid. Addressing by ctid keeps SERIALIZABLE
// phases from taking predicate locks on primary-key btree pages, which
// would make unrelated keys conflict with each other. If the row is not at
// its last known ctid, it is located by id and lease token (no row: the
// lease was lost) and the update is tried there.
func (a *Attempt) fenced(ctx context.Context, q *db.Queries, update func(pgtype.TID) (pgtype.TID, error)) (pgtype.TID, error) {
	tid, err := update(a.tid)
	if !errors.Is(err, pgx.ErrNoRows) {
		return tid, err
	}
	cur, err := q.LocateHeldKey(ctx, db.LocateHeldKeyParams{ID: a.id, LeaseToken: a.nullToken()})
	if errors.Is(err, pgx.ErrNoRows) {
		return tid, ErrLeaseLost
	}
	if err != nil {
		return tid, err
	}
	tid, err = update(cur)
	if errors.Is(err, pgx.ErrNoRows) {
		return tid, ErrLeaseLost
	}
	return tid, err
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
func (a *Attempt) Finish(ctx context.Context, fn Func) (Response, error) {
	if fn == nil {
		return Response{}, fmt.Errorf("txn: finish: %w: nil func", ErrInvalidUse)
	}
	if a.finished != nil {
		return Response{}, fmt.Errorf("txn: finish: %w: called twice", ErrInvalidUse)
	}
	var resp Response
	err := a.r.inTx(ctx, func(tx pgx.Tx) error {
		var err error
		resp, err = callPhase(phasectx.WithKeyID(ctx, a.id), tx, fn)
		if err != nil {
			return err
		}
		return a.store(ctx, a.r.q.WithTx(tx), resp, pointFinished)
	})
	if err != nil {
		return Response{}, fmt.Errorf("txn: finish: %w", err)
	}
	resp.Replayed = false
	a.finished = &resp
	a.point = pointFinished
	return resp, nil
}

// store writes the terminal response and releases the lease, fenced.
func (a *Attempt) store(ctx context.Context, q *db.Queries, resp Response, point string) error {
	if err := resp.validate(); err != nil {
		return err
	}
	header, err := resp.encodedHeader()
	if err != nil {
		return err
	}
	_, err = a.fenced(ctx, q, func(tid pgtype.TID) (pgtype.TID, error) {
		return q.FinishKey(ctx, db.FinishKeyParams{
			Tid: tid, ID: a.id, LeaseToken: a.nullToken(), RecoveryPoint: point,
			ResponseStatus: int4(resp.Status), ResponseHeaders: header, ResponseBody: resp.Body,
		})
	})
	if err != nil && !errors.Is(err, ErrLeaseLost) {
		return fmt.Errorf("store response: %w", err)
	}
	return err
}

func int4(v int) pgtype.Int4 { return pgtype.Int4{Int32: int32(v), Valid: true} }

// RunWorkflow runs wf under key. A new key is inserted holding a lease; a
// key left by a crashed or failed attempt (lease free or expired) is taken
// over and resumed after its last committed phase; a finished key is
// replayed. wf must be registered in Config.Workflows, so that recovery can
// resume it by name; otherwise ErrUnknownWorkflow.
//
// If the workflow returns a Response, it is terminal: stored (if Finish did
// not already) and replayed to every retry. If it returns an error, the
// key's lease is released with its recovery point intact and the error is
// returned; a retry or the recovery Resumer continues from there.
func (r *Runner) RunWorkflow(ctx context.Context, key Key, wf *Workflow) (Response, error) {
	if wf == nil {
		return Response{}, fmt.Errorf("txn: run workflow: %w: nil workflow", ErrInvalidUse)
	}
	if reg, ok := r.cfg.Workflows.Lookup(wf.name); !ok || reg != wf {
		return Response{}, fmt.Errorf("txn: run workflow %q: %w", wf.name, ErrUnknownWorkflow)
	}
	req, err := prepare(key, r.cfg.MaxParamsBytes)
	if err != nil {
		return Response{}, fmt.Errorf("txn: run workflow %q: %w", wf.name, err)
	}
	for {
		if err := ctx.Err(); err != nil {
			return Response{}, fmt.Errorf("txn: run workflow %q: %w", wf.name, err)
		}
		a, resp, err := r.acquire(ctx, req, wf.name)
		if errors.Is(err, errWait) {
			continue
		}
		if err != nil || a == nil {
			return resp, err
		}
		return r.execute(ctx, a, wf)
	}
}

// acquire returns an Attempt holding the key's lease, or the replayed
// response, or an error (errWait: look again).
func (r *Runner) acquire(ctx context.Context, req request, workflow string) (*Attempt, Response, error) {
	row, err := r.q.LookupKey(ctx, db.LookupKeyParams{Scope: req.key.Scope, Key: req.key.Value})
	if errors.Is(err, pgx.ErrNoRows) {
		token := uuid.New()
		var ins db.InsertKeyRow
		ins, err = r.q.InsertKey(ctx, db.InsertKeyParams{
			Scope: req.key.Scope, Key: req.key.Value, Fingerprint: req.fingerprint,
			RequestMethod: req.key.Method, RequestPath: req.key.Path, RequestParams: req.params,
			Workflow: workflow, LeaseToken: uuid.NullUUID{UUID: token, Valid: true}, LeaseSeconds: r.cfg.LeaseDuration.Seconds(),
		})
		if errors.Is(err, pgx.ErrNoRows) {
			// Inserted concurrently: committed (look again) or in flight.
			row, err = r.q.LookupKey(ctx, db.LookupKeyParams{Scope: req.key.Scope, Key: req.key.Value})
			if errors.Is(err, pgx.ErrNoRows) {
				return nil, Response{}, r.heldByOther(ctx, req, statusRunning, pointStarted, 0)
			}
		} else if err != nil {
			return nil, Response{}, fmt.Errorf("txn: run workflow %q: insert key: %w", workflow, err)
		} else {
			return r.newAttempt(req, workflow, ins.ID, ins.Ctid, token, 1, pointStarted, nil)
		}
	}
	if err != nil {
		return nil, Response{}, fmt.Errorf("txn: run workflow %q: look up key: %w", workflow, err)
	}
	resp, err := r.existing(ctx, req, workflow, row)
	if !errors.Is(err, errResumable) {
		return nil, resp, err
	}
	return r.takeOver(ctx, req, workflow, row.ID)
}

func (r *Runner) takeOver(ctx context.Context, req request, workflow string, id int64) (*Attempt, Response, error) {
	token := uuid.New()
	taken, err := r.q.TakeOverKey(ctx, db.TakeOverKeyParams{
		ID: id, LeaseToken: uuid.NullUUID{UUID: token, Valid: true}, LeaseSeconds: r.cfg.LeaseDuration.Seconds(),
	})
	if errors.Is(err, pgx.ErrNoRows) {
		// Another attempt took it over or finished it first: look again.
		return nil, Response{}, errWait
	}
	if err != nil {
		return nil, Response{}, fmt.Errorf("txn: run workflow %q: take over key: %w", workflow, err)
	}
	return r.newAttempt(req, workflow, id, taken.Ctid, token, int(taken.Attempts), taken.RecoveryPoint, taken.PhaseResults)
}

func (r *Runner) newAttempt(req request, workflow string, id int64, tid pgtype.TID, token uuid.UUID, number int, point string, results []byte) (*Attempt, Response, error) {
	a := &Attempt{
		r: r, req: req, workflow: workflow, id: id, tid: tid, token: token, number: number,
		start: point, point: point, results: map[string]json.RawMessage{}, seen: map[string]bool{},
	}
	if len(results) > 0 {
		if err := json.Unmarshal(results, &a.results); err != nil {
			return nil, Response{}, fmt.Errorf("txn: run workflow %q: decode phase results: %w", workflow, err)
		}
	}
	return a, Response{}, nil
}

// execute runs the workflow function with a held lease and settles the key:
// terminal response stored, or lease released for a later resume.
func (r *Runner) execute(ctx context.Context, a *Attempt, wf *Workflow) (Response, error) {
	resp, err := callWorkflow(ctx, a, wf.fn)
	if err == nil && a.finished == nil {
		// A terminal response returned without Finish (e.g. 402 after a
		// declined charge): store it, fenced, where the workflow stopped.
		err = a.store(ctx, r.q, resp, a.point)
		if err != nil {
			err = fmt.Errorf("txn: run workflow %q: %w", wf.name, err)
		}
	}
	if err != nil {
		if errors.Is(err, ErrLeaseLost) {
			r.leaseLost.Add(1)
			r.log.WarnContext(ctx, "lease lost; another attempt holds the key",
				"scope", a.req.key.Scope, "key", a.req.key.Value, "workflow", wf.name, "recovery_point", a.point)
			return Response{}, err
		}
		if a.finished != nil {
			// The response is stored; an error after Finish changes nothing.
			return Response{}, err
		}
		r.release(ctx, a)
		r.logTransient(ctx, a.req, wf.name, err)
		return Response{}, err
	}
	r.executed.Add(1)
	if a.finished != nil {
		return *a.finished, nil
	}
	resp.Replayed = false
	return resp, nil
}

// release frees the lease after a transient error, on a fresh context.
func (r *Runner) release(ctx context.Context, a *Attempt) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	n, err := r.q.ReleaseKey(rctx, db.ReleaseKeyParams{ID: a.id, LeaseToken: uuid.NullUUID{UUID: a.token, Valid: true}})
	if err != nil {
		// The lease will expire on its own; recovery takes the key then.
		r.log.WarnContext(ctx, "release key failed; it becomes resumable when its lease expires",
			"scope", a.req.key.Scope, "key", a.req.key.Value, "error", err)
		return
	}
	if n == 1 {
		r.released.Add(1)
	}
}

func callWorkflow(ctx context.Context, a *Attempt, fn WorkflowFunc) (resp Response, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return fn(ctx, a)
}

// Resume continues the operation stored under (scope, value) with its
// stored request, through the workflow registered under its name: the
// recovery path, usable from admin tools too. A finished key is replayed; a
// key held by a live lease gives ErrKeyInUse; an unknown key
// ErrKeyNotFound; a workflow missing from the registry ErrUnknownWorkflow.
func (r *Runner) Resume(ctx context.Context, scope, value string) (Response, error) {
	if err := ctx.Err(); err != nil {
		return Response{}, fmt.Errorf("txn: resume: %w", err)
	}
	row, err := r.q.LookupKeyForResume(ctx, db.LookupKeyForResumeParams{Scope: scope, Key: value})
	if errors.Is(err, pgx.ErrNoRows) {
		return Response{}, fmt.Errorf("txn: resume: %w", ErrKeyNotFound)
	}
	if err != nil {
		return Response{}, fmt.Errorf("txn: resume: look up key: %w", err)
	}
	req := request{
		key:    Key{Scope: scope, Value: value, Method: row.RequestMethod, Path: row.RequestPath, Params: row.RequestParams},
		params: row.RequestParams, fingerprint: row.Fingerprint,
	}
	if row.Status != statusRunning {
		return r.replay(ctx, req, row.Status, row.ResponseStatus.Int32, row.ResponseHeaders, row.ResponseBody)
	}
	wf, ok := r.cfg.Workflows.Lookup(row.Workflow)
	if !ok || row.Workflow == "" {
		return Response{}, fmt.Errorf("txn: resume: %w: %q", ErrUnknownWorkflow, row.Workflow)
	}
	if row.LeaseLive {
		return Response{}, r.inUseError(ctx, req, row.Status, row.RecoveryPoint, row.LeaseRemainingSeconds)
	}
	a, _, err := r.takeOver(ctx, req, wf.name, row.ID)
	if errors.Is(err, errWait) {
		// Another resumer or a client retry took it between our read and ours.
		return Response{}, r.inUseError(ctx, req, statusRunning, row.RecoveryPoint, 0)
	}
	if err != nil {
		return Response{}, err
	}
	return r.execute(ctx, a, wf)
}
