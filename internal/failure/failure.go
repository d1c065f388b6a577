// Package failure builds the terminal response stored for an operation that
// atomicphase stops instead of completing: by the recovery Resumer's failure
// rules, or by txn when a key is past its maximum age. Every statement that
// fails a key stores this one shape, so a client sees the same answer
// whichever path stopped its operation.
package failure

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// Reasons, stored in a failed key's failure_reason column and in the
// "reason" member of its problem response.
const (
	ReasonUnknownWorkflow = "unknown_workflow"
	ReasonMaxAttempts     = "max_attempts"
	ReasonMaxAge          = "max_age"
	// ReasonOperator: an operator failed the key (atomicphase keys fail).
	// The stored failure_reason is "operator: " and the operator's words;
	// the response carries only this reason.
	ReasonOperator = "operator"
	// ReasonEndedByFunction: the operation's own code ended its database
	// transaction through SQL (COMMIT sent as a statement), so what it
	// wrote may have committed without its outcome; it is not run again.
	ReasonEndedByFunction = "ended_by_function"
)

// Status is the HTTP status stored for a failed key.
const Status = http.StatusInternalServerError

// Header is the stored response header of a failed key, as JSON.
const Header = `{"Content-Type":["application/problem+json"]}`

// Body returns the RFC 9457 problem body stored for a key failed for
// reason; why completes "The operation could not be completed: ...".
func Body(reason, why string) []byte {
	b, _ := json.Marshal(struct { // cannot fail: strings and an int only
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
		Reason string `json:"reason"`
	}{
		Title:  "Operation could not be completed",
		Status: Status,
		Detail: "The operation could not be completed: " + why + ". Retrying with the same idempotency key returns this response.",
		Reason: reason,
	})
	return b
}

// MaxAgeBody is the body stored for a key failed because it is older than maxAge.
func MaxAgeBody(maxAge time.Duration) []byte {
	return Body(ReasonMaxAge, fmt.Sprintf(
		"it did not finish within %v of its first attempt, so it was stopped after its last completed step", maxAge))
}

// EndedByFunctionBody is the body stored for a key whose operation ended its
// own database transaction (ReasonEndedByFunction).
func EndedByFunctionBody() []byte {
	return Body(ReasonEndedByFunction, "its code ended its database transaction itself (COMMIT or ROLLBACK sent as SQL), "+
		"so what it wrote before may have been saved without its result; it is not run again")
}
