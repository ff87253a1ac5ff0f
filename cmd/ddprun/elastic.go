package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"github.com/goddp/goddp/internal/openblascore"
	"github.com/goddp/goddp/procgroup"
)

// Note [Elastic ddprun]: with --nnodes MIN:MAX (or --rdzv_backend c10d) the nodes have no
// fixed ranks. Every node's ddprun is started the same way, with the same --rdzv_endpoint
// HOST:PORT and the same token (GODDP_TOKEN); the one on HOST that binds PORT first hosts
// the store, and the others dial it. Each starts its ranks with LOCAL_RANK,
// LOCAL_WORLD_SIZE, GODDP_ELASTIC_NNODES=MIN:MAX, GODDP_ELASTIC_NODE (this node's name in
// the job), GODDP_STORE_ADDR, GODDP_TOKEN_FILE and GODDP_RUN_ID (the job's id, the same on
// every node and for every restart), and no RANK or WORLD_SIZE: package ddp/elastic hands
// out the ranks, epoch by epoch (Note [Elastic rounds] there). A node that fails does not
// stop the others: they go on without it. ddprun restarts this node's ranks after a
// failure, up to --max_restarts times, and they join the job as new processes. The store's
// host keeps serving the store after its own ranks are done, until every member of the
// last epoch has left (or --rdzv_timeout has passed): if it is lost, the job is lost.

// validateElastic checks the flags of an elastic job.
func (c *config) validateElastic() error {
	switch {
	case c.nodeRankSet:
		return errors.New("--node_rank: the node ranks of an elastic job (--nnodes MIN:MAX, --rdzv_backend c10d) come from the rendezvous; drop it")
	case c.standalone:
		return errors.New("--standalone is for a fixed single-node job; an elastic job (--nnodes MIN:MAX) needs --rdzv_endpoint HOST:PORT")
	case c.traceMerge != "":
		return errors.New("--trace_merge is not supported with an elastic job (--nnodes MIN:MAX)")
	case c.storePort == 0:
		return errors.New("an elastic job needs a fixed store port (--rdzv_endpoint HOST:PORT)")
	}
	return nil
}

// elasticEnv is the part of an elastic rank's environment that ddprun sets (nil for a
// fixed job).
func (j *job) elasticEnv(p *rankProc, attempt int) [][2]string {
	c := j.cfg
	if !c.elastic {
		return nil
	}
	return [][2]string{
		{"LOCAL_RANK", strconv.Itoa(p.localRank)},
		{"LOCAL_WORLD_SIZE", strconv.Itoa(c.nproc)},
		{procgroup.ElasticEnv, fmt.Sprintf("%d:%d", c.minNodes, c.nnodes)},
		{"GODDP_ELASTIC_NODE", j.nodeName},
		{"GODDP_ELASTIC_TIMEOUT", c.rdzvTimeout.String()},
		{"TORCHELASTIC_RESTART_COUNT", strconv.Itoa(attempt)},
		{"TORCHELASTIC_MAX_RESTARTS", strconv.Itoa(c.maxRestarts)},
		{"TORCHELASTIC_RUN_ID", j.runID},
		{"GODDP_STORE_ADDR", j.storeAddr},
		{"GODDP_TOKEN_FILE", j.tokenFile},
		{"GODDP_RUN_ID", j.runID},
	}
}

