package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The README's quickstart is this program, byte for byte, so what a reader
// pastes compiles and is the code the example below runs.
func TestReadmeQuickstartIsThisProgram(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	program, err := os.ReadFile("main.go")
	require.NoError(t, err)
	_, section, ok := bytes.Cut(readme, []byte("\n## Quickstart\n"))
	require.True(t, ok, "README has no Quickstart section")
	_, block, ok := bytes.Cut(section, []byte("\n```go\n"))
	require.True(t, ok, "the Quickstart section has no Go block")
	block, _, ok = bytes.Cut(block, []byte("\n```\n"))
	require.True(t, ok, "the Quickstart's Go block is not closed")
	require.Equal(t, string(program), string(block)+"\n", "copy examples/orders/main.go into the README's Quickstart")
}

// The quickstart's handler on a schema of its own: the first request
// creates the order, a retry replays it, the same key with another body is
// refused, and a request the client must correct is answered without
// keeping its key.
func Example() {
	db, done := pgtest.Example(false)
	defer done()
	ctx := context.Background()
	if err := setUp(ctx, db.Pool); err != nil {
		panic(err)
	}
	runner, err := txn.New(db.Pool, &txn.Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		panic(err)
	}
	srv := httptest.NewServer(createOrder(runner))
	defer srv.Close()

	post := func(key, body string) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
		if err != nil {
			panic(err)
		}
		req.Header.Set("X-User", "alice")
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		if err != nil {
			panic(err)
		}
		defer resp.Body.Close()
		answer, err := io.ReadAll(resp.Body)
		if err != nil {
			panic(err)
		}
		fmt.Printf("%d replayed=%q %s\n", resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), bytes.TrimSpace(answer))
	}
	post("order-1", `{"sku":"book","quantity":2}`)
	post("order-1", `{"sku":"book","quantity":2}`) // a retry
	post("order-1", `{"sku":"pen","quantity":2}`)  // the same key, another order
	post("order-2", `{"sku":"book"}`)
	post("order-2", `{"sku":"book","quantity":1}`) // corrected, with the same key
	// Output:
	// 201 replayed="" {"id":1,"sku":"book","quantity":2}
	// 201 replayed="true" {"id":1,"sku":"book","quantity":2}
	// 422 replayed="" Unprocessable Entity
	// 422 replayed="" {"error":"want {\"sku\": \"...\", \"quantity\": 1 or more}"}
	// 201 replayed="" {"id":2,"sku":"book","quantity":1}
}
