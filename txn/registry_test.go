package txn_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txn"
)

func TestRegisterRejectsInvalidWorkflowsAndDuplicateNames(t *testing.T) {
	t.Parallel()
	reg := txn.NewRegistry()
	noop := func(context.Context, *txn.Attempt) (txn.Response, error) { return txn.Response{Status: 200}, nil }
	require.ErrorIs(t, reg.Register(nil), txn.ErrInvalidUse)
	require.ErrorIs(t, reg.Register(txn.NewWorkflow("", noop)), txn.ErrInvalidUse)
	require.ErrorIs(t, reg.Register(txn.NewWorkflow("x", nil)), txn.ErrInvalidUse)
	require.NoError(t, reg.Register(txn.NewWorkflow("x", noop)))
	require.ErrorIs(t, reg.Register(txn.NewWorkflow("x", noop)), txn.ErrInvalidUse, "duplicate name")
	require.Equal(t, []string{"x"}, reg.Names())
}
