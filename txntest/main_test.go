package txntest_test

import (
	"testing"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// The kit's own tests check for leaked goroutines too (pgtest.Main); a
// user's TestMain calls txntest.Main.
func TestMain(m *testing.M) { pgtest.Main(m) }
