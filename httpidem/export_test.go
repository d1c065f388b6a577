package httpidem

import (
	"net/http"

	"github.com/atomicphase/atomicphase/txn"
)

// ConfigOf exposes a middleware's configuration, defaults filled in, to tests.
func ConfigOf(m *Middleware) Config { return m.cfg }

// Answer exposes how the middleware answers a runner's error to tests.
func Answer(m *Middleware, w http.ResponseWriter, r *http.Request, err error) {
	m.answer(w, r, txn.Response{}, err)
}
