package pgbouncer_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/inbox"
	"github.com/atomicphase/atomicphase/inbox/natsin"
	"github.com/atomicphase/atomicphase/inbox/webhookin"
	"github.com/atomicphase/atomicphase/internal/opstest"
	"github.com/atomicphase/atomicphase/internal/outboxtest"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/monitor"
	"github.com/atomicphase/atomicphase/outbox"
	"github.com/atomicphase/atomicphase/outbox/webhook"
)

// redriveByIDAndAll: outbox.Redrive returns dead letters named by message
// id and by row id, refuses one that is not dead, and returns the rest
// with All.
func redriveByIDAndAll(t *testing.T, tg target) {
	ctx := context.Background()
	var rows []int64
	var ids []uuid.UUID
	for range 4 {
		row, id := opstest.InsertMessage(t, tg.d.Pool, opstest.Message{State: "dead", Attempts: 3, LastError: "410 Gone"})
		rows, ids = append(rows, row), append(ids, id)
	}
	_, pendingID := opstest.InsertMessage(t, tg.d.Pool, opstest.Message{})

	_, err := outbox.Redrive(ctx, tg.pool, outbox.RedriveSelection{IDs: []uuid.UUID{ids[0], pendingID}})
	require.ErrorIs(t, err, outbox.ErrNotDeadLettered)
	require.ErrorContains(t, err, pendingID.String())

	got, err := outbox.Redrive(ctx, tg.pool, outbox.RedriveSelection{IDs: []uuid.UUID{ids[0]}, RowIDs: []int64{rows[1]}})
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.Equal(t, ids[0], got[0].ID)
	require.Equal(t, rows[1], got[1].RowID)
	require.Equal(t, 3, got[0].Attempts)
	require.Equal(t, "410 Gone", got[0].LastError)

	got, err = outbox.Redrive(ctx, tg.pool, outbox.RedriveSelection{All: true, Topic: "receipts"})
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.Zero(t, tg.d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL`))
}

// inboxHandleAndDeadLetter: Handle runs a message's handler once and
// acknowledges the redelivery as a duplicate; DeadLetter records a message
// with its headers once.
func inboxHandleAndDeadLetter(t *testing.T, tg target) {
	ctx := context.Background()
	sqlExec(t, tg.d, `CREATE TABLE receipts (message_id text NOT NULL, body text NOT NULL)`)
	in, err := inbox.New(tg.pool, &inbox.Config{Consumer: "receipts", Logger: quiet})
	require.NoError(t, err)
	id := uuid.Must(uuid.NewV7()).String()
	handle := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO receipts (message_id, body) VALUES ($1, $2)`, id, `{"ride":42}`)
		return err
	}
	for want := range []inbox.Outcome{inbox.Handled, inbox.Duplicate} {
		out, err := in.Handle(ctx, id, handle)
		require.NoError(t, err)
		require.Equal(t, []inbox.Outcome{inbox.Handled, inbox.Duplicate}[want], out)
	}
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM receipts`))

	dead := inbox.Message{ID: uuid.Must(uuid.NewV7()).String(), Topic: "ride.receipt", Payload: []byte{0, 1, 2},
		Headers: map[string][]string{"Content-Type": {"application/json"}}, Deliveries: 5}
	for want := range []bool{true, false} {
		ok, err := in.DeadLetter(ctx, dead, errors.New("handler: 22P02"))
		require.NoError(t, err)
		require.Equal(t, want == 0, ok)
	}
	out, err := in.Handle(ctx, dead.ID, handle)
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out, "a dead letter's redelivery is acknowledged")
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM inbox_messages WHERE message_id = $1
		AND payload = '\x000102'::bytea AND headers->'Content-Type'->>0 = 'application/json'`, dead.ID))
}

