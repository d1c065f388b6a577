package txn

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/atomicphase/atomicphase/internal/db"
	"github.com/atomicphase/atomicphase/internal/failure"
	"github.com/atomicphase/atomicphase/internal/pgerr"
	"github.com/atomicphase/atomicphase/internal/telemetry"
	"github.com/atomicphase/atomicphase/internal/txnbridge"
	"github.com/atomicphase/atomicphase/internal/txnhook"
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
	for {
		if err := ctx.Err(); err != nil {
			return Response{}, fmt.Errorf("txn: run workflow %q: %w", wf.name, err)
		}
		a, resp, err := r.acquire(ctx, req, wf.name)
		if errors.Is(err, errWait) {
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
		return r.execute(ctx, a, wf)
	}
}

// acquire returns an Attempt holding the key's lease, or the stored
// response (replayed, or the failure stored because the key is too old), or
// an error (errWait: look again).
func (r *Runner) acquire(ctx context.Context, req request, workflow string) (*Attempt, Response, error) {
	row, err := r.q.LookupKey(ctx, db.LookupKeyParams{Scope: req.key.Scope, Key: req.key.Value})
	if errors.Is(err, pgx.ErrNoRows) {
		token := uuid.New()
		var ins db.InsertKeyRow
		r.at(txnhook.BeforeCommit, txnhook.CommitKey, "", 1, "")
		ins, err = r.q.InsertKey(ctx, db.InsertKeyParams{
			Scope: req.key.Scope, Key: req.key.Value, Fingerprint: req.fingerprint,
			RequestMethod: req.key.Method, RequestPath: req.key.Path, RequestParams: req.params,
			Workflow: workflow, LeaseToken: token, LeaseSeconds: r.cfg.LeaseDuration.Seconds(),
			RejectExpired: r.cfg.ExpiredKeyPolicy == ExpiredKeyReject,
		})
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			// Inserted concurrently: committed (look again) or in flight.
			row, err = r.q.LookupKey(ctx, db.LookupKeyParams{Scope: req.key.Scope, Key: req.key.Value})
			if errors.Is(err, pgx.ErrNoRows) {
				return nil, Response{}, r.heldByOther(ctx, req, statusRunning, pointStarted, 0)
			}
		case err != nil:
			if !pgerr.IsServerRejection(err) {
				// The insert may have committed unseen, holding the key
				// for a whole lease: remove it, so that a retry runs.
				err = errors.Join(err, cleanupFailed(r.removeUnseenInsert(ctx, req, token)))
			}
			return nil, Response{}, fmt.Errorf("insert key: %w", r.keyExpired(ctx, req, workflow, err))
		default:
			if ins.ReusedExpired {
				r.noteExpiredReuse(ctx, req, workflow)
			}
			r.at(txnhook.AfterCommit, txnhook.CommitKey, "", 1, "")
			return r.newAttempt(req, workflow, ins.ID, ins.ForeignKeySeed, ins.Ctid, token, 1, pointStarted, nil, nil)
		}
	}
	if err != nil {
		return nil, Response{}, fmt.Errorf("look up key: %w", err)
	}
	resp, err := r.existing(ctx, req, workflow, row)
	if !errors.Is(err, errResumable) {
		return nil, resp, err
	}
	return r.takeOver(ctx, req, workflow, row.ID)
}

// removeUnseenInsert deletes the key this attempt's insert may have created
// although the caller saw an error (the connection failed around its
// commit), on a fresh context bounded by Config.ReleaseTimeout. Nothing ran
// under it. It first waits on the key's advisory lock, which the insert's
// transaction holds until it ends, so that an insert still committing on
// the server is seen (read committed: the DELETE's snapshot follows the
// lock). It returns an error only if the removal failed.
func (r *Runner) removeUnseenInsert(ctx context.Context, req request, token uuid.UUID) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	err := pgx.BeginTxFunc(rctx, r.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		q := r.q.WithTx(tx)
		if err := q.LockKey(rctx, db.LockKeyParams{Scope: req.key.Scope, Key: req.key.Value}); err != nil {
			return err
		}
		n, err := q.DeleteUnstartedKey(rctx, db.DeleteUnstartedKeyParams{
			Scope: req.key.Scope, Key: req.key.Value, LeaseToken: token,
		})
		if n == 1 {
			r.released.Add(1)
			r.tel.Released(ctx, workflowOf(ctx))
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("remove the key the insert may have created (it becomes free when its lease of %v expires): %w",
			r.cfg.LeaseDuration, err)
	}
	return nil
}

