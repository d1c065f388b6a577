package recovery

// ConfigOf exposes a resumer's configuration, defaults filled in, to tests.
func ConfigOf(r *Resumer) Config { return r.cfg }
