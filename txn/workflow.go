package txn

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/failure"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/internal/txnbridge"
)

// RunWorkflow runs wf under key. A new key is inserted holding a lease; a
// key left by a crashed or failed attempt (lease free or expired) is taken
// over and resumed after its last committed phase, unless it is older than
// Config.MaxAge (then it is failed, and its stored failure returned); a
// finished key is replayed. wf must be registered in Config.Workflows, so
// that recovery can resume it by name; otherwise ErrUnknownWorkflow, and
// nothing is written.
//
// If the workflow returns a Response, it is terminal: stored (if Finish did
// not already) and replayed to every retry, except a rejection Config.Store
// does not store given before anything took effect (no phase committed, no
// foreign call, and this attempt inserted the key): then the key is removed
// and the response returned, so a corrected request can retry with the same
// key. If the workflow returns an error, the key's lease is released with
// its recovery point intact and the error is returned; a retry or the
// recovery Resumer continues from there.
func (r *Runner) RunWorkflow(ctx context.Context, key Key, wf *Workflow) (Response, error) {
	ctx, span, start := r.startSpan(ctx, telemetry.SpanRunWorkflow)
	name := ""
	if wf != nil {
		name = wf.name
		ctx = withWorkflow(ctx, name)
	}
	resp, err := r.runWorkflow(ctx, key, wf)
	err = markUnavailable(ctx, err)
	r.ended(ctx, span, start, name, key.Scope, resp, err)
	return resp, err
}

func (r *Runner) runWorkflow(ctx context.Context, key Key, wf *Workflow) (Response, error) {
	if wf == nil {
		return Response{}, fmt.Errorf("txn: run workflow: %w: nil workflow", ErrInvalidUse)
	}
	if reg, ok := r.cfg.Workflows.Lookup(wf.name); !ok || reg != wf {
		return Response{}, fmt.Errorf("txn: run workflow %q: %w (register it in Config.Workflows)", wf.name, ErrUnknownWorkflow)
	}
	req, err := prepare(key, r.cfg.MaxParamsBytes)
	if err != nil {
		return Response{}, fmt.Errorf("txn: run workflow %q: %w", wf.name, err)
	}
	raced := false     // the last attempt lost the key's insert to a concurrent one
	contended := false // an attempt lost the key's insert: insert it before a phase runs (see Attempt.eager)
	waited := false    // the call waited for the key's holder (Config.WaitWhenInUse)
	for {
		if err := ctx.Err(); err != nil {
			return Response{}, fmt.Errorf("txn: run workflow %q: %w", wf.name, err)
		}
		a, resp, err := r.acquire(ctx, req, wf.name, raced)
		raced = false
		if errors.Is(err, errWait) {
			waited = r.noteWait(ctx, req, wf.name, waited)
			continue
		}
		if err != nil {
			r.logFailure(ctx, req, wf.name, err, nil)
			return Response{}, fmt.Errorf("txn: run workflow %q: %w", wf.name, err)
		}
		if a == nil {
			return resp, nil
		}
		noteAttempt(ctx, a.number)
		a.eager = contended
		resp, err = r.execute(ctx, a, wf)
		if errors.Is(err, errRaced) {
			// Another attempt inserted the key first: committed (the next
			// lookup sees it) or still in flight.
			raced, contended = true, true
			continue
		}
		return resp, err
	}
}

