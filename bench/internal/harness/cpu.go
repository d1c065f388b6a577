package harness

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// machineBusy returns the CPU time all processors spent busy since boot
// (user, nice, system, irq, softirq, steal), from /proc/stat; 0 where that
// is not available. It covers the whole machine: this process, the database
// server, the broker and anything else running.
func machineBusy() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0
	}
	var ticks int64
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system irq softirq steal
		v, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil {
			return 0
		}
		ticks += v
	}
	const clkTck = 100 // USER_HZ on Linux
	return time.Duration(ticks) * time.Second / clkTck
}
