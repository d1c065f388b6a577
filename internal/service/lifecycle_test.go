package service_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/atomicphase/atomicphase/cleanup"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/internal/service"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/recovery"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// block is a run function that holds until its context ends.
func block(started chan<- struct{}) func(context.Context) {
	return func(ctx context.Context) {
		started <- struct{}{}
		<-ctx.Done()
	}
}

func TestStartRefusesWhileRunningAndStopWaitsForTheRun(t *testing.T) {
	t.Parallel()
	var l service.Lifecycle
	l.Stop() // never started: nothing to do
	started := make(chan struct{}, 1)
	ended := make(chan struct{})
	require.NoError(t, l.Start(context.Background(), nil, func(ctx context.Context) {
		started <- struct{}{}
		<-ctx.Done()
		close(ended)
	}))
	<-started
	require.ErrorIs(t, l.Start(context.Background(), nil, block(started)), service.ErrAlreadyStarted)
	l.Stop()
	select {
	case <-ended:
	default:
		t.Fatal("Stop returned before the run did")
	}
	l.Stop() // again: nothing to do

	require.NoError(t, l.Start(context.Background(), nil, block(started)), "restartable after Stop")
	<-started
	l.Stop()
}

func TestRunWhoseContextEndedCanBeStartedAgain(t *testing.T) {
	t.Parallel()
	var l service.Lifecycle
	started := make(chan struct{}, 1)
	ended := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, l.Start(ctx, nil, func(ctx context.Context) {
		started <- struct{}{}
		<-ctx.Done()
		close(ended)
	}))
	<-started
	cancel()
	<-ended
	require.Eventually(t, func() bool { return l.Start(context.Background(), nil, block(started)) == nil },
		5*time.Second, time.Millisecond, "a run that ended with its context is not running")
	<-started
	l.Stop()
}

func TestPrepareErrorStartsNothing(t *testing.T) {
	t.Parallel()
	var l service.Lifecycle
	errPrepare := errors.New("broker unreachable")
	ran := false
	err := l.Start(context.Background(), func(context.Context) error { return errPrepare }, func(context.Context) { ran = true })
	require.ErrorIs(t, err, errPrepare)
	l.Stop()
	require.False(t, ran)
	started := make(chan struct{}, 1)
	require.NoError(t, l.Start(context.Background(), func(context.Context) error { return nil }, block(started)))
	<-started
	l.Stop()
}

func TestEveryRunsARoundAtOnceThenEachIntervalUntilStopped(t *testing.T) {
	t.Parallel()
	round := func(rounds chan<- struct{}) func(context.Context) {
		return func(context.Context) {
			select {
			case rounds <- struct{}{}:
			default:
			}
		}
	}
	// At once: with an hour's interval, only the first round can come.
	var slow service.Lifecycle
	first := make(chan struct{}, 1)
	require.NoError(t, slow.Start(context.Background(), nil, service.Every(time.Hour, round(first))))
	<-first
	slow.Stop()

	// Then every interval, until Stop.
	var l service.Lifecycle
	rounds := make(chan struct{}, 1)
	require.NoError(t, l.Start(context.Background(), nil, service.Every(time.Millisecond, round(rounds))))
	for range 3 {
		<-rounds
	}
	l.Stop()
	select {
	case <-rounds: // the last round may have run before Stop
	default:
	}
	select {
	case <-rounds:
		t.Fatal("a round ran after Stop returned")
	default:
	}
}

// One error names a double start in every background service, so a caller
// matches it with any package's name.
func TestEveryServiceSharesOneAlreadyStartedError(t *testing.T) {
	t.Parallel()
	for name, err := range map[string]error{
		"outbox":   outbox.ErrAlreadyStarted,
		"cleanup":  cleanup.ErrAlreadyStarted,
		"recovery": recovery.ErrAlreadyStarted,
	} {
		require.ErrorIs(t, err, service.ErrAlreadyStarted, name)
	}
	require.ErrorIs(t, outbox.ErrAlreadyStarted, cleanup.ErrAlreadyStarted)
	require.ErrorIs(t, recovery.ErrAlreadyStarted, outbox.ErrAlreadyStarted)
}

// Stop returns once the run has returned, so a loop count taken right after
// Stop is 0 every time: the goroutine closing done after its run must not
// be counted as a loop still running (that race failed a CI run).
func TestNoLoopRunningRightAfterStop(t *testing.T) {
	t.Parallel()
	for i := range 500 {
		var l service.Lifecycle
		started := make(chan struct{}, 1)
		pgtest.WithLoopLabel(t, context.Background(), func(ctx context.Context) {
			require.NoError(t, l.Start(ctx, nil, block(started)))
		})
		<-started
		require.Equal(t, 1, pgtest.LoopsRunning(t), "iteration %d: the loop runs", i)
		l.Stop()
		require.Zero(t, pgtest.LoopsRunning(t), "iteration %d: no loop after Stop", i)
	}
}
