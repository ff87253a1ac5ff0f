//go:build !allreduceperf_nogloo

package main

// The default backend. (The allreduceperf_nogloo tag builds without it, for testing the
// command with the store backend alone.)
import _ "github.com/goddp/goddp/backends/gloo"
