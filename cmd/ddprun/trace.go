package main

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"

	"github.com/goddp/goddp/ddp/tracefile"
)

// Note [Trace merge]: with --trace_merge OUT, every rank gets GODDP_TRACE naming its own
// file, LOG_DIR/trace/trace.rank{rank}.a{attempt}.json (under ddprun's work directory
// without --log_dir); a trainer that calls ddp.OpenTrace with an empty path (its --trace
// flag unset) writes its timeline there, and one that gives a path writes it there and
// links GODDP_TRACE's file to it. OUT's folder is made, and OUT checked, before the ranks
// start. When the job ends, ddprun merges the files of the
// last attempt that wrote any into OUT, aligned on the wall clock (tracefile.Merge). Only
// this node's ranks are merged; with several nodes each node writes its own OUT.

var traceFileRE = regexp.MustCompile(`^trace\.rank(\d+)\.a(\d+)\.json$`)

// setupTraceMerge prepares the trace directory and the ranks' GODDP_TRACE, and returns the
// function that merges the traces (call it when the job ends).
func (j *job) setupTraceMerge(workDir string) (merge func(), err error) {
	dir := filepath.Join(workDir, "trace")
	if j.cfg.logDir != "" {
		dir = filepath.Join(j.cfg.logDir, "trace")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("--trace_merge: %w", err)
	}
	j.baseEnv = append(j.baseEnv[:len(j.baseEnv):len(j.baseEnv)],
		tracefile.EnvVar+"="+filepath.Join(dir, "trace.rank{rank}.a{attempt}.json"))
	return func() {
		n, err := mergeTraceDir(dir, j.cfg.traceMerge)
		switch {
		case err != nil:
			j.con.msg(fmt.Sprintf("ddprun: --trace_merge: %v\n", err))
		case n == 0:
			j.con.msg(fmt.Sprintf("ddprun: --trace_merge: no rank wrote a trace in %s (does the program call ddp.OpenTrace?)\n", dir))
		default:
			j.con.msg(fmt.Sprintf("ddprun: merged %d ranks' traces into %s\n", n, j.cfg.traceMerge))
		}
	}, nil
}

// mergeTraceDir merges the rank files of the last attempt found in dir into out and returns
// how many it merged.
func mergeTraceDir(dir, out string) (int, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, err
	}
	byAttempt := map[int][]string{}
	last := -1
	for _, e := range ents {
		m := traceFileRE.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		a, _ := strconv.Atoi(m[2])
		byAttempt[a] = append(byAttempt[a], filepath.Join(dir, e.Name()))
		last = max(last, a)
	}
	if last < 0 {
		return 0, nil
	}
	files := byAttempt[last]
	slices.Sort(files)
	if err := tracefile.MergeFiles(out, files...); err != nil {
		return 0, err
	}
	return len(files), nil
}
