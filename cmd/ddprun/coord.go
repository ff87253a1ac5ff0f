package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// Note [Multi-node restarts]: the ddprun of every node of a multi-node job keeps in step with
// the others through the job's store, under "<run id>/ddprun/attempt<K>/":
//
//   - joined, go: before attempt K each node adds 1 to "joined"; the one that brings it to
//     nnodes sets "go", and every node waits for "go" (up to --rdzv_timeout). So every node
//     runs attempt K, with the same TORCHELASTIC_RESTART_COUNT and GODDP_RUN_ID.
//   - failed: the first node whose rank fails (or that is interrupted) sets it, by
//     compare-and-set, to "CODE description" ("stop description" for an interrupt). Every
//     node watches it during the attempt and stops its ranks when it appears, so all nodes
//     restart together (or, for "stop", give up together).
//   - ok, all_ok: a node whose ranks all succeeded adds 1 to "ok" and waits for "all_ok" (set
//     by the node that brings "ok" to nnodes) or "failed" (then it restarts with the rest).
//   - left, all_left: on success every node adds 1 to "left"; node 0, which hosts the store,
//     waits for "all_left" before closing it, so no node loses the store mid-handshake.

// coordinator is one node's side of Note [Multi-node restarts].
type coordinator struct {
	st      procgroup.Store
	prefix  string
	nnodes  int
	node    int
	timeout time.Duration // bound of every wait for the other nodes
	host    string        // this node's host name, for the others' messages
	warn    func(string)  // prints a waiting notice (nil: none)
}

func (c *coordinator) key(attempt int, name string) string {
	return fmt.Sprintf("%s/attempt%d/%s", c.prefix, attempt, name)
}

// barrier adds 1 to counter and waits until every node has, using done as the flag the last
// one sets. Each node also leaves "<counter>/node<N>" with its host name, so that a wait that
// lasts names the nodes that have not arrived: every procgroup.ConnectWarnInterval in a
// warning, and at the bound in the error.
func (c *coordinator) barrier(ctx context.Context, attempt int, counter, done string) error {
	wctx, stop := procgroup.BoundedWait(ctx, c.timeout, 0, func(waited time.Duration) {
		if c.warn != nil {
			c.warn(fmt.Sprintf("ddprun: attempt %d: still waiting for %s after %v (bound %v, --rdzv_timeout)",
				attempt, c.missing(ctx, attempt, counter), waited, c.timeout))
		}
	})
	defer stop()
	if err := c.st.Set(wctx, c.key(attempt, counter+"/node"+strconv.Itoa(c.node)), []byte(c.host)); err != nil {
		return fmt.Errorf("attempt %d %s: %w", attempt, counter, err)
	}
	n, err := c.st.Add(wctx, c.key(attempt, counter), 1)
	if err != nil {
		return fmt.Errorf("attempt %d %s: %w", attempt, counter, err)
	}
	if n == int64(c.nnodes) {
		if err := c.st.Set(wctx, c.key(attempt, done), nil); err != nil {
			return fmt.Errorf("attempt %d %s: %w", attempt, done, err)
		}
	}
	if err := c.st.Wait(wctx, c.key(attempt, done)); err != nil {
		if procgroup.TimedOut(ctx, wctx) {
			return fmt.Errorf("attempt %d: %s within %v (--rdzv_timeout); check that its ddprun was started "+
				"with the same --nnodes, --master_addr and --master_port and that its host reaches this one", attempt,
				c.missing(ctx, attempt, counter)+" did not arrive", c.timeout)
		}
		return fmt.Errorf("attempt %d %s: %w", attempt, done, err)
	}
	return nil
}

// missing names the nodes that have not left their "<counter>/node<N>" key.
func (c *coordinator) missing(ctx context.Context, attempt int, counter string) string {
	var nodes []string
	for i := range c.nnodes {
		pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		_, err := c.st.Get(pctx, c.key(attempt, counter+"/node"+strconv.Itoa(i)))
		cancel()
		if err != nil {
			nodes = append(nodes, strconv.Itoa(i))
		}
	}
	if len(nodes) == 0 {
		return "the last node to arrive"
	}
	if len(nodes) == 1 {
		return "node " + nodes[0]
	}
	return "nodes " + strings.Join(nodes, ", ")
}

// join waits until every node is ready to run attempt.
func (c *coordinator) join(ctx context.Context, attempt int) error {
	return c.barrier(ctx, attempt, "joined", "go")
}

// publish tells the other nodes that attempt failed here (best effort: the first verdict of an
// attempt wins, and a store that is gone has nobody left to tell).
func (c *coordinator) publish(ctx context.Context, attempt int, verdict string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	c.st.CompareAndSet(ctx, c.key(attempt, "failed"), nil, []byte(verdict)) //nolint:errcheck // see above
}

// watch returns a channel that yields the attempt's failure verdict once some node publishes
// one, and a stop function that ends the watch and waits for its goroutine.
func (c *coordinator) watch(ctx context.Context, attempt int) (<-chan string, func()) {
	ctx, cancel := context.WithCancel(ctx)
	ch := make(chan string, 1) // size 1: the watcher sends once and must not block after stop
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if v, err := c.st.Get(ctx, c.key(attempt, "failed")); err == nil {
			ch <- string(v)
		}
	}()
	return ch, func() { cancel(); wg.Wait() }
}

// finish is called when every local rank of attempt succeeded: it waits until every node
// has succeeded (returning "") or some node failed (returning its verdict).
func (c *coordinator) finish(ctx context.Context, attempt int, failed <-chan string) (string, error) {
	ok := make(chan error, 1) // size 1: the goroutine sends once, whether or not we still listen
	bctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		ok <- c.barrier(bctx, attempt, "ok", "all_ok")
	}()
	defer func() { cancel(); wg.Wait() }()
	select {
	case v := <-failed:
		return v, nil
	case err := <-ok:
		return "", err
	}
}

// leave is the last handshake of a successful job (see the Note); node 0 waits in it until
// every node has left, so that it closes the store last.
func (c *coordinator) leave(ctx context.Context, attempt int) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	n, err := c.st.Add(ctx, c.key(attempt, "left"), 1)
	if err != nil {
		return
	}
	if n == int64(c.nnodes) {
		c.st.Set(ctx, c.key(attempt, "all_left"), nil) //nolint:errcheck // best effort
	}
	if c.node == 0 {
		c.st.Wait(ctx, c.key(attempt, "all_left")) //nolint:errcheck // best effort
	}
}

// verdictFor describes a local failure for the other nodes: "CODE description".
func verdictFor(p *rankProc, host string, node int) string {
	return fmt.Sprintf("%d rank %d (node %d, host %s) %s", p.exitCode(), p.rank, node, host, p.describe())
}

// parseVerdict splits a verdict into its exit code (0 for "stop") and description.
func parseVerdict(v string) (code int, desc string, stop bool) {
	head, desc, _ := strings.Cut(v, " ")
	if head == "stop" {
		return 1, desc, true
	}
	code, err := strconv.Atoi(head)
	if err != nil || code <= 0 {
		code = 1
	}
	return code, desc, false
}
