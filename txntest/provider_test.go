package txntest_test

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/txntest"
)

func newProvider(t *testing.T) *txntest.Provider {
	return txntest.NewProvider(t, txntest.DB(t))
}

func TestProviderPerformsOneEffectPerKey(t *testing.T) {
	t.Parallel()
	p := newProvider(t)
	ctx := context.Background()
	first, err := p.Call(ctx, "k1", map[string]int{"cents": 100})
	require.NoError(t, err)
	again, err := p.Call(ctx, "k1", map[string]int{"cents": 100})
	require.NoError(t, err)
	require.Equal(t, first, again, "the same key gives the first call's result")
	other, err := p.Call(ctx, "k2", map[string]int{"cents": 100})
	require.NoError(t, err)
	require.NotEqual(t, first, other)

	effects := p.Effects(t)
	require.Len(t, effects, 2)
	require.Equal(t, txntest.Effect{ID: first, Key: "k1", Request: []byte(`{"cents":100}`)}, effects[0])
	calls := p.Calls(t)
	require.Len(t, calls, 3)
	require.Equal(t, []txntest.Outcome{txntest.OutcomeEffect, txntest.OutcomeReplayed, txntest.OutcomeEffect},
		[]txntest.Outcome{calls[0].Outcome, calls[1].Outcome, calls[2].Outcome})
}

func TestProviderDeduplicatesConcurrentCallsWithOneKey(t *testing.T) {
	t.Parallel()
	p := newProvider(t)
	var wg sync.WaitGroup
	ids := make([]string, 20)
	for i := range ids {
		wg.Go(func() {
			id, err := p.Call(context.Background(), "same", "charge")
			require.NoError(t, err)
			ids[i] = id
		})
	}
	wg.Wait()
	for _, id := range ids {
		require.Equal(t, ids[0], id)
	}
	require.Len(t, p.Effects(t), 1)
	require.Len(t, p.Calls(t), 20)
}

func TestProviderRefusesAKeyReusedWithAnotherRequest(t *testing.T) {
	t.Parallel()
	p := newProvider(t)
	ctx := context.Background()
	_, err := p.Call(ctx, "k", map[string]int{"cents": 100})
	require.NoError(t, err)
	_, err = p.Call(ctx, "k", map[string]int{"cents": 999})
	require.ErrorIs(t, err, txntest.ErrKeyReused)
	require.Len(t, p.Effects(t), 1)
	require.Equal(t, txntest.OutcomeRejected, p.Calls(t)[1].Outcome)
}

func TestProviderRefusesACallWithoutAKey(t *testing.T) {
	t.Parallel()
	p := newProvider(t)
	_, err := p.Call(context.Background(), "", "charge")
	require.ErrorIs(t, err, txntest.ErrNoKey)
	require.Empty(t, p.Calls(t))
	require.Empty(t, p.Effects(t))
}

func TestProviderUnavailableFaultDoesNothing(t *testing.T) {
	t.Parallel()
	p := newProvider(t)
	ctx := context.Background()
	p.FailNext(txntest.Unavailable)
	_, err := p.Call(ctx, "k", "charge")
	require.ErrorIs(t, err, txntest.ErrUnavailable)
	require.Empty(t, p.Effects(t), "a 503 comes before the effect")
	id, err := p.Call(ctx, "k", "charge")
	require.NoError(t, err, "the fault was for one call")
	require.Len(t, p.Effects(t), 1)
	require.Equal(t, id, p.Effects(t)[0].ID)
	require.Equal(t, txntest.OutcomeUnavailable, p.Calls(t)[0].Outcome)
}

func TestProviderLostReplyComesAfterTheEffect(t *testing.T) {
	t.Parallel()
	p := newProvider(t)
	ctx := context.Background()
	p.FailNext(txntest.NoFault, txntest.ReplyLost)
	_, err := p.Call(ctx, "a", "charge")
	require.NoError(t, err, "NoFault serves the first call")
	_, err = p.Call(ctx, "b", "charge")
	require.ErrorIs(t, err, txntest.ErrReplyLost)
	require.Len(t, p.Effects(t), 2, "the effect took place")
	id, err := p.Call(ctx, "b", "charge")
	require.NoError(t, err)
	require.Equal(t, p.Effects(t)[1].ID, id, "a retry under the key gets the effect's result")
	require.Len(t, p.Effects(t), 2, "and no second effect")
	calls := p.Calls(t)
	require.True(t, calls[1].ReplyLost)
	require.Equal(t, txntest.OutcomeReplayed, calls[2].Outcome)
}