// runElastic runs this node's part of an elastic job (see the Note).
func (j *job) runElastic(ctx context.Context) error {
	cfg := j.cfg
	j.nodeName = fmt.Sprintf("%s-%d", j.host, os.Getpid())
	srv, err := j.elasticStore(ctx)
	if err != nil {
		return err
	}
	if srv != nil {
		defer srv.Close()
	}
	if cfg.nproc > 1 {
		setDefaultThreads(j, j.con)
	}
	setCoreType(j, j.con, openblascore.Host())
	setGoMaxProcs(j, j.con, runtime.NumCPU())
	j.con.msg(fmt.Sprintf("ddprun: elastic job %s: node %s, %d rank(s), %d to %d nodes, store %s\n",
		j.runID, j.nodeName, cfg.nproc, cfg.minNodes, cfg.nnodes, j.storeAddr))
	for attempt := 0; ; attempt++ {
		res := j.runAttempt(ctx, attempt, nil)
		code, end, err := j.outcome(ctx, res, attempt)
		if end {
			if err == nil && srv != nil {
				j.awaitJobEnd(ctx)
			}
			return err
		}
		if attempt >= cfg.maxRestarts {
			if cfg.maxRestarts > 0 {
				j.con.msg(fmt.Sprintf("ddprun: giving up after %d restarts\n", cfg.maxRestarts))
			}
			if srv != nil {
				j.awaitJobEnd(ctx)
			}
			return &exitError{code}
		}
		j.con.msg(fmt.Sprintf("ddprun: restarting this node's ranks; they join the job as new processes (restart %d of %d)\n", attempt+1, cfg.maxRestarts))
	}
}

// elasticStore hosts the store when this node owns --rdzv_endpoint (its host is one of this
// machine's addresses and the port is free), and otherwise waits until it answers.
func (j *job) elasticStore(ctx context.Context) (*procgroup.StoreServer, error) {
	cfg := j.cfg
	j.storeAddr = net.JoinHostPort(cfg.storeHost, strconv.Itoa(cfg.storePort))
	if isLocalHost(cfg.storeHost) {
		srv, _, err := hostStore(cfg, j.token, storeLogger(j.con))
		if err == nil {
			j.con.msg(fmt.Sprintf("ddprun: this node hosts the job's rendezvous store on port %d\n", cfg.storePort))
			return srv, nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) {
			return nil, err
		}
	}
	if err := awaitStore(ctx, j.storeAddr, j.token, cfg.tls.client, cfg.rdzvTimeout, j.con); err != nil {
		return nil, orInterrupt(ctx, err)
	}
	return nil, nil
}

// isLocalHost reports whether host names this machine: a loopback name, or an address of
// one of its interfaces.
func isLocalHost(host string) bool {
	ips, err := net.LookupIP(host)
	if err != nil {
		return false
	}
	addrs, _ := net.InterfaceAddrs()
	for _, ip := range ips {
		if ip.IsLoopback() {
			return true
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ip) {
				return true
			}
		}
	}
	return false
}

// awaitJobEnd keeps the store up, on its host, until the job's last epoch has ended and all
// its members have left (package ddp/elastic: "finished" and "left"), or no rank has beaten
// ("alive") for --rdzv_timeout: a job that runs goes on, however long, after this node's
// ranks are done.
func (j *job) awaitJobEnd(ctx context.Context) {
	cfg := j.cfg
	st, err := procgroup.DialStore(ctx, j.storeAddr, j.token, procgroup.DialOptions{TLS: cfg.tls.client})
	if err != nil {
		return
	}
	defer st.Close()
	prefix := "elastic/" + j.runID + "/"
	j.con.msg("ddprun: this node's ranks are done; serving the store until the job ends\n")
	alive, moved := int64(-1), time.Now()
	for {
		v, _, err := st.CompareAndSet(ctx, prefix+"finished", []byte{0}, []byte{0})
		if err != nil {
			return
		}
		if v != nil {
			n, _ := strconv.Atoi(string(v))
			left, err := st.Add(ctx, prefix+"left", 0)
			if err != nil || int(left) >= n {
				return
			}
		}
		a, err := st.Add(ctx, prefix+"alive", 0)
		if err != nil {
			return
		}
		if a == 0 { // no rank has beaten: no epoch formed yet
			others, err := st.Add(ctx, prefix+"r0/arrive", 0)
			if err != nil || others <= int64(cfg.nproc) { // and no other node waits for one
				return
			}
		}
		if a != alive {
			alive, moved = a, time.Now()
		} else if time.Since(moved) > cfg.rdzvTimeout {
			j.con.msg(fmt.Sprintf("ddprun: no rank of the job has beaten for %v (--rdzv_timeout); closing its store\n", cfg.rdzvTimeout))
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
}
