package webhookin_test

import (
	"testing"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }
