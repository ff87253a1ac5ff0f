package elastic

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// The variables an elastic ddprun (--nnodes MIN:MAX) sets for its ranks, besides
// procgroup.ElasticEnv ("MIN:MAX"), LOCAL_RANK, LOCAL_WORLD_SIZE, GODDP_STORE_ADDR,
// GODDP_TOKEN_FILE and GODDP_RUN_ID (the job's id: the prefix of its keys in the store).
const (
	// NodeEnv is the launcher's name for this node, unique in the job.
	NodeEnv = "GODDP_ELASTIC_NODE"
	// TimeoutEnv bounds a rendezvous round: how long the ranks wait for MIN nodes
	// (ddprun --rdzv_timeout).
	TimeoutEnv = "GODDP_ELASTIC_TIMEOUT"
	// LastCallEnv is how long a round waits after its last arrival before it closes.
	LastCallEnv = "GODDP_ELASTIC_LAST_CALL"
	// HeartbeatEnv is how often each rank beats; HeartbeatTimeoutEnv how long a rank
	// may stay silent before the others drop it.
	HeartbeatEnv        = "GODDP_ELASTIC_HEARTBEAT"
	HeartbeatTimeoutEnv = "GODDP_ELASTIC_HEARTBEAT_TIMEOUT"
)

// Defaults of the bounds. The heartbeat timeout keeps a silent host's detection near 10 s,
// so that the survivors go on within 20 s of a cut link; a dead process is seen at once
// (its connections close).
const (
	DefaultTimeout          = 5 * time.Minute
	DefaultLastCall         = time.Second
	DefaultHeartbeat        = time.Second
	DefaultHeartbeatTimeout = 10 * time.Second
)

// Enabled reports whether this process was started by an elastic launcher (lookup nil:
// os.LookupEnv).
func Enabled(lookup func(string) (string, bool)) bool {
	if lookup == nil {
		lookup = os.LookupEnv
	}
	_, ok := lookup(procgroup.ElasticEnv)
	return ok
}

// config is the job as the launcher describes it.
type config struct {
	minNodes, maxNodes   int
	localRank, localSize int
	node, host           string
	pid                  int
	storeAddr, token     string
	tls                  procgroup.TLSFiles
	runID                string
	timeout, lastCall    time.Duration
	heartbeat, hbTimeout time.Duration
	connectTimeout       time.Duration
}

// minProcs and maxProcs are the bounds in processes: nodes times this node's ranks.
func (c *config) minProcs() int { return c.minNodes * c.localSize }
func (c *config) maxProcs() int { return c.maxNodes * c.localSize }

func configFrom(lookup func(string) (string, bool)) (*config, error) {
	get := func(k string) (string, bool) {
		v, ok := lookup(k)
		return strings.TrimSpace(v), ok
	}
	need := func(k string) (string, error) {
		v, ok := get(k)
		if !ok || v == "" {
			return "", fmt.Errorf("elastic: env: %s is not set (an elastic launcher sets it: ddprun --nnodes MIN:MAX)", k)
		}
		return v, nil
	}
	num := func(k string, def int) (int, error) {
		v, ok := get(k)
		if !ok || v == "" {
			return def, nil
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("elastic: env: %s=%q: want a count", k, v)
		}
		return n, nil
	}
	dur := func(k string, def time.Duration) (time.Duration, error) {
		v, ok := get(k)
		if !ok || v == "" {
			return def, nil
		}
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return 0, fmt.Errorf("elastic: env: %s=%q: want a positive duration such as 10s", k, v)
		}
		return d, nil
	}
	c := &config{pid: os.Getpid()}
	c.host, _ = os.Hostname()
	nn, err := need(procgroup.ElasticEnv)
	if err != nil {
		return nil, err
	}
	lo, hi, ok := strings.Cut(nn, ":")
	if !ok {
		hi = lo
	}
	c.minNodes, err = strconv.Atoi(lo)
	if err == nil {
		c.maxNodes, err = strconv.Atoi(hi)
	}
	if err != nil || c.minNodes < 1 || c.maxNodes < c.minNodes {
		return nil, fmt.Errorf("elastic: env: %s=%q: want MIN:MAX nodes, 1 <= MIN <= MAX", procgroup.ElasticEnv, nn)
	}
	if c.localRank, err = num("LOCAL_RANK", 0); err != nil {
		return nil, err
	}
	if c.localSize, err = num("LOCAL_WORLD_SIZE", 1); err != nil {
		return nil, err
	}
	if c.localSize < 1 || c.localRank >= c.localSize {
		return nil, fmt.Errorf("elastic: env: LOCAL_RANK=%d outside [0, LOCAL_WORLD_SIZE=%d)", c.localRank, c.localSize)
	}
	if c.node, err = need(NodeEnv); err != nil {
		return nil, err
	}
	if c.storeAddr, err = need("GODDP_STORE_ADDR"); err != nil {
		return nil, err
	}
	if c.runID, err = need("GODDP_RUN_ID"); err != nil {
		return nil, err
	}
	if c.token, err = procgroup.TokenFromEnv(lookup); err != nil {
		return nil, err
	}
	if c.token == "" {
		return nil, fmt.Errorf("elastic: env: no job token (GODDP_TOKEN or GODDP_TOKEN_FILE)")
	}
	if c.tls, err = procgroup.TLSFromEnv(lookup); err != nil {
		return nil, err
	}
	if c.timeout, err = dur(TimeoutEnv, DefaultTimeout); err != nil {
		return nil, err
	}
	if c.lastCall, err = dur(LastCallEnv, DefaultLastCall); err != nil {
		return nil, err
	}
	if c.heartbeat, err = dur(HeartbeatEnv, DefaultHeartbeat); err != nil {
		return nil, err
	}
	if c.hbTimeout, err = dur(HeartbeatTimeoutEnv, DefaultHeartbeatTimeout); err != nil {
		return nil, err
	}
	if c.hbTimeout < 2*c.heartbeat {
		return nil, fmt.Errorf("elastic: env: %s=%v is under two heartbeats (%s=%v)", HeartbeatTimeoutEnv, c.hbTimeout, HeartbeatEnv, c.heartbeat)
	}
	if c.connectTimeout, err = procgroup.ConnectTimeoutFrom(lookup); err != nil {
		return nil, err
	}
	return c, nil
}
