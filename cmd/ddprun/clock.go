package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"time"

	"github.com/goddp/goddp/ddp/tracefile"
)

// Note [Clocks across nodes]: a multi-node --trace_merge puts every node's ranks on one
// timeline, and the nodes' wall clocks may differ by more than the events being compared.
// So before the first attempt each node other than 0 measures its offset to node 0 through
// the store, NTP style: it writes a request (local time t1), node 0 answers with its clock T,
// it reads the answer (t2); the offset is T - (t1+t2)/2, uncertain by at most (t2-t1)/2. Of
// clockRounds rounds the one with the shortest round trip counts. At the end each node merges
// its own ranks' traces, moves them onto node 0's clock, and hands them to node 0 through
// the store; node 0 merges every node's into OUT and prints the offsets.

const clockRounds = 8

type clockEstimate struct {
	OffsetUS int64 `json:"offset_us"` // node 0's clock minus this node's
	ErrUS    int64 `json:"err_us"`    // half the round trip of the best round
}

func (c *coordinator) clockKey(node, round int, what string) string {
	return fmt.Sprintf("%s/clock/node%d/%d/%s", c.prefix, node, round, what)
}

// serveClock is node 0's side: it answers every other node's rounds, in node order.
func (c *coordinator) serveClock(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	for n := 1; n < c.nnodes; n++ {
		for r := range clockRounds {
			if _, err := c.st.Get(ctx, c.clockKey(n, r, "req")); err != nil {
				return fmt.Errorf("clock round %d of node %d: %w", r, n, err)
			}
			now := strconv.FormatInt(time.Now().UnixMicro(), 10)
			if err := c.st.Set(ctx, c.clockKey(n, r, "resp"), []byte(now)); err != nil {
				return fmt.Errorf("clock round %d of node %d: %w", r, n, err)
			}
		}
	}
	return nil
}

// measureClock is the other nodes' side; it leaves the estimate in the store for node 0.
func (c *coordinator) measureClock(ctx context.Context) (clockEstimate, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	best := clockEstimate{ErrUS: -1}
	for r := range clockRounds {
		t1 := time.Now().UnixMicro()
		if err := c.st.Set(ctx, c.clockKey(c.node, r, "req"), nil); err != nil {
			return best, fmt.Errorf("clock round %d: %w", r, err)
		}
		b, err := c.st.Get(ctx, c.clockKey(c.node, r, "resp"))
		if err != nil {
			return best, fmt.Errorf("clock round %d: %w", r, err)
		}
		t2 := time.Now().UnixMicro()
		T, err := strconv.ParseInt(string(b), 10, 64)
		if err != nil {
			return best, fmt.Errorf("clock round %d: node 0 answered %q", r, b)
		}
		if e := (t2 - t1) / 2; best.ErrUS < 0 || e < best.ErrUS {
			best = clockEstimate{OffsetUS: T - (t1+t2)/2, ErrUS: e}
		}
	}
	v, _ := json.Marshal(best)
	if err := c.st.Set(ctx, fmt.Sprintf("%s/clock/node%d/estimate", c.prefix, c.node), v); err != nil {
		return best, err
	}
	return best, nil
}

// nodeTraceKey is where node n leaves its merged trace for node 0.
func (c *coordinator) nodeTraceKey(n int) string { return fmt.Sprintf("%s/trace/node%d", c.prefix, n) }

// shareTrace (nodes other than 0) moves tf onto node 0's clock and hands it over; a nil tf
// (no rank wrote a trace) is handed over as empty, so that node 0 does not wait for it.
func (c *coordinator) shareTrace(ctx context.Context, tf *tracefile.File, est clockEstimate) error {
	var buf bytes.Buffer
	if tf != nil {
		tf.OtherData.EpochUnixMicro += est.OffsetUS
		if err := tracefile.Write(&buf, tf); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	return c.st.Set(ctx, c.nodeTraceKey(c.node), buf.Bytes())
}

// gatherTraces (node 0) waits for every other node's trace and clock estimate.
func (c *coordinator) gatherTraces(ctx context.Context) (files []*tracefile.File, ests map[int]clockEstimate, err error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	ests = map[int]clockEstimate{}
	for n := 1; n < c.nnodes; n++ {
		b, err := c.st.Get(ctx, c.nodeTraceKey(n))
		if err != nil {
			return nil, nil, fmt.Errorf("trace of node %d: %w", n, err)
		}
		if len(b) > 0 {
			tf, err := tracefile.Read(bytes.NewReader(b))
			if err != nil {
				return nil, nil, fmt.Errorf("trace of node %d: %w", n, err)
			}
			files = append(files, tf)
		}
		if eb, err := c.st.Get(ctx, fmt.Sprintf("%s/clock/node%d/estimate", c.prefix, n)); err == nil {
			var e clockEstimate
			if json.Unmarshal(eb, &e) == nil {
				ests[n] = e
			}
		}
	}
	return files, ests, nil
}

// formatOffsets is node 0's report of the estimates, in node order.
func formatOffsets(ests map[int]clockEstimate) string {
	nodes := make([]int, 0, len(ests))
	for n := range ests {
		nodes = append(nodes, n)
	}
	sort.Ints(nodes)
	var b bytes.Buffer
	for i, n := range nodes {
		if i > 0 {
			b.WriteString(", ")
		}
		e := ests[n]
		fmt.Fprintf(&b, "node %d %+.3fms (±%.3fms)", n, float64(e.OffsetUS)/1000, float64(e.ErrUS)/1000)
	}
	return b.String()
}

// syncClocks runs Note [Clocks across nodes]'s measurement before the first attempt.
func (j *job) syncClocks(ctx context.Context) error {
	c := j.traceCoord
	if c.node == 0 {
		return c.serveClock(ctx)
	}
	est, err := c.measureClock(ctx)
	if err != nil {
		return err
	}
	j.clock = est
	j.con.msg(fmt.Sprintf("ddprun: clock offset to node 0: %+.3fms (±%.3fms, best of %d store round trips)\n",
		float64(est.OffsetUS)/1000, float64(est.ErrUS)/1000, clockRounds))
	return nil
}
