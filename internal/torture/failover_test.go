package torture

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgcluster"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/migrations"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/natspub"
	"github.com/atomicphase/atomicphase/txn"
)

// The failover suite: a primary and a streaming standby of their own, built
// from the installed PostgreSQL binaries; clients reach whichever is primary
// through a multi-host connection string with target_session_attrs =
// read-write. Under load from 32 clients (3-phase workflows with a foreign
// call and an outbox message, and single-phase Runs, each retried with the
// same key until it is acknowledged), the primary is killed with SIGKILL at
// a random moment and the standby promoted. TORTURE_ITERATIONS repeats each
// mode.

// replicatedPair starts a primary and a standby streaming from it, both
// removed when the test ends, whether it passed or not.
func replicatedPair(t *testing.T, ctx context.Context, synchronous bool) (primary, standby *pgcluster.Cluster) {
	t.Helper()
	settings := map[string]string{}
	if synchronous {
		// A commit returns once the standby has flushed it.
		settings["synchronous_standby_names"] = "'*'"
		settings["synchronous_commit"] = "on"
	}
	primary, err := pgcluster.Start(ctx, pgcluster.Options{Settings: settings})
	if errors.Is(err, pgcluster.ErrNoBinaries) && os.Getenv("CI") == "" {
		t.Skip("needs PostgreSQL server binaries for a replicated pair of its own; CI has them")
	}
	require.NoError(t, err)
	t.Cleanup(func() { _ = primary.Stop() })
	// The standby is promoted with no standby of its own: it commits alone.
	// It retries a lost WAL stream every 100 ms, not 5 s, so that a
	// promotion after a failed primary does not wait out the default.
	standby, err = primary.StartStandby(ctx, pgcluster.Options{Port: 5433,
		Settings: map[string]string{"wal_retrieve_retry_interval": "100ms"}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = standby.Stop() })
	return primary, standby
}

const paymentsSchema = `
CREATE TABLE payments (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key text NOT NULL, attempt int NOT NULL);`

// failoverLoad is the state of one failover run.
type failoverLoad struct {
	pool   *pgxpool.Pool // the replicated pair, through the multi-host string
	runner *txn.Runner
	flow   *flow
	keys   int // operations: even ones are workflows, odd ones single-phase Runs

	mu    sync.Mutex
	acked map[int]ackedOp // operations acknowledged to their client
	errs  map[string]int  // errors clients saw, by HTTP status
	bad   []error         // errors a client must never see
}

type ackedOp struct{ body string }

func singleKey(i int) txn.Key {
	return txn.Key{Scope: "tenant", Value: fmt.Sprintf("pay-%d", i), Method: "POST", Path: "/payments",
		Params: []byte(`{"amount":1250}`)}
}

func (l *failoverLoad) run(ctx context.Context, i int) (txn.Response, error) {
	if i%2 == 0 {
		return l.runner.RunWorkflow(ctx, orderKey(i), l.flow.wf)
	}
	key := singleKey(i)
	return l.runner.Run(ctx, key, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO payments (key, attempt) VALUES ($1, 1) RETURNING id`, key.Value).Scan(&id); err != nil {
			return txn.Response{}, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, 'paid', 1)`, key.Value); err != nil {
			return txn.Response{}, err
		}
		return txn.JSON(201, map[string]any{"payment_id": id})
	})
}

// note records an error a client saw. Every one must be one a client
// retries: 503 (the database is unavailable) or 409 (the key is held by an
// attempt that died with the primary, until its lease expires).
func (l *failoverLoad) note(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	status := txn.HTTPStatus(err)
	l.errs[fmt.Sprint(status)]++
	if status != 503 && status != 409 {
		l.bad = append(l.bad, err)
	}
}

func TestFailover(t *testing.T) {
	t.Parallel()
	// Synchronous replication promises the most: it runs 5 times as often.
	for mode, runs := range map[string]int{"synchronous": 5, "asynchronous": 1} {
		t.Run(mode, func(t *testing.T) {
			for it := range runs * iterations() {
				t.Run(fmt.Sprint(it), func(t *testing.T) { failoverOnce(t, mode == "synchronous", uint64(it)) })
			}
		})
	}
}

