// Package httpidem is net/http middleware that runs mutating requests under
// idempotency keys, following the IETF Idempotency-Key header draft and
// Stripe's behaviour.
//
// It reads the Idempotency-Key header (an RFC 8941 sf-string, "like-this",
// or a bare token), requires it on POST and PATCH by default, takes the key's
// scope from a caller-supplied function (the authenticated principal, so
// one client never sees another's response; an empty one is refused unless
// Config.AllowAnonymous), fingerprints method, path and JSON body, and runs
// the handler inside the key's transaction (txn.Run): the handler's writes,
// the key and the response commit together, and a retry gets the stored
// response byte for byte with Idempotent-Replayed: true. A serialization
// failure in the handler's statements, even one it answered with a 500,
// runs the handler again with the full body and a fresh response, and is
// never stored; when it persists the answer is 409 with Retry-After.
// Errors are answered as application/problem+json: 400 for a missing or
// invalid key or body, 401 without a principal, 409 (with Retry-After)
// while another request holds the key, 422 for the same key with another
// payload, 413 for a body over the limit, 503 (with Retry-After) while the
// database is unavailable (txn.ErrUnavailable). Multi-phase operations use
// Middleware.Workflow.
package httpidem