// acquire returns an Attempt holding the key's lease, or, for a new key,
// one that inserts it with its first commit (Attempt.stored is false); or
// the stored response (replayed, or the failure stored because the key is
// too old); or an error (errWait: look again). raced says the caller's
// last attempt lost the key's insert: a key still missing is then being
// inserted by another attempt's uncommitted transaction.
func (r *Runner) acquire(ctx context.Context, req request, workflow string, raced bool) (*Attempt, Response, error) {
	row, err := r.q.LookupWorkflowKey(ctx, db.LookupWorkflowKeyParams{
		Scope: req.key.Scope, Key: req.key.Value, RejectExpired: r.cfg.ExpiredKeyPolicy == ExpiredKeyReject,
	})
	if err != nil {
		return nil, Response{}, fmt.Errorf("look up key: %w", err)
	}
	if row.Expired {
		return nil, Response{}, r.expiredKey(ctx, req, workflow)
	}
	if !row.ID.Valid {
		if raced {
			return nil, Response{}, r.heldByOther(ctx, req, statusRunning, pointStarted, 0)
		}
		a, resp, err := r.newAttempt(req, workflow, 0, pgtype.Int8{Int64: row.Seed, Valid: true}, pgtype.TID{}, uuid.New(), 1, pointStarted, nil, nil)
		if a != nil {
			a.newID = row.NewID
		}
		return a, resp, err
	}
	resp, err := r.existing(ctx, req, workflow, db.LookupKeyRow{
		ID: row.ID, Fingerprint: row.Fingerprint, Workflow: row.Workflow,
		RecoveryPoint: row.RecoveryPoint, Status: row.Status,
		LeaseLive: row.LeaseLive, LeaseRemainingSeconds: row.LeaseRemainingSeconds, Attempts: row.Attempts,
		ResponseStatus: row.ResponseStatus, ResponseHeaders: row.ResponseHeaders, ResponseBody: row.ResponseBody,
	})
	if !errors.Is(err, errResumable) {
		return nil, resp, err
	}
	return r.takeOver(ctx, req, workflow, row.ID.Int64)
}

// takeOver takes over a key whose lease is free or expired, or fails it if
// it is older than Config.MaxAge: then it returns that stored failure and a
// nil Attempt. errWait: another attempt took it first.
func (r *Runner) takeOver(ctx context.Context, req request, workflow string, id int64) (*Attempt, Response, error) {
	token := uuid.New()
	sent := time.Now()
	taken, err := r.q.TakeOverKey(ctx, db.TakeOverKeyParams{
		ID: id, LeaseToken: token, LeaseSeconds: r.cfg.LeaseDuration.Seconds(),
		MaxAgeSeconds: r.cfg.MaxAge.Seconds(), FailureStatus: failure.Status,
		FailureHeaders: failure.Header, FailureBody: r.maxAgeBody,
	})
	if errors.Is(err, pgx.ErrNoRows) {
		// Another attempt took it over or finished it first: look again.
		return nil, Response{}, errWait
	}
	if err != nil {
		if !pgerr.IsServerRejection(err) {
			// The takeover may have committed unseen: give the lease back.
			err = errors.Join(err, cleanupFailed(r.releaseToken(ctx, id, token)))
		}
		return nil, Response{}, fmt.Errorf("take over key: %w", err)
	}
	if taken.Failed {
		resp, err := storedResponse(taken.ResponseStatus.Int32, taken.ResponseHeaders, taken.ResponseBody)
		if err != nil {
			return nil, Response{}, err
		}
		resp.Replayed = false
		r.noteTooOld(ctx, req, workflow)
		return nil, resp, nil
	}
	a, resp, err := r.newAttempt(req, workflow, id, taken.ForeignKeySeed, taken.Ctid, token, int(taken.Attempts), taken.RecoveryPoint,
		taken.PhaseResults, taken.PhaseResultsRaw)
	if a != nil {
		a.leaseAt = sent
	}
	return a, resp, err
}

// noteTooOld counts and logs a key failed because it is older than MaxAge.
func (r *Runner) noteTooOld(ctx context.Context, req request, workflow string) {
	r.tooOld.Add(1)
	if o := txnbridge.OutcomeFrom(ctx); o != nil {
		o.FailedMaxAge = true
	}
	r.log.WarnContext(ctx, "key older than MaxAge failed instead of resumed; retries replay its failure",
		"scope", req.key.Scope, "key", req.key.Value, "workflow", workflow, "max_age", r.cfg.MaxAge)
}