func failoverOnce(t *testing.T, synchronous bool, seed uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rng := rand.New(rand.NewPCG(seed, uint64(time.Now().UnixNano())))
	primary, standby := replicatedPair(t, ctx, synchronous)
	cfg, err := pgxpool.ParseConfig(pgcluster.ConnStringReadWrite("postgres", primary, standby))
	require.NoError(t, err)
	cfg.MaxConns = 32
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Up(ctx, pool))
	_, err = pool.Exec(ctx, flowSchema+paymentsSchema)
	require.NoError(t, err)

	// The payment provider is outside the failed-over cluster, as a real one
	// is: what it was asked survives the failover.
	provider := newDB(t)
	stream := "FAILOVER" + strings.ToUpper(pgtestSuffix(provider))
	js, st := newStream(t, stream)
	reg := txn.NewRegistry()
	f := newFlow(t, provider.Pool, reg, stream+".orders")
	// Synchronous replication is what FailoverKeepsCommits promises: its
	// runs call out without the read before the call; asynchronous ones
	// keep the default.
	runner, err := txn.New(pool, &txn.Config{Workflows: reg, Logger: quietLogger(t),
		LeaseDuration: time.Second, ReleaseTimeout: 300 * time.Millisecond, FailoverKeepsCommits: synchronous})
	require.NoError(t, err)

	pub, err := natspub.New(js, &natspub.Config{Streams: []string{stream}})
	require.NoError(t, err)
	relay, err := outbox.New(pool, pub, &outbox.Config{Logger: quietLogger(t), PollInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, relay.Start(ctx))

	l := &failoverLoad{pool: pool, runner: runner, flow: f, keys: 400,
		acked: map[int]ackedOp{}, errs: map[string]int{}}
	var next, done atomic.Int64
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= l.keys {
					return
				}
				for {
					resp, err := l.run(ctx, i)
					if err == nil {
						l.mu.Lock()
						l.acked[i] = ackedOp{body: string(resp.Body)}
						l.mu.Unlock()
						done.Add(1)
						break
					}
					if ctx.Err() != nil {
						t.Errorf("operation %d never completed: %v", i, err)
						return
					}
					l.note(err)
					time.Sleep(20 * time.Millisecond) // a client's pause before it retries
				}
			}
		})
	}

	// A random moment in the middle of the load.
	for done.Load() < int64(l.keys/8+rng.IntN(l.keys/2)) {
		time.Sleep(time.Millisecond)
	}
	var lagged time.Duration
	if !synchronous {
		// Replication lags, as under a burst or a slow link: the commits
		// of the last moments before the crash never reach the standby.
		resume, err := standby.PauseReplication()
		require.NoError(t, err)
		lagged = time.Duration(100+rng.IntN(200)) * time.Millisecond
		time.Sleep(lagged)
		require.NoError(t, primary.Kill())
		resume()
	} else {
		require.NoError(t, primary.Kill())
	}
	ackedAtKill := int(done.Load())
	promoteStart := time.Now()
	require.NoError(t, standby.Promote(ctx))
	promotion := time.Since(promoteStart)

	// Acknowledged, but not finished on the new primary: lost, wholly or
	// from a phase on. (An answer can reach its client after the kill: it
	// was in the socket's buffer.)
	wg.Wait()
	var lost []int
	l.mu.Lock()
	for i := range l.acked {
		if !l.finished(t, ctx, i) {
			lost = append(lost, i)
		}
	}
	l.mu.Unlock()
	slices.Sort(lost)
	require.Empty(t, l.bad, "clients saw only errors they retry (503, 409)")

	if synchronous {
		require.Empty(t, lost, "synchronous replication loses no acknowledged operation")
	} else {
		// A client whose acknowledged operation was lost retries it (or
		// its retry was in flight): the retry runs it again, once, and
		// its foreign call goes out under the key the lost run used.
		for _, i := range lost {
			// 409 until the lease the lost attempt's last surviving commit
			// set (1 s) expires, as for any client (see note).
			var resp txn.Response
			require.Eventually(t, func() bool {
				resp, err = l.run(ctx, i)
				require.True(t, err == nil || errors.Is(err, txn.ErrKeyInUse), "%v", err)
				return err == nil
			}, 10*time.Second, 50*time.Millisecond)
			require.False(t, resp.Replayed, "the lost operation runs again")
			resp, err = l.run(ctx, i)
			require.NoError(t, err)
			require.True(t, resp.Replayed, "and only once")
		}
	}
	// Acknowledged responses: every acknowledged operation that was not
	// lost still answers what its client was told.
	for i, op := range l.acked {
		if slices.Contains(lost, i) {
			continue
		}
		resp, err := l.run(ctx, i)
		require.NoError(t, err)
		require.True(t, resp.Replayed, "operation %d replays", i)
		require.Equal(t, op.body, string(resp.Body), "operation %d answers what its client was acknowledged", i)
	}

	relay.Stop()
	relayAll(t, pool, js, stream)
	d := &pgtest.DB{Pool: pool}
	wfKeys := l.keys / 2
	require.Equal(t, l.keys, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'finished'`), "every key finished")
	require.Equal(t, 0, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status <> 'finished'`), "none failed, none left running")
	require.Equal(t, wfKeys, d.Count(t, `SELECT count(*) FROM orders`), "one order per workflow")
	require.Equal(t, l.keys-wfKeys, d.Count(t, `SELECT count(*) FROM payments`), "one payment per single-phase run")
	require.Equal(t, 0, d.Count(t, `SELECT count(*) FROM (SELECT key, effect FROM effects GROUP BY 1, 2 HAVING count(*) > 1) d`), "no effect twice")
	require.Equal(t, 2*wfKeys+(l.keys-wfKeys), d.Count(t, `SELECT count(*) FROM effects`), "every effect once")
	require.Equal(t, wfKeys, provider.Count(t, `SELECT count(*) FROM provider_charges`),
		"one charge per workflow at the provider: no foreign call repeated under another derived key")

	published := streamMessages(t, ctx, st)
	byKey := map[string]int{}
	for _, m := range published {
		byKey[m.key]++
	}
	require.Len(t, byKey, wfKeys, "every workflow's message was published")
	dupKeys := 0
	for _, n := range byKey {
		if n > 1 {
			dupKeys++
		}
	}
	// Every message the new primary holds was published under its own id
	// with its own payload: no id was handed out twice.
	rows, err := pool.Query(ctx, `SELECT message_id::text, payload FROM outbox_messages`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) ([2]string, error) {
		var id string
		var payload []byte
		err := r.Scan(&id, &payload)
		return [2]string{id, string(payload)}, err
	})
	require.NoError(t, err)
	require.Len(t, ids, wfKeys)
	for _, row := range ids {
		m, ok := published[row[0]]
		require.True(t, ok, "message %s published", row[0])
		require.JSONEq(t, row[1], m.payload, "message id %s names one message", row[0])
	}
	if synchronous {
		require.Zero(t, dupKeys, "every message published exactly once by key")
	}
	t.Logf("failover (%s): %d operations, %d acknowledged before the kill, lag %v, promotion %v; lost %d acknowledged %v; "+
		"keys published twice (a lost run's message and its rerun's) %d; errors clients retried %v",
		map[bool]string{true: "synchronous", false: "asynchronous"}[synchronous], l.keys, ackedAtKill, lagged,
		promotion.Round(time.Millisecond), len(lost), lost, dupKeys, l.errs)
}

