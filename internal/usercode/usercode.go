// Package usercode runs functions a library user wrote, so that a panic in
// them becomes an error of the operation instead of ending the process.
package usercode

import "runtime/debug"

// Call runs fn and returns its results. If fn panics, Call returns the
// error that onPanic makes of the panic's value and the panicking
// goroutine's stack, so the caller can roll back and report it like any
// other failure.
func Call[T any](fn func() (T, error), onPanic func(value any, stack []byte) error) (v T, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = onPanic(p, debug.Stack())
		}
	}()
	return fn()
}