// keyExpired turns a key insert that met a tombstone (pgerr.KeyExpired)
// into ErrKeyExpired, counted and logged; other errors are returned as
// they are.
func (r *Runner) keyExpired(ctx context.Context, req request, workflow string, err error) error {
	if !pgerr.IsKeyExpired(err) {
		return err
	}
	return r.expiredKey(ctx, req, workflow)
}

// expiredKey counts and logs a retry of a key that was cleaned up, and
// returns ErrKeyExpired.
func (r *Runner) expiredKey(ctx context.Context, req request, workflow string) error {
	r.expiredRejected.Add(1)
	r.log.Log(ctx, r.cfg.HitLogLevel, "key expired: it was used for an operation that finished and was cleaned up; nothing ran",
		"scope", req.key.Scope, "key", req.key.Value, "workflow", workflow)
	return ErrKeyExpired
}

// noteExpiredReuse counts and logs a key run anew under
// ExpiredKeyNewOperation although it had a tombstone.
func (r *Runner) noteExpiredReuse(ctx context.Context, req request, workflow string) {
	r.expiredReused.Add(1)
	r.log.WarnContext(ctx, "expired key reused: run as a new operation (ExpiredKeyNewOperation)",
		"scope", req.key.Scope, "key", req.key.Value, "workflow", workflow)
}

// newAttempt starts an attempt holding the key's lease, or for a new key
// (id 0), one that inserts it with its first commit. The committed phases'
// results are read from jsonb (rows written before results were stored as
// bytes), then from the exact bytes, which win.
func (r *Runner) newAttempt(req request, workflow string, id int64, seed pgtype.Int8, tid pgtype.TID, token uuid.UUID, number int,
	point string, legacyResults, rawResults []byte) (*Attempt, Response, error) {
	a := &Attempt{
		r: r, req: req, workflow: workflow, id: id, seed: seed, tid: tid, token: token, number: number,
		start: point, point: point, results: map[string]json.RawMessage{}, seen: map[string]bool{},
		stored: id != 0, began: time.Now(),
	}
	for _, results := range [][]byte{legacyResults, rawResults} {
		if len(results) == 0 {
			continue
		}
		// Decoding into json.RawMessage keeps each value's bytes as stored.
		var m map[string]json.RawMessage
		if err := json.Unmarshal(results, &m); err != nil {
			return nil, Response{}, fmt.Errorf("decode phase results: %w", err)
		}
		maps.Copy(a.results, m)
	}
	return a, Response{}, nil
}