// webhookReceived: the webhook receiver, called by the outbox's webhook
// publisher twice with one message, answers 2xx both times and runs its
// handler once.
func webhookReceived(t *testing.T, tg target) {
	ctx := context.Background()
	sqlExec(t, tg.d, `CREATE TABLE events (id text NOT NULL, body bytea NOT NULL)`)
	in, err := inbox.New(tg.pool, &inbox.Config{Consumer: "webhooks", Logger: quiet})
	require.NoError(t, err)
	secret := webhook.NewSecret()
	h, err := webhookin.New(in, func(ctx context.Context, tx pgx.Tx, req webhookin.Request) error {
		_, err := tx.Exec(ctx, `INSERT INTO events (id, body) VALUES ($1, $2)`, req.ID, req.Body)
		return err
	}, &webhookin.Config{Secrets: []string{secret}})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	defer srv.Close()
	pub, err := webhook.New(webhook.Config{URL: srv.URL, Secrets: []string{secret}})
	require.NoError(t, err)
	msg := outbox.Envelope{ID: uuid.Must(uuid.NewV7()), Topic: "ride.receipt", Payload: []byte(`{"ride_id":42}`), Attempt: 1}
	for range 2 {
		res := outbox.NewResults(1)
		pub.Publish(ctx, []outbox.Envelope{msg}, res)
		require.True(t, res.Reported(0))
		require.NoError(t, res.Err(0))
	}
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM events WHERE body = convert_to('{"ride_id":42}', 'UTF8')`))
	require.Equal(t, webhookin.Stats{Handled: 1, Duplicates: 1}, h.Stats())
}

var (
	natsOnce sync.Once
	natsURL  string
	natsStop = func() {}
)

// sharedNATS returns TEST_NATS_URL, or an in-process JetStream server
// started for the test binary.
func sharedNATS() string {
	natsOnce.Do(func() {
		if natsURL = os.Getenv(outboxtest.EnvNATSURL); natsURL == "" {
			natsURL, natsStop = outboxtest.ExampleNATS()
			pgtest.AtExit(natsStop)
		}
	})
	return natsURL
}

// natsConsumed: the JetStream consumer handles each message once and
// acknowledges it after the commit; a message already handled is a
// duplicate.
func natsConsumed(t *testing.T, tg target) {
	ctx := context.Background()
	sqlExec(t, tg.d, `CREATE TABLE receipts (message_id text NOT NULL, body text NOT NULL)`)
	js := outboxtest.Conn(t, sharedNATS())
	stream := outboxtest.NewStream(t, js, time.Minute)
	_, err := js.CreateOrUpdateConsumer(ctx, stream.Name, jetstream.ConsumerConfig{
		Durable: "receipts", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second, MaxDeliver: 5,
	})
	require.NoError(t, err)
	id := uuid.Must(uuid.NewV7()).String()
	for _, msgID := range []string{id, id, uuid.Must(uuid.NewV7()).String()} {
		m := nats.NewMsg(stream.Prefix + "receipt")
		m.Header.Set(jetstream.MsgIDHeader, msgID)
		m.Data = []byte(`{"ride_id":42}`)
		_, err := js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	in, err := inbox.New(tg.pool, &inbox.Config{Consumer: "receipts", Logger: quiet})
	require.NoError(t, err)
	c, err := natsin.New(in, js, func(ctx context.Context, tx pgx.Tx, msg natsin.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO receipts (message_id, body) VALUES ($1, $2)`, msg.ID, msg.Data)
		return err
	}, &natsin.Config{Stream: stream.Name, Consumer: "receipts", FetchWait: time.Second})
	require.NoError(t, err)
	n, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n, "the stream deduplicated the republished id")
	n, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "both were acknowledged")
	require.Equal(t, 2, tg.d.Count(t, `SELECT count(*) FROM receipts`))
	require.Equal(t, natsin.Stats{Acked: 2}, c.Stats())

	// A message already handled is acknowledged as a duplicate.
	out, err := in.Handle(ctx, id, func(context.Context, pgx.Tx) error { return errors.New("must not run") })
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out)
}

// monitorSnapshot: monitor.Read reads every figure in one statement.
func monitorSnapshot(t *testing.T, tg target) {
	opstest.InsertMessage(t, tg.d.Pool, opstest.Message{Age: time.Minute})
	opstest.InsertMessage(t, tg.d.Pool, opstest.Message{State: "dead"})
	opstest.InsertKey(t, tg.d.Pool, opstest.Key{Scope: "acct", Key: "stalled", Age: time.Hour})
	opstest.InsertKey(t, tg.d.Pool, opstest.Key{Scope: "acct", Key: "failed", Status: "failed", Age: time.Hour})
	s, err := monitor.Read(context.Background(), tg.pool, nil)
	require.NoError(t, err)
	require.Equal(t, int64(1), s.OutboxPending)
	require.Equal(t, int64(1), s.OutboxDead)
	require.Equal(t, int64(1), s.KeysRunning)
	require.Equal(t, int64(1), s.KeysStalled)
	require.Equal(t, int64(1), s.KeysFailed)
	require.InDelta(t, time.Minute.Seconds(), s.OldestPendingAge.Seconds(), 30)
	require.InDelta(t, time.Hour.Seconds(), s.OldestStalledAge.Seconds(), 30)
}

