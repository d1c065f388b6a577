package main

import (
	"context"
	"fmt"
	"os"
)

// A command line that asks for both modes is a usage error: the reaper says
// why and exits with status 2.
func Example_usageError() {
	code := run(context.Background(), []string{"-once", "-interval", "1m"}, os.Stdout, os.Stdout)
	fmt.Println("exit status", code)
	// Output:
	// reaper: usage error: give exactly one of -once and -interval
	// Run 'reaper -help' for usage.
	// exit status 2
}
