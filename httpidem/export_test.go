package httpidem

// ConfigOf exposes a middleware's configuration, defaults filled in, to tests.
func ConfigOf(m *Middleware) Config { return m.cfg }
