package txntest

import "errors"

// Sentinel errors, matched with errors.Is. The package returns them wrapped
// with its name and the operation ("txntest: provider call: ..."), so their
// own text carries neither.
var (
	// ErrUnavailable: the Provider answered as a service that is down (an
	// HTTP 503) before doing anything, as a fault injected with
	// Provider.FailNext. A retry under the same key performs the effect.
	ErrUnavailable = errors.New("service unavailable (503): nothing was done")

	// ErrReplyLost: the Provider performed the effect (or found it done
	// under the key) and then its reply was lost, as a fault injected with
	// Provider.FailNext: the caller cannot tell whether anything happened.
	// A retry under the same key gets the effect's result, and no second
	// effect.
	ErrReplyLost = errors.New("the reply was lost after the effect took place")

	// ErrKeyReused: the key was first used with a different request, which
	// a real payment provider refuses too (Stripe answers 400). Nothing was
	// done. A workflow must send the same request on every attempt.
	ErrKeyReused = errors.New("idempotency key reused with a different request")

	// ErrNoKey: the call carried no idempotency key. The fake refuses it:
	// without a key, a call repeated after a crash cannot be deduplicated.
	ErrNoKey = errors.New("no idempotency key")
)