// finished reports whether operation i's key is finished on the server now.
func (l *failoverLoad) finished(t *testing.T, ctx context.Context, i int) bool {
	key := orderKey(i)
	if i%2 == 1 {
		key = singleKey(i)
	}
	var n int
	require.NoError(t, l.pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND key = $2 AND status = 'finished'`,
		key.Scope, key.Value).Scan(&n))
	return n == 1
}

type streamMessage struct{ key, payload string }

// streamMessages reads every message of the stream, by Nats-Msg-Id.
func streamMessages(t *testing.T, ctx context.Context, st jetstream.Stream) map[string]streamMessage {
	t.Helper()
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	out := map[string]streamMessage{}
	for range info.State.Msgs {
		msg, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
		require.NoError(t, err)
		var p struct {
			Key string `json:"key"`
		}
		require.NoError(t, json.Unmarshal(msg.Data(), &p))
		id := msg.Headers().Get(jetstream.MsgIDHeader)
		_, dup := out[id]
		require.False(t, dup, "message id %s published twice", id)
		out[id] = streamMessage{key: p.Key, payload: string(msg.Data())}
	}
	return out
}

// A phase in flight while the primary dies and the standby is promoted is
// retried or released, never failed. An atomic phase whose transaction was
// open on the old primary gives the client ErrUnavailable (503), and the
// client's retry completes the operation on the new primary: the first
// phase's transaction also carried the key's insert, so nothing of the
// operation is left, and the retry runs it as new; a later phase leaves
// the key resumable. A foreign call in flight has its result recorded on the new
// primary by the same attempt while its lease holds (else, the same 503 and
// retry). Either way: each effect once, the provider called under one key.
func TestPhaseAcrossPromotionIsRetriedNeverFailed(t *testing.T) {
	t.Parallel()
	for _, phase := range []string{"order_created", "charged"} {
		t.Run(phase, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			primary, standby := replicatedPair(t, ctx, true)
			pool, err := pgxpool.New(ctx, pgcluster.ConnStringReadWrite("postgres", primary, standby)+" connect_timeout=2")
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			require.NoError(t, migrations.Up(ctx, pool))
			_, err = pool.Exec(ctx, flowSchema)
			require.NoError(t, err)
			provider := newDB(t)
			reg := txn.NewRegistry()
			f := newFlow(t, provider.Pool, reg, "unused.orders")
			inPhase, failedOver := make(chan struct{}), make(chan struct{})
			var first atomic.Bool
			first.Store(true)
			f.delay = func() time.Duration {
				if f.phase.Load() == phase && first.CompareAndSwap(true, false) {
					close(inPhase)
					<-failedOver
				}
				return 0
			}
			runner, err := txn.New(pool, &txn.Config{Workflows: reg, Logger: quietLogger(t),
				LeaseDuration: time.Second, ReleaseTimeout: 300 * time.Millisecond})
			require.NoError(t, err)

			res := make(chan error, 1)
			go func() { _, err := runner.RunWorkflow(ctx, orderKey(1), f.wf); res <- err }()
			<-inPhase
			require.NoError(t, primary.Kill())
			require.NoError(t, standby.Promote(ctx))
			close(failedOver)
			err = <-res
			d := &pgtest.DB{Pool: pool}
			if phase == "order_created" {
				// Its transaction was open on the dead primary.
				require.ErrorIs(t, err, txn.ErrUnavailable, "%v", err)
			}
			if err != nil {
				require.ErrorIs(t, err, txn.ErrUnavailable, "%v", err)
				require.Equal(t, 503, txn.HTTPStatus(err))
				running := 1 // resumable, not failed
				if phase == "order_created" {
					running = 0 // the key went with the phase's transaction
				}
				require.Equal(t, running, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'running'`), "resumable or absent, not failed")
				require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status <> 'running'`), "not failed")
				// The client retries: in use until the dead attempt's lease
				// expires, then taken over and completed.
				require.Eventually(t, func() bool {
					_, err = runner.RunWorkflow(ctx, orderKey(1), f.wf)
					require.True(t, err == nil || errors.Is(err, txn.ErrKeyInUse), "%v", err)
					return err == nil
				}, 30*time.Second, 50*time.Millisecond)
			}
			// else: the foreign call's result was recorded on the new primary
			// by the same attempt, whose lease had not expired.
			require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'finished'`))
			require.Equal(t, 0, d.Count(t, `SELECT count(*) FROM (SELECT effect FROM effects GROUP BY 1 HAVING count(*) > 1) d`), "no effect twice")
			require.Equal(t, 2, d.Count(t, `SELECT count(*) FROM effects`))
			require.Equal(t, 1, provider.Count(t, `SELECT count(*) FROM provider_charges`))
			require.Equal(t, 1, provider.Count(t, `SELECT count(DISTINCT foreign_key) FROM provider_calls`), "one foreign key")
		})
	}
}