var (
	adminOnce sync.Once
	adminBin  string
	adminErr  error
)

func buildAdmin(t *testing.T) string {
	t.Helper()
	adminOnce.Do(func() {
		dir, err := os.MkdirTemp("", "atomicphase-bouncer")
		if err != nil {
			adminErr = err
			return
		}
		pgtest.AtExit(func() { _ = os.RemoveAll(dir) })
		adminBin = filepath.Join(dir, "atomicphase")
		out, err := exec.Command("go", "build", "-o", adminBin, "github.com/atomicphase/atomicphase/cmd/atomicphase").CombinedOutput()
		if err != nil {
			adminErr = errors.New(err.Error() + ": " + string(out))
		}
	})
	require.NoError(t, adminErr)
	return adminBin
}

// adminCommands: every database command of cmd/atomicphase, with --json.
func adminCommands(t *testing.T, tg target) {
	bin := buildAdmin(t)
	run := func(args ...string) []byte {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, append([]string{"--json"}, args...)...)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+tg.connString)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		require.NoError(t, cmd.Run(), "%s\n%s", strings.Join(args, " "), stderr.String())
		return stdout.Bytes()
	}
	keyID := opstest.InsertKey(t, tg.d.Pool, opstest.Key{Scope: "acct", Key: "ride-1", Workflow: "ride",
		RecoveryPoint: "ride_created", Age: time.Hour, PhaseResults: `{"ride_created": 42}`})
	opstest.InsertMessage(t, tg.d.Pool, opstest.Message{KeyID: keyID, Topic: "receipts", Age: time.Minute})
	_, deadID := opstest.InsertMessage(t, tg.d.Pool, opstest.Message{State: "dead", Topic: "webhooks", LastError: "410 Gone"})
	opstest.InsertMessage(t, tg.d.Pool, opstest.Message{State: "dead", Topic: "webhooks", LastError: "410 Gone"})

	require.Contains(t, string(run("keys", "show", "acct", "ride-1")), `"ride_created"`)
	require.Contains(t, string(run("keys", "stalled")), `"ride-1"`)
	require.Contains(t, string(run("outbox", "status")), `"pending"`)
	require.Contains(t, string(run("outbox", "dead", "--topic", "webhooks")), deadID.String())
	run("outbox", "redrive", "--yes", deadID.String())
	run("outbox", "redrive", "--yes", "--all", "--topic", "webhooks")
	require.Zero(t, tg.d.Count(t, `SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL`))
	run("keys", "fail", "--yes", "acct", "ride-1", "--reason", "operator: refunded by hand")
	require.Equal(t, 1, tg.d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'ride-1' AND status = 'failed'`))
}

// reaperHTTP: the reaper's status page, health check and metrics, which
// read the database at each request, answer 200.
func reaperHTTP(t *testing.T, tg target) {
	bin := buildReaper(t)
	opstest.InsertMessage(t, tg.d.Pool, opstest.Message{State: "dead", LastError: "410 Gone"})
	opstest.InsertKey(t, tg.d.Pool, opstest.Key{Scope: "acct", Key: "failed", Status: "failed", Age: time.Hour})
	cmd := exec.Command(bin, "-interval", "1h", "-http", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+tg.connString)
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	lines := make(chan map[string]any, 64)
	go func() {
		defer close(lines)
		dec := json.NewDecoder(stderr)
		for {
			var l map[string]any
			if dec.Decode(&l) != nil {
				_, _ = io.Copy(io.Discard, stderr)
				return
			}
			lines <- l
		}
	}()
	defer func() {
		_ = cmd.Process.Kill()
		for range lines { // drain until the pipe closes
		}
		_ = cmd.Wait()
	}()
	var addr string
	var round bool
	timeout := time.After(time.Minute)
	for addr == "" || !round {
		select {
		case l, ok := <-lines:
			require.True(t, ok, "the reaper exited")
			require.NotEqual(t, "ERROR", l["level"], "%v", l)
			if l["msg"] == "reaper http listening" {
				addr, _ = l["addr"].(string)
			}
			round = round || l["msg"] == "reaper round"
		case <-timeout:
			t.Fatal("no round and address within a minute")
		}
	}
	for path, want := range map[string]string{
		"/":        `410 Gone`,
		"/healthz": `"schema":"current"`,
		"/metrics": `\natomicphase_outbox_dead\{[^}]*\} 1\n`,
	} {
		resp, err := http.Get("http://" + addr + path)
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", path, body)
		require.Regexp(t, want, string(body), path)
	}
}
