package txn

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/atomicphase/atomicphase/internal/db"
)

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
	resp, err := guard(func() (Response, error) { return wf.fn(ctx, a) })
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