// execute runs the workflow function with a held lease (or a key to
// insert with its first commit) and settles the key: terminal response
// stored (or, for an unstored rejection before anything took effect, no key
// left), or lease released for a later resume. errRaced: the attempt lost
// the key's insert to a concurrent one; look again.
func (r *Runner) execute(ctx context.Context, a *Attempt, wf *Workflow) (Response, error) {
	resp, err := guard(func() (Response, error) { return wf.fn(ctx, a) })
	switch {
	case a.raced && !a.stored:
		// Whatever the workflow made of the phase's error, the key is
		// someone else's; or this attempt's own, stored by a first commit
		// whose answer was lost: give its lease back, so that the next look
		// takes the key over and resumes it.
		if a.uncertain {
			if err := a.release(ctx, false); err != nil {
				r.logFailure(ctx, a.req, wf.name, err, nil)
			}
		}
		return Response{}, errRaced
	case a.tooOld != nil:
		// A Foreign phase found the key past MaxAge and failed it instead of
		// calling out: that stored failure is the answer.
		return *a.tooOld, nil
	case a.endedBySQL:
		// The key is failed (or was never committed): nothing to release.
		r.logFailure(ctx, a.req, wf.name, errEndedBySQL, nil)
		return Response{}, fmt.Errorf("txn: run workflow %q: %w", wf.name, errEndedBySQL)
	case a.finished != nil && err != nil:
		// The response is stored; an error after Finish changes nothing.
		return Response{}, err
	case a.finished != nil:
		r.executed.Add(1)
		return *a.finished, nil
	case err == nil:
		err = resp.validate()
	}
	if err == nil && !r.cfg.Store(resp.Status) && a.unstarted() {
		if err = a.removeUnstarted(ctx); err == nil {
			r.logNotStored(ctx, a.req, wf.name, resp.Status)
			resp.Replayed = false
			return resp, nil
		}
		err = fmt.Errorf("txn: run workflow %q: remove the key of an unstored response: %w", wf.name, err)
	} else if err == nil {
		// A terminal response returned without Finish (e.g. 402 after a
		// declined charge): store it, fenced, where the workflow stopped.
		if err = a.storeTerminal(ctx, resp); err != nil {
			err = fmt.Errorf("txn: run workflow %q: %w", wf.name, err)
		}
	}
	if err != nil {
		var releaseErr error
		if errors.Is(err, ErrLeaseLost) {
			r.leaseLost.Add(1)
		}
		if !errors.Is(err, ErrLeaseLost) || errors.Is(err, errLostCommit) {
			// The lease is this attempt's (after a lost commit, too).
			releaseErr = a.release(ctx, !errors.Is(err, errLostCommit))
		}
		if a.raced && !a.stored {
			return Response{}, errRaced // storing the response lost the insert
		}
		r.logFailure(ctx, a.req, wf.name, err, releaseErr)
		return Response{}, err
	}
	r.executed.Add(1)
	resp.Replayed = false
	return resp, nil
}

// removeUnstarted leaves no key for a response Config.Store does not store,
// given before anything took effect. A key this attempt never inserted is
// not there; one it inserted is deleted on a fresh context, like a release:
// the key is settled either way.
func (a *Attempt) removeUnstarted(ctx context.Context) error {
	if !a.stored {
		return nil // never inserted: an uncertain first commit is not unstarted
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.r.cfg.ReleaseTimeout)
	defer cancel()
	n, err := a.r.q.DeleteUnstartedKey(dctx, db.DeleteUnstartedKeyParams{
		Scope: a.req.key.Scope, Key: a.req.key.Value, LeaseToken: a.token,
	})
	switch {
	case err != nil:
		return err
	case n == 0:
		return ErrLeaseLost
	}
	return nil
}

// release frees the lease after a transient error, on a fresh context,
// recording the results of foreign calls not committed yet if withPending.
// An error means the key stays held until its lease expires (then a retry
// or recovery takes it). A key this attempt never tried to insert has
// nothing to release.
//
// A first commit that may have taken effect unseen (the key is not known to
// be stored, yet its insert was sent) may still be committing on the
// server: the release then first waits for the key's advisory lock, which
// that transaction holds until it ends, so that it sees its outcome.
func (a *Attempt) release(ctx context.Context, withPending bool) error {
	if a.id == 0 {
		return nil
	}
	p := db.ReleaseKeyParams{ID: a.id, LeaseToken: a.nullToken(), Point: a.point}
	if withPending {
		p.Member, p.Phase = a.pending, a.pendingPoint
	}
	if a.stored {
		return a.r.releaseKey(ctx, a.r.q, p)
	}
	return a.r.underKeyLock(ctx, a.req, func(ctx context.Context, q *db.Queries) error {
		return a.r.releaseKey(ctx, q, p)
	})
}

func (r *Runner) releaseToken(ctx context.Context, id int64, token uuid.UUID) error {
	return r.releaseKey(ctx, r.q, db.ReleaseKeyParams{ID: id, LeaseToken: uuid.NullUUID{UUID: token, Valid: true}})
}

