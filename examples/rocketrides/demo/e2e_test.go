package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/examples/rocketrides/rides"
	"github.com/atomicphase/atomicphase/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var (
	buildOnce sync.Once
	built     binaries
	buildErr  error
	buildDir  string
)

func builtBinaries(t *testing.T) binaries {
	t.Helper()
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "rocketrides-e2e")
		if buildErr == nil {
			dir := buildDir
			pgtest.AtExit(func() { _ = os.RemoveAll(dir) })
			built, buildErr = buildBinaries(context.Background(), buildDir)
		}
	})
	require.NoError(t, buildErr)
	return built
}

// newStack starts the provider and NATS for one test, in its own schema.
func newStack(t *testing.T, serviceArgs ...string) (*stack, *pgtest.DB, jetstream.Stream) {
	t.Helper()
	ctx := context.Background()
	d := pgtest.New(t)
	st := &stack{dir: t.TempDir(), stream: uniqueName("E2E"), serviceArgs: serviceArgs}
	st.prefix = st.stream + "."
	st.bins = builtBinaries(t)
	st.receiptsArgs = []string{"-ack-wait", "2s"}
	var err error
	st.dbURL, err = withSearchPath(d.URL, d.Schema)
	require.NoError(t, err)
	st.logs, err = os.Create(st.dir + "/processes.log")
	require.NoError(t, err)
	embedded, err := rides.StartEmbeddedNATS()
	require.NoError(t, err)
	t.Cleanup(embedded.Stop)
	st.natsURL = embedded.URL()
	nc, err := nats.Connect(st.natsURL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	stream, err := rides.EnsureStream(ctx, js, st.stream, st.prefix)
	require.NoError(t, err)
	st.providerAddr, err = freeAddr()
	require.NoError(t, err)
	st.serviceAddr, err = freeAddr()
	require.NoError(t, err)
	st.receiptsAddr, err = freeAddr()
	require.NoError(t, err)
	t.Cleanup(func() {
		st.stop()
		if t.Failed() {
			logs, _ := os.ReadFile(st.logs.Name())
			t.Logf("process logs:\n%s", logs)
		}
		_ = st.logs.Close()
	})
	require.NoError(t, st.startProvider(ctx))
	require.NoError(t, st.startReceipts(ctx))
	return st, d, stream
}

func postRide(st *stack, key string) (int, []byte, http.Header, error) {
	body := []byte(`{"origin_lat":48.85,"origin_lon":2.35,"target_lat":48.87,"target_lon":2.30}`)
	req, _ := http.NewRequest(http.MethodPost, "http://"+st.serviceAddr+"/rides", bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer rider-1")
	req.Header.Set("Idempotency-Key", key)
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, resp.Header, err
}

func providerCharges(t *testing.T, st *stack) int {
	t.Helper()
	resp, err := http.Get("http://" + st.providerAddr + "/charges?user=rider-1")
	require.NoError(t, err)
	defer resp.Body.Close()
	var out struct {
		Charges []json.RawMessage `json:"charges"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&out))
	return len(out.Charges)
}

// poll calls cond in the test's own goroutine until it returns true, and
// fails the test if that takes longer than timeout. Unlike require.Eventually
// and require.Never, it leaves no condition running when it returns: Never
// returns on its timer while its last check may still be in flight, and such
// a check once outlived the test, met the NATS connection the test's cleanup
// had closed, and failed the test with "nats: connection closed".
func poll(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s did not happen", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func streamMsgs(t *testing.T, stream jetstream.Stream) uint64 {
	t.Helper()
	info, err := stream.Info(context.Background())
	require.NoError(t, err)
	return info.State.Msgs
}

// The service is SIGKILLed after the provider charged the card, before the
// final phase, which would have recorded the charge with the ride's end. Whoever finishes the ride —
// the in-process resumer of the restarted service, or the client's retry —
// the provider holds one charge, JetStream one receipt, and the receipts
// service one row.
func TestSIGKILLBetweenChargeAndFinalPhase(t *testing.T) {
	t.Parallel()
	for name, finisher := range map[string][]string{
		"resumer finishes": {"-resume-delay", "1s", "-resume-interval", "200ms", "-lease", "2s"},
		"retry finishes":   {"-resume-delay", "1h", "-lease", "2s"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			st, d, stream := newStack(t, finisher...)
			require.NoError(t, st.startService(ctx, "-crash-after-phase", "charge_created"))

			_, _, _, err := postRide(st, "ride-key-1")
			require.Error(t, err, "the service died mid-request")
			require.NoError(t, st.waitService(30*time.Second))
			require.Equal(t, 1, providerCharges(t, st), "charged before the crash")
			// The charge's result was in hand, not recorded: the next commit
			// (the final phase) would have recorded it. The operation resumes
			// after ride_created and calls the provider again under the same
			// foreign key, which the provider deduplicates.
			require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'running' AND recovery_point = 'ride_created'`))

			require.NoError(t, st.startService(ctx))
			if name == "resumer finishes" {
				poll(t, 30*time.Second, "the resumer finished the ride", func() bool {
					return d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE status = 'finished'`) == 1
				})
			}
			var status int
			var body []byte
			var header http.Header
			poll(t, 30*time.Second, "the retry got an answer other than 409", func() bool {
				status, body, header, err = postRide(st, "ride-key-1")
				return err == nil && status != http.StatusConflict // 409 until the dead holder's lease expires
			})
			require.Equal(t, http.StatusCreated, status, string(body))
			var created rides.Created
			require.NoError(t, json.Unmarshal(body, &created))
			require.NotEmpty(t, created.ChargeID)
			if name == "resumer finishes" {
				require.Equal(t, "true", header.Get("Idempotent-Replayed"))
			}

			require.Equal(t, 1, providerCharges(t, st), "one charge at the provider")
			require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM rides`))
			require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM rides WHERE status = 'charged' AND charge_id = $1`, created.ChargeID))
			// Once the relay has marked the receipt published it never
			// publishes it again, so the stream's count is final.
			poll(t, 30*time.Second, "the relay published the receipt", func() bool {
				return d.Count(t, `SELECT count(*) FROM outbox_messages WHERE published_at IS NOT NULL`) == 1
			})
			require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM outbox_messages`), "one receipt staged")
			require.Equal(t, uint64(1), streamMsgs(t, stream), "the receipt is published once")
			poll(t, 30*time.Second, "the receipts service wrote the receipt", func() bool {
				return d.Count(t, `SELECT count(*) FROM receipts`) == 1
			})
			require.Equal(t, 1, d.Count(t, `SELECT count(*) FROM receipts WHERE charge_id = $1`, created.ChargeID))
		})
	}
}
