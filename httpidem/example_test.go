package httpidem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/atomicphase/atomicphase/httpidem"
	"github.com/atomicphase/atomicphase/internal/pgtest"
	"github.com/atomicphase/atomicphase/txn"
)

// bearerUser is a Config.Scope: the authenticated principal owns the key.
// Take it from your authentication; here, "Authorization: Bearer <user>".
func bearerUser(r *http.Request) (string, error) {
	user, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || user == "" {
		return "", errors.New("unauthenticated")
	}
	return user, nil
}

// post sends body to url with the user and key (none when key is ""), and
// prints the answer: its status, whether it was replayed, and its body, or
// its problem type.
func post(client *http.Client, url, user, key, body string) {
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		panic(err)
	}
	req.Header.Set("Authorization", "Bearer "+user)
	if key != "" {
		req.Header.Set(httpidem.HeaderName, key)
	}
	resp, err := client.Do(req)
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		panic(err)
	}
	if resp.Header.Get("Content-Type") == "application/problem+json" {
		var p struct{ Type string }
		if err := json.Unmarshal(answer, &p); err != nil {
			panic(err)
		}
		answer = []byte(p.Type)
	}
	fmt.Printf("%d replayed=%q %s\n", resp.StatusCode, resp.Header.Get(httpidem.ReplayedHeader), strings.TrimSpace(string(answer)))
}

// Wrap runs a handler inside the key's transaction: its writes, the key and
// the response commit together, and a retry gets the stored response.
func ExampleMiddleware_Wrap() {
	db, done := pgtest.Example(true) // a migrated schema of its own
	defer done()
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, sku text NOT NULL)`); err != nil {
		panic(err)
	}
	runner, err := txn.New(db.Pool, nil)
	if err != nil {
		panic(err)
	}
	idem, err := httpidem.New(runner, &httpidem.Config{Scope: bearerUser})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", idem.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var order struct {
			SKU string `json:"sku"`
		}
		if err := json.NewDecoder(r.Body).Decode(&order); err != nil || order.SKU == "" {
			http.Error(w, "want a sku", http.StatusBadRequest) // not stored: the client may correct it
			return
		}
		tx, _ := httpidem.Tx(r.Context()) // commits with the key and the stored response
		var id int64
		if err := tx.QueryRow(r.Context(), `INSERT INTO orders (sku) VALUES ($1) RETURNING id`, order.SKU).Scan(&id); err != nil {
			http.Error(w, "storage failure", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	post(srv.Client(), srv.URL+"/orders", "alice", "order-1", `{"sku":"book"}`)
	post(srv.Client(), srv.URL+"/orders", "alice", "order-1", `{"sku":"book"}`) // a retry
	post(srv.Client(), srv.URL+"/orders", "alice", "order-1", `{"sku":"pen"}`)  // the key reused for another order
	post(srv.Client(), srv.URL+"/orders", "bob", "order-1", `{"sku":"pen"}`)    // another principal's key
	post(srv.Client(), srv.URL+"/orders", "alice", "", `{"sku":"book"}`)        // no key
	// Output:
	// 201 replayed="" {"id":1}
	// 201 replayed="true" {"id":1}
	// 422 replayed="" urn:atomicphase:problem:idempotency-key-reused
	// 201 replayed="" {"id":2}
	// 400 replayed="" urn:atomicphase:problem:idempotency-key-missing
}

// Workflow serves a registered multi-phase workflow, with the JSON body as
// its params: here a transfer that debits, calls out, then credits.
func ExampleMiddleware_Workflow() {
	db, done := pgtest.Example(true)
	defer done()
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE ledger (account text NOT NULL, cents bigint NOT NULL)`); err != nil {
		panic(err)
	}
	type transfer struct {
		From, To string
		Cents    int64
	}
	notified := 0
	sendTransfer := txn.NewWorkflow("send_transfer", func(ctx context.Context, a *txn.Attempt) (txn.Response, error) {
		var t transfer
		if err := json.Unmarshal(a.Params(), &t); err != nil || t.Cents <= 0 {
			return txn.JSON(http.StatusUnprocessableEntity, map[string]string{"error": "want from, to and cents > 0"})
		}
		if _, err := txn.Atomic(ctx, a, "debited", func(ctx context.Context, tx pgx.Tx) (bool, error) {
			_, err := tx.Exec(ctx, `INSERT INTO ledger VALUES ($1, $2)`, t.From, -t.Cents)
			return true, err
		}); err != nil {
			return txn.Response{}, err
		}
		if _, err := txn.Foreign(ctx, a, "notified", func(ctx context.Context, foreignKey string) (bool, error) {
			notified++ // e.g. a call to the bank's API, with foreignKey as its idempotency key
			return true, nil
		}); err != nil {
			return txn.Response{}, err
		}
		return a.Finish(ctx, func(ctx context.Context, tx pgx.Tx) (txn.Response, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO ledger VALUES ($1, $2)`, t.To, t.Cents); err != nil {
				return txn.Response{}, err
			}
			return txn.JSON(http.StatusCreated, map[string]any{"from": t.From, "to": t.To, "cents": t.Cents})
		})
	})
	registry := txn.NewRegistry()
	if err := registry.Register(sendTransfer); err != nil {
		panic(err)
	}
	runner, err := txn.New(db.Pool, &txn.Config{Workflows: registry})
	if err != nil {
		panic(err)
	}
	idem, err := httpidem.New(runner, &httpidem.Config{Scope: bearerUser})
	if err != nil {
		panic(err)
	}
	srv := httptest.NewServer(idem.Workflow(sendTransfer))
	defer srv.Close()

	body := `{"from":"alice","to":"bob","cents":500}`
	post(srv.Client(), srv.URL, "alice", "transfer-1", body)
	post(srv.Client(), srv.URL, "alice", "transfer-1", body) // a retry
	var rows int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM ledger`).Scan(&rows); err != nil {
		panic(err)
	}
	fmt.Println("ledger rows:", rows, "notifications:", notified)
	// Output:
	// 201 replayed="" {"cents":500,"from":"alice","to":"bob"}
	// 201 replayed="true" {"cents":500,"from":"alice","to":"bob"}
	// ledger rows: 2 notifications: 1
}

// ParseKey reads the Idempotency-Key header: an RFC 8941 sf-string, as the
// IETF draft asks, or a bare token, as many clients send.
func ExampleParseKey() {
	for _, header := range []string{
		`"8e03978e-40d5-43e8-bc93-6894a57f9324"`,
		`8e03978e-40d5-43e8-bc93-6894a57f9324`,
		`"order 42"`,
		`order 42`,
		`""`,
	} {
		key, err := httpidem.ParseKey(header)
		fmt.Printf("%-40s -> %q %v\n", header, key, err)
	}
	// Output:
	// "8e03978e-40d5-43e8-bc93-6894a57f9324"   -> "8e03978e-40d5-43e8-bc93-6894a57f9324" <nil>
	// 8e03978e-40d5-43e8-bc93-6894a57f9324     -> "8e03978e-40d5-43e8-bc93-6894a57f9324" <nil>
	// "order 42"                               -> "order 42" <nil>
	// order 42                                 -> "" invalid Idempotency-Key header: byte ' ' not allowed in a bare key (quote it as an sf-string)
	// ""                                       -> "" invalid Idempotency-Key header: the key is empty
}
