package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/atomicphase/atomicphase/internal/connstr"
)

// stack runs the provider and the service as real processes.
type stack struct {
	dir          string
	bins         binaries
	dbURL        string // scoped to the run's schema
	natsURL      string
	stream       string
	prefix       string
	serviceAddr  string
	providerAddr string
	receiptsAddr string
	serviceArgs  []string
	providerArgs []string
	receiptsArgs []string
	logs         *os.File
	service      *exec.Cmd
	provider     *exec.Cmd
	receipts     *exec.Cmd
}

// binaries are the example's programs, built for the run.
type binaries struct{ service, provider, receipts string }

// buildBinaries compiles the service, the provider and the receipts
// service into dir, in one go build.
func buildBinaries(ctx context.Context, dir string) (binaries, error) {
	b := binaries{service: filepath.Join(dir, "rocketrides"), provider: filepath.Join(dir, "provider"), receipts: filepath.Join(dir, "receipts")}
	const pkg = "github.com/atomicphase/atomicphase/examples/rocketrides"
	// With several packages and -o naming a directory, each binary is
	// named after its package's directory ("rocketrides" for the service).
	cmd := exec.CommandContext(ctx, "go", "build", "-o", dir+string(filepath.Separator), pkg, pkg+"/provider", pkg+"/receipts")
	if out, err := cmd.CombinedOutput(); err != nil {
		return binaries{}, fmt.Errorf("build the example: %w\n%s", err, out)
	}
	return b, nil
}

// withSearchPath returns dbURL, in URL or keyword/value form, with
// search_path set to schema for every connection.
func withSearchPath(dbURL, schema string) (string, error) {
	return connstr.WithSearchPath(dbURL, schema)
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func (s *stack) startProvider(ctx context.Context) error {
	args := append([]string{"-addr", s.providerAddr, "-database-url", s.dbURL}, s.providerArgs...)
	s.provider = exec.Command(s.bins.provider, args...)
	s.provider.Stdout, s.provider.Stderr = s.logs, s.logs
	if err := s.provider.Start(); err != nil {
		return err
	}
	return waitHealthy(ctx, "http://"+s.providerAddr+"/healthz")
}

func (s *stack) startService(ctx context.Context, extra ...string) error {
	args := append([]string{"-addr", s.serviceAddr, "-database-url", s.dbURL,
		"-provider-url", "http://" + s.providerAddr, "-nats-url", s.natsURL,
		"-stream", s.stream, "-subject-prefix", s.prefix}, s.serviceArgs...)
	args = append(args, extra...)
	s.service = exec.Command(s.bins.service, args...)
	s.service.Stdout, s.service.Stderr = s.logs, s.logs
	if err := s.service.Start(); err != nil {
		return err
	}
	return waitHealthy(ctx, "http://"+s.serviceAddr+"/healthz")
}

func (s *stack) startReceipts(ctx context.Context) error {
	args := append([]string{"-addr", s.receiptsAddr, "-database-url", s.dbURL, "-nats-url", s.natsURL,
		"-stream", s.stream, "-subject-prefix", s.prefix}, s.receiptsArgs...)
	s.receipts = exec.Command(s.bins.receipts, args...)
	s.receipts.Stdout, s.receipts.Stderr = s.logs, s.logs
	if err := s.receipts.Start(); err != nil {
		return err
	}
	return waitHealthy(ctx, "http://"+s.receiptsAddr+"/healthz")
}

// killService ends the service with SIGKILL: no deferred code, no graceful
// shutdown, like a crashed or evicted process.
func (s *stack) killService() error {
	kill(s.service)
	s.service = nil
	return nil
}

// killReceipts ends the receipts service with SIGKILL.
func (s *stack) killReceipts() {
	kill(s.receipts)
	s.receipts = nil
}

func kill(c *exec.Cmd) {
	if c == nil || c.Process == nil {
		return
	}
	_ = c.Process.Signal(syscall.SIGKILL)
	_ = c.Wait()
}

// waitService waits for a service that kills itself (fault injection) to exit.
func (s *stack) waitService(timeout time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- s.service.Wait() }()
	select {
	case <-done:
		s.service = nil
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("service did not exit within %v", timeout)
	}
}

func (s *stack) stop() {
	for _, c := range []*exec.Cmd{s.service, s.receipts, s.provider} {
		if c != nil && c.Process != nil {
			_ = c.Process.Signal(syscall.SIGTERM)
			done := make(chan struct{})
			go func() { _ = c.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				_ = c.Process.Kill()
				<-done
			}
		}
	}
	s.service, s.receipts, s.provider = nil, nil, nil
}

func waitHealthy(ctx context.Context, u string) error {
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return fmt.Errorf("%s did not become healthy", u)
}

func uniqueName(prefix string) string {
	return prefix + strconv.FormatInt(time.Now().UnixNano()%1e12, 36)
}
