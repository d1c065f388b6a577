package pgtest

import (
	"bytes"
	"encoding/binary"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// commitComplete is the server's CommandComplete message for a COMMIT:
// 'C', length 11 (4 + "COMMIT\0"), "COMMIT\0". Seeing it on the way back
// means the commit took effect, whichever protocol sent it.
var commitComplete = []byte("C\x00\x00\x00\x0bCOMMIT\x00")

// Proxy is a TCP proxy between a pool and the test server that can cut
// connections at chosen moments, to test what callers see when the network
// fails. It is a real socket proxy: the server sees real disconnects.
type Proxy struct {
	ln       net.Listener
	network  string
	upstream string

	armCommit atomic.Bool
	armTag    atomic.Pointer[[]byte] // CommandComplete message to cut after, see CutAfterNextStatement
	cutCommit chan struct{}
	latency   atomic.Int64 // nanoseconds added before each forwarded chunk
	refusing  atomic.Bool  // close new connections at once: the database is unreachable

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// NewProxy starts a proxy to the test server of d and returns it together
// with a pool connected through it (search_path set to d's schema).
// Both are closed at cleanup.
func (d *DB) NewProxy(tb testing.TB) (*Proxy, *pgxpool.Pool) {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(d.URL)
	if err != nil {
		tb.Fatalf("pgtest: parse url: %v", err)
	}
	host, port := cfg.ConnConfig.Host, cfg.ConnConfig.Port
	p := &Proxy{network: "tcp", upstream: net.JoinHostPort(host, strconv.Itoa(int(port))),
		cutCommit: make(chan struct{}, 1), conns: map[net.Conn]struct{}{}}
	if len(host) > 0 && host[0] == '/' {
		p.network, p.upstream = "unix", host+"/.s.PGSQL."+strconv.Itoa(int(port))
	}
	p.ln, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("pgtest: proxy listen: %v", err)
	}
	p.wg.Add(1)
	go p.accept()
	tb.Cleanup(p.Close)

	addr := p.ln.Addr().(*net.TCPAddr)
	pool := d.NewPool(tb, func(c *pgxpool.Config) {
		c.ConnConfig.Host = "127.0.0.1"
		c.ConnConfig.Port = uint16(addr.Port)
		c.ConnConfig.Fallbacks = nil
		c.ConnConfig.TLSConfig = nil
		c.ConnConfig.ConnectTimeout = 5 * time.Second
	})
	return p, pool
}

// CutAfterNextCommit arms the proxy: when the server next answers a COMMIT
// (it took effect), the answer is dropped and the client's connection is
// closed. The client sees an error. CommitCut is signalled when it happened.
func (p *Proxy) CutAfterNextCommit() { p.armCommit.Store(true) }

// CutAfterNextStatement arms the proxy for a statement run in its own
// implicit transaction (e.g. an autocommit INSERT): when the server next
// answers a statement with command tag tag (e.g. "INSERT 0 1") and then
// reports the transaction ended (ReadyForQuery in the same answer, so the
// statement committed), the answer is dropped and the client's connection
// is closed. CommitCut is signalled when it happened.
func (p *Proxy) CutAfterNextStatement(tag string) {
	msg := []byte{'C'}
	msg = binary.BigEndian.AppendUint32(msg, uint32(4+len(tag)+1))
	msg = append(msg, tag...)
	msg = append(msg, 0)
	p.armTag.Store(&msg)
}

// readyIdle is the server's ReadyForQuery message outside a transaction.
var readyIdle = []byte("Z\x00\x00\x00\x05I")

// CommitCut is signalled each time an armed commit was cut.
func (p *Proxy) CommitCut() <-chan struct{} { return p.cutCommit }

// SetLatency delays every chunk forwarded in either direction by d.
func (p *Proxy) SetLatency(d time.Duration) { p.latency.Store(int64(d)) }

// Unreachable cuts every connection and refuses new ones until Reachable:
// to the application, the database is gone.
func (p *Proxy) Unreachable() {
	p.refusing.Store(true)
	p.CutAll()
}

// Reachable accepts connections again.
func (p *Proxy) Reachable() { p.refusing.Store(false) }

// CutAll closes every open connection through the proxy at once.
func (p *Proxy) CutAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
}

// Close stops the proxy and closes its connections.
func (p *Proxy) Close() {
	_ = p.ln.Close()
	p.CutAll()
	p.wg.Wait()
}

func (p *Proxy) track(c net.Conn, add bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if add {
		p.conns[c] = struct{}{}
	} else {
		delete(p.conns, c)
	}
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		if p.refusing.Load() {
			_ = client.Close()
			continue
		}
		server, err := net.Dial(p.network, p.upstream)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.track(client, true)
		p.track(server, true)
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			p.clientToServer(client, server)
		}()
		go func() {
			defer p.wg.Done()
			p.copyDelayed(client, server, true)
			_ = client.Close()
			_ = server.Close()
			p.track(client, false)
			p.track(server, false)
		}()
	}
}

func (p *Proxy) clientToServer(client, server net.Conn) {
	defer func() {
		_ = client.Close()
		_ = server.Close()
	}()
	p.copyDelayed(server, client, false)
}

// copyDelayed copies src to dst, adding the configured latency per chunk.
// On the server's side (fromServer) it also performs an armed commit cut.
func (p *Proxy) copyDelayed(dst, src net.Conn, fromServer bool) {
	buf := make([]byte, 64<<10)
	awaitingReady := false // an armed statement answered; its ReadyForQuery is still to come
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if d := time.Duration(p.latency.Load()); d > 0 {
				time.Sleep(d)
			}
			chunk := buf[:n]
			rest := chunk // where the statement's ReadyForQuery may be
			if fromServer && !awaitingReady {
				if end := p.tagAnswered(chunk); end >= 0 {
					awaitingReady, rest = true, chunk[end:]
				}
			}
			if awaitingReady && bytes.Contains(rest, readyIdle) {
				_ = dst.Close()
				_ = src.Close()
				select {
				case p.cutCommit <- struct{}{}:
				default:
				}
				return
			}
			if fromServer && p.armCommit.Load() && bytes.Contains(chunk, commitComplete) && p.armCommit.CompareAndSwap(true, false) {
				// The commit happened; its answer never reaches the client.
				_ = dst.Close()
				_ = src.Close()
				select {
				case p.cutCommit <- struct{}{}:
				default:
				}
				return
			}
			if awaitingReady {
				continue // withheld: the client never sees the statement's answer
			}
			if _, werr := dst.Write(chunk); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// tagAnswered reports (and disarms) an armed CutAfterNextStatement whose
// statement chunk answers: it returns the offset just past that answer in
// chunk, or -1.
func (p *Proxy) tagAnswered(chunk []byte) int {
	msg := p.armTag.Load()
	if msg == nil {
		return -1
	}
	i := bytes.Index(chunk, *msg)
	if i < 0 || !p.armTag.CompareAndSwap(msg, nil) {
		return -1
	}
	return i + len(*msg)
}
