package pgcluster

import (
	"bytes"
	"errors"
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
	// A signal takes effect when the process next runs: until the
	// postmaster is seen stopped, it may still fork a backend, which would
	// outlive the kill, serve a client on a dead server and hang it on a
	// lock a killed process held.
	if err := waitFor(func() bool { return state(pid) == 'T' }); err != nil {
		return fmt.Errorf("pgcluster: postmaster %d did not stop: %w", pid, err)
	}
	// Killed children stay visible as zombies (nobody reaps them while
	// the postmaster is stopped); kill until none is alive.
	if err := waitFor(func() bool {
		live := 0
		for _, child := range childrenOf(pid) {
			if alive(child) {
				live++
				_ = syscall.Kill(child, syscall.SIGKILL)
			}
		}
		return live == 0
	}); err != nil {
		return fmt.Errorf("pgcluster: children of postmaster %d survive SIGKILL: %w", pid, err)
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
	if err := waitFor(func() bool { return !alive(pid) }); err != nil {
		return fmt.Errorf("pgcluster: postmaster %d survives SIGKILL: %w", pid, err)
	}
	// Every server process works in the data directory: a last sweep
	// kills any that escaped the above, wherever it was reparented.
	if err := waitFor(func() bool {
		live := 0
		for _, p := range c.processes() {
			live++
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		return live == 0
	}); err != nil {
		return fmt.Errorf("pgcluster: server processes survive SIGKILL: %w", err)
	}
	return nil
}

// processes lists the live processes whose working directory is the
// cluster's data directory: the server's.
func (c *Cluster) processes() []int {
	data, err := filepath.EvalSymlinks(c.dataDir)
	if err != nil {
		return nil
	}
	cwds, _ := filepath.Glob("/proc/[0-9]*/cwd")
	var out []int
	for _, cwd := range cwds {
		if dir, err := os.Readlink(cwd); err != nil || dir != data {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(cwd))); err == nil && alive(pid) {
			out = append(out, pid)
		}
	}
	return out
}

// waitFor polls cond every millisecond for up to 10 seconds.
func waitFor(cond func() bool) error {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if cond() {
			return nil
		}
	}
	return errors.New("timed out after 10 s")
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
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	var out []int
	for _, d := range dirs {
		child, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		if _, ppid := procStat(child); ppid == pid {
			out = append(out, child)
		}
	}
	return out
}

// alive reports whether pid is a live process (a zombie is not).
func alive(pid int) bool {
	st, _ := procStat(pid)
	return st != 0 && st != 'Z' && st != 'X'
}

// state returns pid's state letter from /proc (R, S, T, Z, ...), or 0 when
// there is no such process.
func state(pid int) byte {
	st, _ := procStat(pid)
	return st
}

// procStat reads pid's state letter and parent from /proc/PID/stat; state
// is 0 when there is no such process.
func procStat(pid int) (state byte, ppid int) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0
	}
	// pid (comm) state ppid ...: comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0, 0
	}
	ppid, _ = strconv.Atoi(f[1])
	return f[0][0], ppid
}
