package main

import "errors"

// errUsage marks a command line or configuration the reaper cannot run
// with; run answers it with exit status 2.
var errUsage = errors.New("usage error")
