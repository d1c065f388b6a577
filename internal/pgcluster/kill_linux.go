package pgcluster

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Kill ends every process of the server with SIGKILL, as the loss of its
// host would: the postmaster is stopped first so that it starts no more
// children, then its children and the postmaster are killed. Nothing is
// flushed or shut down. Kill also removes the server's System V shared
// memory segment, which a dead server leaves behind. Stop then only deletes
// the cluster's files.
func (c *Cluster) Kill() error {
	pid, shmid, err := c.postmaster()
	if err != nil {
		return err
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return fmt.Errorf("pgcluster: stop postmaster %d: %w", pid, err)
	}
	for _, child := range childrenOf(pid) {
		_ = syscall.Kill(child, syscall.SIGKILL)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("pgcluster: kill postmaster %d: %w", pid, err)
	}
	c.killed = true
	// The segment goes once no process is attached; it is marked for
	// removal now, and removed when the last killed process is gone.
	if shmid >= 0 {
		_, _ = unix.SysvShmCtl(shmid, unix.IPC_RMID, nil)
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if !alive(pid) {
			return nil
		}
	}
	return fmt.Errorf("pgcluster: postmaster %d still alive 10 s after SIGKILL", pid)
}

// PauseReplication stops this standby's WAL receiver with SIGSTOP, as a
// network partition between it and its primary would: commits on an
// asynchronous primary go on without it. resume sends SIGCONT.
func (c *Cluster) PauseReplication() (resume func(), err error) {
	pid, _, err := c.postmaster()
	if err != nil {
		return nil, err
	}
	for _, child := range childrenOf(pid) {
		cmdline, _ := os.ReadFile("/proc/" + strconv.Itoa(child) + "/cmdline")
		if !bytes.Contains(cmdline, []byte("walreceiver")) {
			continue
		}
		if err := syscall.Kill(child, syscall.SIGSTOP); err != nil {
			return nil, fmt.Errorf("pgcluster: pause walreceiver %d: %w", child, err)
		}
		return func() { _ = syscall.Kill(child, syscall.SIGCONT) }, nil
	}
	return nil, fmt.Errorf("pgcluster: no walreceiver: %s is not a streaming standby", c.dataDir)
}

// postmaster reads the server's process id and shared memory segment id
// (-1 when it has none) from postmaster.pid.
func (c *Cluster) postmaster() (pid, shmid int, err error) {
	b, err := os.ReadFile(filepath.Join(c.dataDir, "postmaster.pid"))
	if err != nil {
		return 0, 0, fmt.Errorf("pgcluster: server not running: %w", err)
	}
	lines := strings.Split(string(b), "\n")
	if pid, err = strconv.Atoi(strings.TrimSpace(lines[0])); err != nil {
		return 0, 0, fmt.Errorf("pgcluster: postmaster.pid: %w", err)
	}
	shmid = -1
	// Line 7 holds the segment's key and id.
	if len(lines) > 6 {
		if f := strings.Fields(lines[6]); len(f) == 2 {
			if id, err := strconv.Atoi(f[1]); err == nil {
				shmid = id
			}
		}
	}
	return pid, shmid, nil
}

// childrenOf lists the processes whose parent is pid.
func childrenOf(pid int) []int {
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var out []int
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 2 || f[1] != strconv.Itoa(pid) {
			continue
		}
		if child, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil {
			out = append(out, child)
		}
	}
	return out
}

// alive reports whether pid is a live process (a zombie is not).
func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i >= 0 && len(b) > i+2 && b[i+2] != 'Z'
}