// takeOver takes over a key whose lease is free or expired, or fails it if
// it is older than Config.MaxAge: then it returns that stored failure and a
// nil Attempt. errWait: another attempt took it first.
func (r *Runner) takeOver(ctx context.Context, req request, workflow string, id int64) (*Attempt, Response, error) {
	token := uuid.New()
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
	return r.newAttempt(req, workflow, id, taken.ForeignKeySeed, taken.Ctid, token, int(taken.Attempts), taken.RecoveryPoint,
		taken.PhaseResults, taken.PhaseResultsRaw)
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

// newAttempt starts an attempt holding the key's lease. The committed
// phases' results are read from jsonb (rows written before results were
// stored as bytes), then from the exact bytes, which win.
func (r *Runner) newAttempt(req request, workflow string, id int64, seed pgtype.Int8, tid pgtype.TID, token uuid.UUID, number int,
	point string, legacyResults, rawResults []byte) (*Attempt, Response, error) {
	a := &Attempt{
		r: r, req: req, workflow: workflow, id: id, seed: seed, tid: tid, token: token, number: number,
		start: point, point: point, results: map[string]json.RawMessage{}, seen: map[string]bool{},
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

// execute runs the workflow function with a held lease and settles the key:
// terminal response stored (or, for an unstored rejection before anything
// took effect, the key removed), or lease released for a later resume.
func (r *Runner) execute(ctx context.Context, a *Attempt, wf *Workflow) (Response, error) {
	resp, err := guard(func() (Response, error) { return wf.fn(ctx, a) })
	switch {
	case a.tooOld != nil:
		// A Foreign phase found the key past MaxAge and failed it instead of
		// calling out: that stored failure is the answer.
		return *a.tooOld, nil
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
		// A rejection before anything took effect: leave no key. On a
		// fresh context, like a release: the key is settled either way.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
		n, derr := r.q.DeleteUnstartedKey(dctx, db.DeleteUnstartedKeyParams{
			Scope: a.req.key.Scope, Key: a.req.key.Value, LeaseToken: a.token,
		})
		cancel()
		switch {
		case derr != nil:
			err = fmt.Errorf("txn: run workflow %q: remove the key of an unstored response: %w", wf.name, derr)
		case n == 0:
			err = fmt.Errorf("txn: run workflow %q: remove the key of an unstored response: %w", wf.name, ErrLeaseLost)
		default:
			r.logNotStored(ctx, a.req, wf.name, resp.Status)
			resp.Replayed = false
			return resp, nil
		}
	} else if err == nil {
		// A terminal response returned without Finish (e.g. 402 after a
		// declined charge): store it, fenced, where the workflow stopped.
		a.at(txnhook.BeforeCommit, txnhook.CommitResponse, a.point, "")
		if err = a.store(ctx, r.q, resp, a.point); err != nil {
			err = fmt.Errorf("txn: run workflow %q: %w", wf.name, err)
		} else {
			a.at(txnhook.AfterCommit, txnhook.CommitResponse, a.point, "")
		}
	}
	if err != nil {
		var releaseErr error
		if errors.Is(err, ErrLeaseLost) {
			r.leaseLost.Add(1)
		}
		if !errors.Is(err, ErrLeaseLost) || errors.Is(err, errLostCommit) {
			// The lease is this attempt's (after a lost commit, too).
			releaseErr = r.release(ctx, a)
		}
		r.logFailure(ctx, a.req, wf.name, err, releaseErr)
		return Response{}, err
	}
	r.executed.Add(1)
	resp.Replayed = false
	return resp, nil
}

// release frees the lease after a transient error, on a fresh context. An
// error means the key stays held until its lease expires (then a retry or
// recovery takes it).
func (r *Runner) release(ctx context.Context, a *Attempt) error {
	return r.releaseToken(ctx, a.id, a.token)
}

func (r *Runner) releaseToken(ctx context.Context, id int64, token uuid.UUID) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ReleaseTimeout)
	defer cancel()
	n, err := r.q.ReleaseKey(rctx, db.ReleaseKeyParams{ID: id, LeaseToken: uuid.NullUUID{UUID: token, Valid: true}})
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
