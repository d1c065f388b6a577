package usercode

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCallTurnsAPanicIntoAnError(t *testing.T) {
	t.Parallel()
	onPanic := func(v any, stack []byte) error {
		require.Contains(t, string(stack), "usercode_test.go")
		return fmt.Errorf("panicked: %v", v)
	}
	v, err := Call(func() (int, error) { panic("boom") }, onPanic)
	require.Zero(t, v)
	require.EqualError(t, err, "panicked: boom")

	v, err = Call(func() (int, error) { return 7, nil }, onPanic)
	require.NoError(t, err)
	require.Equal(t, 7, v)

	wantErr := errors.New("plain")
	_, err = Call(func() (int, error) { return 0, wantErr }, onPanic)
	require.Same(t, wantErr, err)
}
