package httpidem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

// The acceptance test of Wrap under contention: 200 orders from 20
// concurrent clients, each decrementing one stock row, so SERIALIZABLE
// transactions conflict all the time. The handler cannot return an error;
// when its statement fails it answers 500 itself, as handlers do. Every
// request must end 201, or 409 with Retry-After once the conflict outlasted
// the retries; none 500. The handler sees the full body on every run, and
// the stock falls by exactly the number of 201s.
func TestWrapUnderContentionAnswers201Or409NeverA500(t *testing.T) {
	t.Parallel()
	const requests, clients, stock = 200, 20, 1000
	d := pgtest.New(t)
	ctx := context.Background()
	_, err := d.Pool.Exec(ctx, `CREATE TABLE stock (sku text PRIMARY KEY, qty int NOT NULL)`)
	require.NoError(t, err)
	_, err = d.Pool.Exec(ctx, `INSERT INTO stock VALUES ('book', $1)`, stock)
	require.NoError(t, err)
	runner, err := txn.New(d.Pool, &txn.Config{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	mw, err := httpidem.New(runner, &httpidem.Config{
		Scope:  func(r *http.Request) (string, error) { return r.Header.Get("X-User"), nil },
		Logger: slog.New(slog.DiscardHandler),
	})
	require.NoError(t, err)

	var runs, shortBodies atomic.Int64
	handler := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		var in struct {
			SKU string `json:"sku"`
			Qty int    `json:"qty"`
			Pad string `json:"pad"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.SKU == "" || len(in.Pad) != 512 {
			shortBodies.Add(1)
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		tx, _ := httpidem.Tx(r.Context())
		var left int
		err := tx.QueryRow(r.Context(), `SELECT qty FROM stock WHERE sku = $1`, in.SKU).Scan(&left)
		if err == nil {
			_, err = tx.Exec(r.Context(), `UPDATE stock SET qty = $1 WHERE sku = $2`, left-in.Qty, in.SKU)
		}
		if err != nil {
			http.Error(w, "storage failed", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"left":%d}`, left-in.Qty)
	}))
	srv := httptest.NewServer(handler)
	defer srv.Close()

	body := `{"sku":"book","qty":1,"pad":"` + strings.Repeat("p", 512) + `"}`
	var created, conflicted atomic.Int64
	var mu sync.Mutex
	others := map[int]int{}
	next := make(chan int, requests)
	for i := range requests {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range next {
				req, err := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(body))
				require.NoError(t, err)
				req.Header.Set("X-User", "client-"+strconv.Itoa(c))
				req.Header.Set("Idempotency-Key", "order-"+strconv.Itoa(i))
				resp, err := http.DefaultClient.Do(req)
				require.NoError(t, err)
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				switch {
				case resp.StatusCode == 201:
					created.Add(1)
				case resp.StatusCode == 409 && resp.Header.Get("Retry-After") != "":
					conflicted.Add(1)
				default:
					mu.Lock()
					others[resp.StatusCode]++
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	t.Logf("201: %d, 409: %d, handler runs: %d, serialization retries: %d",
		created.Load(), conflicted.Load(), runs.Load(), runner.Stats().Retries)
	require.Empty(t, others, "every request ends 201 or 409 with Retry-After")
	require.Equal(t, int64(requests), created.Load()+conflicted.Load())
	require.Zero(t, shortBodies.Load(), "every run saw the full body")
	var left int
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT qty FROM stock`).Scan(&left))
	require.Equal(t, stock-int(created.Load()), left, "stock fell by exactly the number of 201s")
	require.Equal(t, int(created.Load()), d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE response_status = 201`))
	require.Zero(t, d.Count(t, `SELECT count(*) FROM idempotency_keys WHERE response_status <> 201`), "nothing else stored")
	require.Greater(t, runner.Stats().Retries, uint64(0), "the test did contend")
}

// A handler run again after a serialization failure gets the whole body
// again and a fresh response: nothing the failed run wrote leaks into it.
func TestRetriedHandlerSeesFullBodyAndFreshResponse(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	_, err := d.Pool.Exec(ctx, `CREATE SEQUENCE tries`)
	require.NoError(t, err)
	runner, err := txn.New(d.Pool, &txn.Config{RetryBaseDelay: time.Millisecond})
	require.NoError(t, err)
	mw, err := httpidem.New(runner, &httpidem.Config{Scope: func(*http.Request) (string, error) { return "alice", nil }})
	require.NoError(t, err)
	var bodies []string
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		bodies = append(bodies, string(b))
		w.Header().Set("X-Run", strconv.Itoa(len(bodies)))
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte("run " + strconv.Itoa(len(bodies)) + ";"))
		tx, _ := httpidem.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), `DO $$ BEGIN IF nextval('tries') = 1 THEN
			RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END IF; END $$`); err != nil {
			w.WriteHeader(http.StatusInternalServerError) // too late: a 200 is written
			return
		}
	})))
	defer srv.Close()
	req, err := http.NewRequest("POST", srv.URL, strings.NewReader(`{"sku":"book"}`))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "k")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, []string{`{"sku":"book"}`, `{"sku":"book"}`}, bodies)
	require.Equal(t, 200, resp.StatusCode)
	require.Equal(t, "run 2;", string(got), "the first run's output is gone")
}
