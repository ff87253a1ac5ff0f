package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"

	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/procgroup"
)

// Note [Trace merge]: with --trace_merge OUT, every rank gets GODDP_TRACE naming its own
// file, LOG_DIR/trace/trace.rank{rank}.a{attempt}.json (under ddprun's work directory
// without --log_dir); a trainer that calls observe.OpenTrace with an empty path (its --trace
// flag unset) writes its timeline there, and one that gives a path writes it there and
// links GODDP_TRACE's file to it. OUT's folder is made, and OUT checked, before the ranks
// start. When the job ends, ddprun merges the files of the
// last attempt that wrote any into OUT, aligned on the wall clock (tracefile.Merge). Only
// With several nodes, node 0 writes OUT with every node's ranks (Note [Clocks across nodes]).

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
	j.addEnv(tracefile.EnvVar + "=" + filepath.Join(dir, "trace.rank{rank}.a{attempt}.json"))
	return func() {
		local, err := lastAttemptTraces(dir)
		if err != nil {
			j.con.msg(fmt.Sprintf("ddprun: --trace_merge: %v\n", err))
			return
		}
		if j.traceCoord != nil { // several nodes: Note [Clocks across nodes]
			if err := j.mergeAcrossNodes(local); err != nil {
				j.con.msg(fmt.Sprintf("ddprun: --trace_merge: %v\n", err))
			}
			return
		}
		if len(local) == 0 {
			j.con.msg(fmt.Sprintf("ddprun: --trace_merge: no rank wrote a trace in %s (does the program call observe.OpenTrace?)\n", dir))
			return
		}
		if err := writeMerged(j.cfg.traceMerge, local); err != nil {
			j.con.msg(fmt.Sprintf("ddprun: --trace_merge: %v\n", err))
			return
		}
		j.con.msg(fmt.Sprintf("ddprun: merged %d ranks' traces into %s\n", len(local), j.cfg.traceMerge))
	}, nil
}

// mergeAcrossNodes hands this node's traces to node 0, or (on node 0) merges every node's.
func (j *job) mergeAcrossNodes(local []*tracefile.File) error {
	ctx := context.Background()
	st, err := procgroup.DialStore(ctx, j.storeAddr, j.token, procgroup.DialOptions{TLS: j.cfg.tls.client})
	if err != nil {
		return err
	}
	defer st.Close()
	c := *j.traceCoord
	c.st = st
	for _, f := range local {
		for _, r := range f.OtherData.Ranks {
			if f.OtherData.Hosts == nil {
				f.OtherData.Hosts = map[int]string{}
			}
			f.OtherData.Hosts[r] = fmt.Sprintf("%s node %d", j.host, c.node)
		}
	}
	var mine *tracefile.File
	if len(local) > 0 {
		if mine, err = tracefile.Merge(local...); err != nil {
			return err
		}
	}
	if c.node != 0 {
		if err := c.shareTrace(ctx, mine, j.clock); err != nil {
			return err
		}
		j.con.msg(fmt.Sprintf("ddprun: handed %d ranks' traces to node 0 (clock offset to node 0 %+.3fms ±%.3fms)\n",
			len(local), float64(j.clock.OffsetUS)/1000, float64(j.clock.ErrUS)/1000))
		return nil
	}
	others, ests, err := c.gatherTraces(ctx)
	if err != nil {
		return err
	}
	all := others
	if mine != nil {
		all = append([]*tracefile.File{mine}, others...)
	}
	if len(all) == 0 {
		return fmt.Errorf("no rank of any node wrote a trace (does the program call observe.OpenTrace?)")
	}
	m, err := tracefile.Merge(all...)
	if err != nil {
		return err
	}
	if err := writeMerged(j.cfg.traceMerge, []*tracefile.File{m}); err != nil {
		return err
	}
	j.con.msg(fmt.Sprintf("ddprun: merged %d ranks' traces from %d nodes into %s; clock offsets to node 0: %s\n",
		len(m.OtherData.Ranks), c.nnodes, j.cfg.traceMerge, formatOffsets(ests)))
	return nil
}

// lastAttemptTraces reads the rank files of the last attempt found in dir.
func lastAttemptTraces(dir string) ([]*tracefile.File, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
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
		return nil, nil
	}
	paths := byAttempt[last]
	slices.Sort(paths)
	files := make([]*tracefile.File, 0, len(paths))
	for _, p := range paths {
		tf, err := tracefile.ReadFile(p)
		if err != nil {
			return nil, err
		}
		files = append(files, tf)
	}
	return files, nil
}

// writeMerged merges files into out.
func writeMerged(out string, files []*tracefile.File) error {
	m, err := tracefile.Merge(files...)
	if err != nil {
		return err
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	if err := tracefile.Write(f, m); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
