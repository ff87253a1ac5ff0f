//go:build allreduceperf_testhooks

package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// With the allreduceperf_testhooks tag, GODDP_ALLREDUCE_PERF_TEST_EXIT="RANK:N" makes rank
// RANK exit with status 7 after its N-th all-reduce: the end-to-end tests use it to kill a
// rank in the middle of a run.
func init() {
	spec := os.Getenv("GODDP_ALLREDUCE_PERF_TEST_EXIT")
	r, n, ok := strings.Cut(spec, ":")
	rank, err1 := strconv.Atoi(r)
	after, err2 := strconv.Atoi(n)
	if !ok || err1 != nil || err2 != nil {
		return
	}
	done := 0
	afterOp = func(me int) {
		if me != rank {
			return
		}
		if done++; done >= after {
			fmt.Fprintf(os.Stderr, "allreduce-perf: test hook: rank %d exits after %d all-reduces\n", me, done)
			os.Exit(7)
		}
	}
}