// releaseKey runs ReleaseKey through q, on a fresh context bounded by
// Config.ReleaseTimeout.
func (r *Runner) releaseKey(ctx context.Context, q *db.Queries, p db.ReleaseKeyParams) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	n, err := q.ReleaseKey(rctx, p)
	if err != nil {
		return fmt.Errorf("release key: %w", err)
	}
	if n == 1 {
		r.released.Add(1)
		r.tel.Released(ctx, workflowOf(ctx))
	}
	return nil
}

// Resume continues the operation stored under (scope, value) with its
// stored request, through the workflow registered under its name: the
// recovery path, usable from admin tools too. The workflow sees the same
// params, byte for byte, as the first attempt did. A finished key is
// replayed; a key older than Config.MaxAge is failed instead (its stored
// failure returned); a key held by a live lease gives ErrKeyInUse; an
// unknown key ErrKeyNotFound; a workflow missing from the registry
// ErrUnknownWorkflow (the key is left as it is).
func (r *Runner) Resume(ctx context.Context, scope, value string) (Response, error) {
	ctx, span, start := r.startSpan(ctx, telemetry.SpanResume)
	ctx = withWorkflow(ctx, "") // named once the key is read
	resp, err := r.resume(ctx, scope, value)
	err = markUnavailable(ctx, err)
	r.ended(ctx, span, start, workflowOf(ctx), scope, resp, err)
	return resp, err
}

func (r *Runner) resume(ctx context.Context, scope, value string) (Response, error) {
	for look := 0; ; look++ {
		if err := ctx.Err(); err != nil {
			return Response{}, fmt.Errorf("txn: resume: %w", err)
		}
		row, err := r.q.LookupKeyForResume(ctx, db.LookupKeyForResumeParams{Scope: scope, Key: value})
		if errors.Is(err, pgx.ErrNoRows) {
			return Response{}, fmt.Errorf("txn: resume: %w", ErrKeyNotFound)
		}
		if err != nil {
			if !errors.Is(err, context.Canceled) {
				r.log.WarnContext(ctx, "resume failed: the key could not be read", "scope", scope, "key", value, "error", err)
			}
			return Response{}, fmt.Errorf("txn: resume: look up key: %w", err)
		}
		nameWorkflow(ctx, row.Workflow)
		req := request{
			key:    Key{Scope: scope, Value: value, Method: row.RequestMethod, Path: row.RequestPath, Params: row.RequestParams},
			params: row.RequestParams, fingerprint: row.Fingerprint,
		}
		if row.Status != statusRunning {
			resp, err := r.replay(ctx, req, row.Status, row.ResponseStatus.Int32, row.ResponseHeaders, row.ResponseBody)
			if err != nil {
				return Response{}, fmt.Errorf("txn: resume: %w", err)
			}
			return resp, nil
		}
		wf, ok := r.cfg.Workflows.Lookup(row.Workflow)
		if !ok || row.Workflow == "" {
			return Response{}, fmt.Errorf("txn: resume: %w: %q", ErrUnknownWorkflow, row.Workflow)
		}
		if row.LeaseLive {
			return Response{}, fmt.Errorf("txn: resume: %w",
				r.inUseError(ctx, req, row.Status, row.RecoveryPoint, row.LeaseRemainingSeconds))
		}
		a, resp, err := r.takeOver(ctx, req, wf.name, row.ID)
		switch {
		case errors.Is(err, errWait) && look < 2:
			// Another resumer or a client retry took it over, finished it or
			// failed it between our read and our takeover: look again.
			continue
		case errors.Is(err, errWait):
			return Response{}, fmt.Errorf("txn: resume: %w", r.inUseError(ctx, req, statusRunning, row.RecoveryPoint, 0))
		case err != nil:
			r.logFailure(ctx, req, wf.name, err, nil)
			return Response{}, fmt.Errorf("txn: resume: %w", err)
		case a == nil:
			return resp, nil // failed: older than MaxAge
		}
		noteAttempt(ctx, a.number)
		return r.execute(ctx, a, wf)
	}
}
