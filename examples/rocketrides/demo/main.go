// Command demo is the rocketrides demonstration (`make demo`): it starts the
// payment provider (with faults on), the ride service, the receipts service
// and NATS JetStream, then 50 clients create 2,000 rides, each retrying with
// the same Idempotency-Key on timeouts, 5xx and 409, while the demo kills
// the ride service and the receipts service with SIGKILL three times at
// random moments and restarts them. It then checks that rides, successful
// charges, receipts in JetStream and the receipts service's rows agree one
// to one with no duplicates, prints a report, and exits non-zero if any
// invariant broke.
//
// It uses DATABASE_URL when set (in a fresh schema it drops afterwards),
// otherwise a throwaway PostgreSQL cluster; NATS_URL when set (in a fresh
// stream), otherwise an embedded NATS server. It leaves nothing running.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/examples/rocketrides/rides"
	"github.com/atomicphase/atomicphase/internal/pgcluster"
)

type options struct {
	rides, clients, kills int
	errorRate, dropRate   float64
	latency               time.Duration
	timeout               time.Duration
}

func main() {
	var o options
	flag.IntVar(&o.rides, "rides", 2000, "rides to create")
	flag.IntVar(&o.clients, "clients", 50, "concurrent clients")
	flag.IntVar(&o.kills, "kills", 3, "times the service is killed with SIGKILL and restarted")
	flag.Float64Var(&o.errorRate, "provider-error-rate", 0.05, "provider: share of calls failed with 503")
	flag.Float64Var(&o.dropRate, "provider-drop-rate", 0.03, "provider: share of charges made and then answered by a dropped connection")
	flag.DurationVar(&o.latency, "provider-latency", 20*time.Millisecond, "provider: added latency, uniform up to this")
	flag.DurationVar(&o.timeout, "timeout", 3*time.Minute, "give up after this long")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	if err := run(ctx, o, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "\ndemo: FAILED:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, o options, out io.Writer) error {
	dir, err := os.MkdirTemp("", "rocketrides-demo")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	fmt.Fprintln(out, "building the ride service, the provider and the receipts service...")
	st := &stack{dir: dir, stream: uniqueName("DEMO"), serviceArgs: []string{
		"-resume-delay", "2s", "-resume-interval", "1s", "-provider-timeout", "1s", "-lease", "5s"}}
	st.prefix = st.stream + "."
	st.providerArgs = []string{"-error-rate", fmt.Sprint(o.errorRate), "-drop-rate", fmt.Sprint(o.dropRate), "-latency", o.latency.String()}
	// A receipt left unacknowledged by a killed receipts service comes
	// again after 2 s.
	st.receiptsArgs = []string{"-ack-wait", "2s"}
	if st.bins, err = buildBinaries(ctx, dir); err != nil {
		return err
	}
	if st.logs, err = os.Create(dir + "/processes.log"); err != nil {
		return err
	}

	baseURL := os.Getenv("DATABASE_URL")
	if baseURL == "" {
		fmt.Fprintln(out, "DATABASE_URL is unset: starting a throwaway PostgreSQL cluster...")
		cluster, err := pgcluster.Start(ctx, pgcluster.Options{})
		if err != nil {
			return fmt.Errorf("no database: set DATABASE_URL or install PostgreSQL: %w", err)
		}
		defer cluster.Stop()
		baseURL = cluster.ConnString("postgres")
	}
	admin, err := pgx.Connect(ctx, baseURL)
	if err != nil {
		return err
	}
	defer admin.Close(context.Background())
	schema := uniqueName("rocketrides_demo_")
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		return err
	}
	defer admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
	if st.dbURL, err = withSearchPath(baseURL, schema); err != nil {
		return err
	}

	st.natsURL = os.Getenv("NATS_URL")
	if st.natsURL == "" {
		embedded, err := rides.StartEmbeddedNATS()
		if err != nil {
			return err
		}
		defer embedded.Stop()
		st.natsURL = embedded.URL()
	}
	nc, err := nats.Connect(st.natsURL)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	stream, err := rides.EnsureStream(ctx, js, st.stream, st.prefix)
	if err != nil {
		return err
	}
	defer js.DeleteStream(context.Background(), st.stream)

	if st.providerAddr, err = freeAddr(); err != nil {
		return err
	}
	if st.serviceAddr, err = freeAddr(); err != nil {
		return err
	}
	if st.receiptsAddr, err = freeAddr(); err != nil {
		return err
	}
	defer st.stop()
	if err := st.startProvider(ctx); err != nil {
		return fmt.Errorf("provider: %w (logs: %s)", err, st.logs.Name())
	}
	if err := st.startService(ctx); err != nil {
		return fmt.Errorf("service: %w (logs: %s)", err, st.logs.Name())
	}
	if err := st.startReceipts(ctx); err != nil {
		return fmt.Errorf("receipts service: %w (logs: %s)", err, st.logs.Name())
	}
	fmt.Fprintf(out, "provider faults: %.0f%% 503, %.0f%% charged-then-dropped, up to %v latency; services killed %d times\n\n",
		o.errorRate*100, o.dropRate*100, o.latency, o.kills)

	started := time.Now()
	lg := newLoad(st.serviceAddr, o)
	loadDone := make(chan struct{})
	go func() { lg.run(ctx); close(loadDone) }()

	// Kill the service at random moments while the load runs.
	var killErr error
	killsDone := make(chan struct{})
	go func() {
		defer close(killsDone)
		for i := range o.kills {
			target := int64(float64(o.rides) * (float64(i) + 0.3 + 0.4*rand.Float64()) / float64(o.kills))
			for lg.done.Load() < target {
				select {
				case <-loadDone:
					return
				case <-time.After(20 * time.Millisecond):
				}
			}
			_ = st.killService()
			st.killReceipts()
			lg.kills.Add(1)
			time.Sleep(time.Duration(rand.N(300)) * time.Millisecond)
			if err := st.startService(ctx); err != nil {
				killErr = fmt.Errorf("restart service: %w", err)
				return
			}
			if err := st.startReceipts(ctx); err != nil {
				killErr = fmt.Errorf("restart receipts service: %w", err)
				return
			}
		}
	}()

	ticker := time.NewTicker(500 * time.Millisecond)
	defer ticker.Stop()
progress:
	for {
		select {
		case <-loadDone:
			break progress
		case <-ticker.C:
			fmt.Fprintf(out, "\r%s", lg.progress(time.Since(started)))
		}
	}
	fmt.Fprintf(out, "\r%s\n", lg.progress(time.Since(started)))
	<-killsDone
	if killErr != nil {
		return killErr
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("load did not finish: %w", err)
	}
	elapsed := time.Since(started)

	// Let the relay drain the outbox into JetStream.
	pool, err := pgxpool.New(ctx, st.dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	for {
		var pending int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_messages WHERE published_at IS NULL AND dead_at IS NULL`).Scan(&pending); err != nil {
			return err
		}
		if pending == 0 {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d receipts were never published: %w", pending, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}

	// Let the receipts service handle every receipt: nothing left to
	// deliver, nothing awaiting an acknowledgement.
	receiptsConsumer, err := stream.Consumer(ctx, rides.ReceiptsConsumer)
	if err != nil {
		return err
	}
	for {
		info, err := receiptsConsumer.Info(ctx)
		if err != nil {
			return err
		}
		if info.NumPending == 0 && info.NumAckPending == 0 {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d receipts were never handled by the receipts service: %w", info.NumPending+uint64(info.NumAckPending), ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}

	f, report, err := gather(ctx, pool, stream, receiptsConsumer, lg)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "\n%s", report)
	fmt.Fprintf(out, "throughput:           %.0f rides/s over %v (%d clients)\n", float64(o.rides)/elapsed.Seconds(), elapsed.Round(time.Millisecond), o.clients)
	if bad := check(f); len(bad) > 0 {
		for _, b := range bad {
			fmt.Fprintln(out, "  BROKEN:", b)
		}
		return fmt.Errorf("%d invariants broke (process logs: %s)", len(bad), st.logs.Name())
	}
	fmt.Fprintln(out, "\nOK: every ride was charged at most once, answered consistently, and has exactly one receipt,\n    in JetStream and in the receipts service's table.")
	return nil
}

// gather collects the facts from the database, the provider, JetStream and
// the receipts service.
func gather(ctx context.Context, pool *pgxpool.Pool, stream jetstream.Stream, receipts jetstream.Consumer, lg *load) (facts, string, error) {
	f := facts{Requested: lg.total, Answers: lg.answers(), InconsistentReplays: int(lg.inconsistent.Load())}
	rows, err := pool.Query(ctx, `SELECT id, user_id, status, coalesce(charge_id, '') FROM rides ORDER BY id`)
	if err != nil {
		return f, "", err
	}
	f.Rides, err = pgx.CollectRows(rows, pgx.RowToStructByPos[rideRow])
	if err != nil {
		return f, "", err
	}
	rows, err = pool.Query(ctx, `SELECT id, user_id, status FROM provider_charges ORDER BY id`)
	if err != nil {
		return f, "", err
	}
	f.Charges, err = pgx.CollectRows(rows, pgx.RowToStructByPos[chargeRow])
	if err != nil {
		return f, "", err
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return f, "", err
	}
	if info.State.Msgs > 0 {
		cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
		if err != nil {
			return f, "", err
		}
		batch, err := cons.FetchNoWait(int(info.State.Msgs))
		if err != nil {
			return f, "", err
		}
		for m := range batch.Messages() {
			var rc rides.Receipt
			if err := json.Unmarshal(m.Data(), &rc); err != nil {
				return f, "", fmt.Errorf("bad receipt %q: %w", m.Data(), err)
			}
			f.Receipts = append(f.Receipts, rc)
		}
		if uint64(len(f.Receipts)) != info.State.Msgs {
			return f, "", fmt.Errorf("read %d of %d receipts", len(f.Receipts), info.State.Msgs)
		}
	}
	rows, err = pool.Query(ctx, `SELECT ride_id, charge_id FROM receipts ORDER BY id`)
	if err != nil {
		return f, "", err
	}
	f.ReceiptRows, err = pgx.CollectRows(rows, pgx.RowToStructByPos[receiptRow])
	if err != nil {
		return f, "", err
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM inbox_messages WHERE consumer = $1 AND dead_at IS NOT NULL`,
		rides.ReceiptsConsumer).Scan(&f.DeadLetters); err != nil {
		return f, "", err
	}
	cinfo, err := receipts.Info(ctx)
	if err != nil {
		return f, "", err
	}
	deliveries := cinfo.Delivered.Consumer // every delivery, redeliveries included

	var resumed, failed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE attempts > 1), count(*) FILTER (WHERE status = 'failed')
		FROM idempotency_keys`).Scan(&resumed, &failed); err != nil {
		return f, "", err
	}
	charged, declined := 0, 0
	for _, r := range f.Rides {
		switch r.Status {
		case "charged":
			charged++
		case "declined":
			declined++
		}
	}
	succeeded := 0
	for _, c := range f.Charges {
		if c.Status == "succeeded" {
			succeeded++
		}
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "requests sent:        %d (%d rides, %d retries, %d deliberate replays)\n", lg.requests.Load(), lg.total, lg.retries.Load(), lg.replayChecks.Load())
	fmt.Fprintf(&b, "responses:            201=%d  402=%d  409=%d  5xx=%d  transport errors=%d  replayed=%d\n",
		lg.status(201), lg.status(402), lg.status(409), lg.status5xx(), lg.transport.Load(), lg.replayed.Load())
	fmt.Fprintf(&b, "service kills:        %d (SIGKILL of the ride and receipts services, then restart)\n", lg.kills.Load())
	fmt.Fprintf(&b, "keys taken over:      %d (resumed by a retry or the in-process resumer), failed: %d\n", resumed, failed)
	fmt.Fprintf(&b, "rides in database:    %d (charged %d, declined %d)\n", len(f.Rides), charged, declined)
	fmt.Fprintf(&b, "charges at provider:  %d succeeded, %d declined\n", succeeded, len(f.Charges)-succeeded)
	fmt.Fprintf(&b, "receipts in JetStream: %d\n", len(f.Receipts))
	fmt.Fprintf(&b, "receipts service:     %d rows from %d deliveries (%d redelivered after a kill or a lost ack, acknowledged by the inbox without a second row), %d dead letters\n",
		len(f.ReceiptRows), deliveries, int64(deliveries)-int64(len(f.Receipts)), f.DeadLetters)
	return f, b.String(), nil
}

// load is the load generator: clients that retry with the same key.
type load struct {
	url    string
	total  int
	o      options
	client *http.Client
	next   atomic.Int64
	done   atomic.Int64

	requests, retries, transport, replayed, replayChecks, inconsistent, kills atomic.Int64

	mu       sync.Mutex
	final    map[string]answer
	statuses map[int]int
}

func newLoad(addr string, o options) *load {
	return &load{
		url: "http://" + addr, total: o.rides, o: o,
		client: &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 128}},
		final:  map[string]answer{}, statuses: map[int]int{},
	}
}

func (l *load) run(ctx context.Context) {
	var wg sync.WaitGroup
	for range l.o.clients {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := l.next.Add(1)
				if i > int64(l.total) {
					return
				}
				l.ride(ctx, int(i))
				l.done.Add(1)
			}
		})
	}
	wg.Wait()
}

// ride creates one ride, retrying with the same key until it gets a final
// answer (201 or 402); one ride in ten is sent once more afterwards to see
// the replay.
func (l *load) ride(ctx context.Context, i int) {
	user := fmt.Sprintf("user-%d", i%97)
	if i%20 == 0 {
		user = fmt.Sprintf("declined-%d", i%7)
	}
	key := uuid.NewString()
	body, _ := json.Marshal(map[string]float64{
		"origin_lat": 48.8 + rand.Float64()/10, "origin_lon": 2.3 + rand.Float64()/10,
		"target_lat": 48.8 + rand.Float64()/10, "target_lon": 2.3 + rand.Float64()/10,
	})
	backoff := 50 * time.Millisecond
	var first *answer
	for attempt := 0; ctx.Err() == nil; attempt++ {
		if attempt > 0 {
			l.retries.Add(1)
			time.Sleep(backoff/2 + rand.N(backoff/2))
			backoff = min(backoff*2, time.Second)
		}
		status, resp, replayed, err := l.post(ctx, user, key, body)
		if err != nil {
			l.transport.Add(1)
			continue
		}
		l.count(status)
		if replayed {
			l.replayed.Add(1)
		}
		if status != 201 && status != 402 {
			continue // 409 in use, 5xx: retry with the same key
		}
		a := answer{Status: status, Body: resp}
		if first == nil {
			first = &a
			l.mu.Lock()
			l.final[key] = a
			l.mu.Unlock()
			if i%10 != 0 {
				return
			}
			l.replayChecks.Add(1)
			continue // send it once more: it must replay
		}
		if first.Status != a.Status || !bytes.Equal(first.Body, a.Body) || !replayed {
			l.inconsistent.Add(1)
		}
		return
	}
}

func (l *load) post(ctx context.Context, user, key string, body []byte) (int, []byte, bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, l.url+"/rides", bytes.NewReader(body))
	if err != nil {
		return 0, nil, false, err
	}
	req.Header.Set("Authorization", "Bearer "+user)
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	l.requests.Add(1)
	resp, err := l.client.Do(req)
	if err != nil {
		return 0, nil, false, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, nil, false, err
	}
	return resp.StatusCode, b, resp.Header.Get("Idempotent-Replayed") == "true", nil
}

func (l *load) count(status int) {
	l.mu.Lock()
	l.statuses[status]++
	l.mu.Unlock()
}

func (l *load) status(code int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.statuses[code]
}

func (l *load) status5xx() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for code, c := range l.statuses {
		if code >= 500 {
			n += c
		}
	}
	return n
}

func (l *load) answers() map[string]answer {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]answer, len(l.final))
	for k, v := range l.final {
		out[k] = v
	}
	return out
}

func (l *load) progress(elapsed time.Duration) string {
	return fmt.Sprintf("rides %4d/%d  requests %5d  retries %4d  409s %4d  5xx %4d  replays %4d  kills %d  %5.1fs",
		l.done.Load(), l.total, l.requests.Load(), l.retries.Load(), l.status(409), l.status5xx(), l.replayed.Load(),
		l.kills.Load(), elapsed.Seconds())
}
