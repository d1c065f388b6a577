// Package phasectx carries the running phase's idempotency key id through a
// context, so that outbox messages staged in a phase can record which
// operation wrote them without txn and outbox importing each other.
package phasectx

import "context"

type keyIDKey struct{}

// WithKeyID returns ctx carrying the id of the idempotency key whose phase is running.
func WithKeyID(ctx context.Context, id int64) context.Context {
	return context.WithValue(ctx, keyIDKey{}, id)
}

// KeyID returns the id stored by WithKeyID, if any.
func KeyID(ctx context.Context) (int64, bool) {
	id, ok := ctx.Value(keyIDKey{}).(int64)
	return id, ok
}
