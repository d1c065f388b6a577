package natspub

// ConfigOf exposes a publisher's configuration, defaults filled in, to tests.
func ConfigOf(p *Publisher) Config { return p.cfg }
