//go:build !linux

package pgcluster

import (
	"errors"
	"fmt"
)

// Kill ends every process of the server with SIGKILL. It needs Linux's
// /proc to find them; elsewhere it returns errors.ErrUnsupported.
func (c *Cluster) Kill() error {
	return fmt.Errorf("pgcluster: kill: %w", errors.ErrUnsupported)
}

// PauseReplication stops this standby's WAL receiver. It needs Linux's
// /proc to find it; elsewhere it returns errors.ErrUnsupported.
func (c *Cluster) PauseReplication() (resume func(), err error) {
	return nil, fmt.Errorf("pgcluster: pause replication: %w", errors.ErrUnsupported)
}
