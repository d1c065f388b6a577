package cleanup

// LockClass exposes the advisory lock's class to tests, which hold the lock
// themselves to prove a cleaner skips its round.
const LockClass = lockClass

// ConfigOf exposes a cleaner's configuration, defaults filled in, to tests.
func ConfigOf(c *Cleaner) Config { return c.cfg }
