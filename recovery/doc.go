// Package recovery finds stalled idempotency keys and resumes or fails them.
//
// A key is stalled when its status is running, its lease is free or expired,
// and it last ran more than [Config.ResumeDelay] ago, all judged by the
// database clock: the client that started the operation crashed, timed out
// or gave up, and nobody is working on it. A [Resumer] round does two things
// with stalled keys:
//
//   - It fails the keys that cannot or must not be resumed, in one fenced
//     UPDATE per batch: keys whose workflow is not registered (or single-phase
//     keys, which cannot be resumed) once they are older than
//     [Config.UnknownWorkflowDelay], keys whose attempts reached
//     [Config.MaxAttempts], and keys older than the runner's MaxAge
//     (txn.Config.MaxAge). A failed key
//     stores a terminal 500 response with an application/problem+json body
//     and a failure_reason ([ReasonUnknownWorkflow], [ReasonMaxAttempts],
//     [ReasonMaxAge]); every later retry of the key replays that response and
//     runs nothing. A key held by a live lease is never failed.
//   - It resumes the others through the registered workflow, with the stored
//     request, from the key's last committed recovery point: the same code the
//     request path runs, so committed phases are skipped and their stored
//     results returned.
//
// Several resumers, in one process or many, may run at once. Each batch of
// candidates is claimed with FOR UPDATE SKIP LOCKED, which spreads the work,
// and each resume takes the key's lease atomically (txn's Runner.Resume), so
// no two attempts ever work on one key.
//
// A Resumer works through the service's own txn.Runner ([New]): its pool, its
// registry of workflows, its lease and its MaxAge. MaxAge must be shorter
// than 24 hours, because payment providers keep their own idempotency keys
// for about that long (Stripe: 24 h) and a foreign phase resumed later could
// charge twice; the runner enforces the same age on client retries, so a
// foreign call is never repeated more than MaxAge after its key was created,
// whoever resumes the operation.
//
// A service resumes its own workflows by running a Resumer in-process with
// the runner its request path uses. A process without user code (such as
// the generic reaper command) passes a runner with an empty registry: it
// cannot resume anything, so it fails stalled keys once they are older than
// UnknownWorkflowDelay, and leaves younger ones to the services.
package recovery
