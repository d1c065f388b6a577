package telemetry_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// No library package links the OpenTelemetry SDK or a Prometheus client:
// a service chooses its SDK and exporter; the library speaks the API only.
// Commands (the reaper serves /metrics) and tests may link them.
func TestLibraryPackagesLinkNoSDK(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "github.com/atomicphase/atomicphase/...").Output()
	require.NoError(t, err)
	var libs []string
	for _, p := range strings.Fields(string(out)) {
		if strings.Contains(p, "/cmd/") || strings.Contains(p, "/examples/") || strings.Contains(p, "/internal/") {
			continue
		}
		libs = append(libs, p)
	}
	require.Contains(t, libs, "github.com/atomicphase/atomicphase/txn")
	require.Contains(t, libs, "github.com/atomicphase/atomicphase/monitor")
	out, err = exec.Command("go", append([]string{"list", "-deps"}, libs...)...).Output()
	require.NoError(t, err)
	deps := strings.Fields(string(out))
	require.Contains(t, deps, "go.opentelemetry.io/otel/metric", "the gauges use the metric API")
	for _, d := range deps {
		require.False(t, strings.HasPrefix(d, "go.opentelemetry.io/otel/sdk"), "a library package links %s", d)
		require.False(t, strings.HasPrefix(d, "go.opentelemetry.io/otel/exporters"), "a library package links %s", d)
		require.False(t, strings.HasPrefix(d, "github.com/prometheus/"), "a library package links %s", d)
	}
}
