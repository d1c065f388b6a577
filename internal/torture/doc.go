// Package torture holds atomicphase's reliability tests: processes killed
// with SIGKILL at every phase boundary, connections cut and delayed, the
// database restarted under load, and a concurrency storm with leases that
// expire mid-phase. It has no library code; see the _test.go files.
//
// The default run is bounded for CI. TORTURE_ITERATIONS (default 1) repeats
// the randomized tests, and `make torture` runs the long version.
package torture
