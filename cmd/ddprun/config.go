package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// usageError is an error in the command line: run prints it with a usage hint and exits 2.
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

// Default values, as torchrun's where torchrun has one.
const (
	defaultMasterAddr  = "127.0.0.1"
	defaultMasterPort  = 29500
	defaultStopTimeout = 10 * time.Second
	defaultRdzvTimeout = 5 * time.Minute
)

// teeMode says which of a rank's streams go to ddprun's console when --log_dir is set.
type teeMode int

const (
	teeStdout teeMode = 1 << iota
	teeStderr
	teeNone teeMode = 0
	teeBoth         = teeStdout | teeStderr
)

// config is a parsed, validated command line.
type config struct {
	nproc        int
	nnodes       int  // MAX with a range
	minNodes     int  // MIN of --nnodes MIN:MAX; nnodes without a range
	elastic      bool // --nnodes MIN:MAX or --rdzv_backend c10d (Note [Elastic ddprun])
	rdzvBackend  string
	nodeRankSet  bool
	nodeRank     int
	masterAddr   string
	masterPort   int
	rdzvEndpoint string
	rdzvID       string
	standalone   bool
	maxRestarts  int
	logDir       string
	tee          teeMode
	teeSet       bool
	goBuildFlags string
	stopTimeout  time.Duration
	rdzvTimeout  time.Duration
	traceMerge   string // Note [Trace merge]
	gomaxprocs   string // keep, split or a number (setGoMaxProcs)

	tlsFlags procgroup.TLSFiles // --tls_cert, --tls_key, --tls_ca, --tls_mtls
	tls      jobTLS             // loaded by loadTLS (tls.go)

	program string   // PROGRAM as given
	args    []string // its arguments

	// Derived by validate.
	storeHost string // host the ranks dial for the store
	storePort int    // 0: pick a free port (only when this node hosts the store)
}

// nprocValue parses --nproc_per_node: a positive integer, or "cpu"/"auto" for one rank per
// CPU core.
type nprocValue struct{ n *int }

func (v nprocValue) String() string {
	if v.n == nil {
		return "1"
	}
	return strconv.Itoa(*v.n)
}

func (v nprocValue) Set(s string) error {
	switch s {
	case "cpu", "auto":
		*v.n = runtime.NumCPU()
		return nil
	case "gpu":
		return errors.New(`"gpu" is not supported; give the number of ranks`)
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return errors.New("not an integer (or cpu, auto)")
	}
	*v.n = n
	return nil
}

// nnodesValue parses --nnodes: a number of nodes, or torchrun's elastic range MIN:MAX.
type nnodesValue struct{ c *config }

func (v nnodesValue) String() string {
	if v.c == nil {
		return "1"
	}
	if v.c.minNodes != v.c.nnodes {
		return fmt.Sprintf("%d:%d", v.c.minNodes, v.c.nnodes)
	}
	return strconv.Itoa(v.c.nnodes)
}

func (v nnodesValue) Set(s string) error {
	lo, hi, isRange := strings.Cut(s, ":")
	if !isRange {
		hi = lo
	}
	a, err1 := strconv.Atoi(lo)
	b, err2 := strconv.Atoi(hi)
	if err1 != nil || err2 != nil {
		return errors.New("want a number of nodes or a range MIN:MAX")
	}
	if isRange && (a < 1 || b < a) {
		return fmt.Errorf("the range %d:%d: want 1 <= MIN <= MAX", a, b)
	}
	v.c.minNodes, v.c.nnodes = a, b
	v.c.elastic = v.c.elastic || isRange
	return nil
}

// teeValue parses --tee as torchrun does: 0 (none), 1 (stdout), 2 (stderr), 3 (both); the
// names none, stdout, stderr and both are accepted too.
type teeValue struct {
	m   *teeMode
	set *bool
}

func (v teeValue) String() string {
	if v.m == nil {
		return "3"
	}
	return strconv.Itoa(int(*v.m))
}

func (v teeValue) Set(s string) error {
	modes := map[string]teeMode{
		"0": teeNone, "none": teeNone,
		"1": teeStdout, "stdout": teeStdout,
		"2": teeStderr, "stderr": teeStderr,
		"3": teeBoth, "both": teeBoth,
	}
	m, ok := modes[s]
	if !ok {
		return errors.New("want 0 (none), 1 (stdout), 2 (stderr) or 3 (both)")
	}
	*v.m, *v.set = m, true
	return nil
}

// newFlagSet defines ddprun's flags on c. Every name_with_underscores flag also answers to
// its name-with-dashes, as torchrun's do; aliases lists those.
func newFlagSet(c *config) (fs *flag.FlagSet, aliases map[string]bool) {
	fs = flag.NewFlagSet("ddprun", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // run prints errors and usage itself
	c.nproc, c.nnodes, c.tee = 1, 1, teeBoth
	fs.Var(nprocValue{&c.nproc}, "nproc_per_node", "number of ranks on this node (an integer, or cpu/auto for one per CPU core)")
	c.nnodes, c.minNodes = 1, 1
	fs.Var(nnodesValue{c}, "nnodes", "number of nodes, or an elastic range MIN:MAX (nodes may leave and join; the ranks come from the rendezvous)")
	fs.StringVar(&c.rdzvBackend, "rdzv_backend", "static", "static (fixed ranks from --node_rank), or c10d (elastic: node ranks handed out by the rendezvous at --rdzv_endpoint, as with --nnodes MIN:MAX)")
	fs.IntVar(&c.nodeRank, "node_rank", 0, "this node's index in [0, nnodes)")
	fs.StringVar(&c.masterAddr, "master_addr", defaultMasterAddr, "address of the node that hosts the rendezvous store (node 0)")
	fs.IntVar(&c.masterPort, "master_port", defaultMasterPort, "port of the rendezvous store")
	fs.StringVar(&c.rdzvEndpoint, "rdzv_endpoint", "", "HOST[:PORT] of the rendezvous store; overrides --master_addr/--master_port")
	fs.StringVar(&c.rdzvID, "rdzv_id", "", "job id: the prefix of the store keys (default: random, or derived from the token when nnodes > 1)")
	fs.BoolVar(&c.standalone, "standalone", false, "single node, store on a free local port")
	fs.IntVar(&c.maxRestarts, "max_restarts", 0, "restart the whole group up to this many times after a rank fails")
	fs.StringVar(&c.logDir, "log_dir", "", "write each rank's output to LOG_DIR/attempt_K/RANK/{stdout,stderr}.log")
	fs.Var(teeValue{&c.tee, &c.teeSet}, "tee", "with --log_dir, the streams also shown on the console: 0 none, 1 stdout, 2 stderr, 3 both")
	fs.StringVar(&c.goBuildFlags, "go_build_flags", "", "extra flags for 'go build' when PROGRAM is a Go package (env GODDP_GO_TAGS adds -tags)")
	fs.DurationVar(&c.stopTimeout, "stop_timeout", defaultStopTimeout, "grace period between SIGTERM and SIGKILL when stopping ranks")
	fs.DurationVar(&c.rdzvTimeout, "rdzv_timeout", defaultRdzvTimeout, "how long a node other than node 0 waits for the store, and each rank's set-up bound (GODDP_CONNECT_TIMEOUT) unless the environment sets one")
	fs.StringVar(&c.gomaxprocs, "gomaxprocs", "keep", "GOMAXPROCS of each rank unless the environment sets it: keep (Go's default, all cores), split (the cores divided among this node's ranks) or a number")
	fs.StringVar(&c.traceMerge, "trace_merge", "", "have each rank trace its timeline (observe.OpenTrace) and merge this node's traces into this file at the end")
	tlsFlags(fs, &c.tlsFlags) // tls.go
	aliases = map[string]bool{}
	var names []string
	fs.VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
	for _, name := range names {
		if dash := strings.ReplaceAll(name, "_", "-"); dash != name {
			fs.Var(fs.Lookup(name).Value, dash, "alias of --"+name)
			aliases[dash] = true
		}
	}
	return fs, aliases
}

const usageHead = `usage: ddprun [flags] PROGRAM [--] [args...]

Runs --nproc_per_node copies of PROGRAM (an executable, or a Go package that ddprun builds
once) as the ranks of one data-parallel job, hosts the job's rendezvous store, prefixes each
output line with its rank and restarts the group up to --max_restarts times when a rank fails.
Flags go before PROGRAM; everything after PROGRAM (and after an optional "--") goes to it.

flags:
`

// printUsage writes the usage text to w.
func printUsage(w io.Writer) {
	var c config
	fs, aliases := newFlagSet(&c)
	fmt.Fprint(w, usageHead)
	fs.VisitAll(func(f *flag.Flag) {
		if aliases[f.Name] {
			return
		}
		typ, usage := flag.UnquoteUsage(f)
		if _, ok := f.Value.(interface{ IsBoolFlag() bool }); ok {
			typ = ""
		}
		fmt.Fprintf(w, "  --%s %s\n\t%s", f.Name, typ, usage)
		if f.DefValue != "" && f.DefValue != "0" && f.DefValue != "false" {
			fmt.Fprintf(w, " (default %s)", f.DefValue)
		}
		fmt.Fprintln(w)
	})
}

// parseArgs parses ddprun's command line (without the program name). Errors are *usageError.
// It returns flag.ErrHelp for -h/--help. warn receives notes about likely mistakes.
func parseArgs(args []string, warn func(string)) (*config, error) {
	c := &config{}
	fs, _ := newFlagSet(c)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, &usageError{err}
	}
	fs.Visit(func(f *flag.Flag) { c.nodeRankSet = c.nodeRankSet || f.Name == "node_rank" || f.Name == "node-rank" })
	rest := fs.Args()
	if len(rest) == 0 {
		return nil, &usageError{errors.New("missing PROGRAM")}
	}
	c.program, c.args = rest[0], rest[1:]
	if strings.HasPrefix(c.program, "-") {
		return nil, &usageError{fmt.Errorf("PROGRAM %q looks like a flag", c.program)}
	}
	if len(c.args) > 0 && c.args[0] == "--" {
		c.args = c.args[1:]
	} else {
		// Note [Flags after PROGRAM]: like torchrun, everything after PROGRAM belongs to
		// PROGRAM. A ddprun flag there is most likely misplaced, so say so (but pass it on:
		// the program may have a flag of the same name).
		for _, a := range c.args {
			if a == "--" {
				break
			}
			name := strings.TrimLeft(a, "-")
			if i := strings.IndexByte(name, '='); i >= 0 {
				name = name[:i]
			}
			if strings.HasPrefix(a, "-") && name != "" && fs.Lookup(name) != nil {
				warn(fmt.Sprintf("%q comes after PROGRAM, so it is passed to %s, not to ddprun; put ddprun's flags before PROGRAM (and the program's after \"--\")", a, c.program))
			}
		}
	}
	if err := c.validate(); err != nil {
		return nil, &usageError{err}
	}
	return c, nil
}

// validate checks the values and derives the store address.
func (c *config) validate() error {
	switch {
	case c.nproc < 1:
		return fmt.Errorf("--nproc_per_node %d: want at least 1", c.nproc)
	case c.nnodes < 1:
		return fmt.Errorf("--nnodes %d: want at least 1", c.nnodes)
	case c.rdzvBackend != "static" && c.rdzvBackend != "c10d":
		return fmt.Errorf("--rdzv_backend %q: want static or c10d", c.rdzvBackend)
	case c.nodeRank < 0 || c.nodeRank >= c.nnodes:
		return fmt.Errorf("--node_rank %d: want a value in [0, %d) (--nnodes %d)", c.nodeRank, c.nnodes, c.nnodes)
	case c.maxRestarts < 0:
		return fmt.Errorf("--max_restarts %d: want at least 0", c.maxRestarts)
	case c.masterPort < 0 || c.masterPort > 65535:
		return fmt.Errorf("--master_port %d: want a port in [0, 65535]", c.masterPort)
	case c.stopTimeout <= 0:
		return fmt.Errorf("--stop_timeout %v: want a positive duration", c.stopTimeout)
	case c.rdzvTimeout <= 0:
		return fmt.Errorf("--rdzv_timeout %v: want a positive duration", c.rdzvTimeout)
	case !validGoMaxProcs(c.gomaxprocs):
		return fmt.Errorf("--gomaxprocs %q: want keep, split or a positive number", c.gomaxprocs)
	case c.teeSet && c.logDir == "":
		return errors.New("--tee needs --log_dir (without it every stream goes to the console)")
	case c.masterAddr == "":
		return errors.New("--master_addr is empty")
	}
	c.storeHost, c.storePort = c.masterAddr, c.masterPort
	if c.rdzvEndpoint != "" {
		host, port, err := splitEndpoint(c.rdzvEndpoint, c.masterPort)
		if err != nil {
			return fmt.Errorf("--rdzv_endpoint %q: %v", c.rdzvEndpoint, err)
		}
		c.storeHost, c.storePort = host, port
	}
	if c.standalone {
		if c.nnodes != 1 {
			return fmt.Errorf("--standalone is for one node, but --nnodes is %d", c.nnodes)
		}
		if c.rdzvEndpoint != "" {
			return errors.New("--standalone picks its own store address; drop --rdzv_endpoint")
		}
		c.storeHost, c.storePort = "127.0.0.1", 0
	}
	if c.rdzvBackend == "c10d" {
		c.elastic = true
	}
	if c.elastic {
		if err := c.validateElastic(); err != nil {
			return err
		}
	}
	if c.nnodes > 1 && c.storePort == 0 {
		return errors.New("a multi-node job needs a fixed store port (--master_port or --rdzv_endpoint HOST:PORT)")
	}
	return c.validateTLS() // tls.go
}

// splitEndpoint splits HOST[:PORT]; a missing port is defPort.
func splitEndpoint(ep string, defPort int) (string, int, error) {
	host, portStr, err := net.SplitHostPort(ep)
	if err != nil {
		// No port: the whole thing is the host (an IPv6 literal may come bracketed).
		host, portStr = strings.TrimSuffix(strings.TrimPrefix(ep, "["), "]"), strconv.Itoa(defPort)
	}
	if host == "" {
		return "", 0, errors.New("empty host")
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 1 || port > 65535 {
		return "", 0, fmt.Errorf("bad port %q", portStr)
	}
	return host, port, nil
}

// isStoreHost reports whether this node hosts the rendezvous store: node 0 does (an
// elastic job decides when it starts: hostsElasticStore).
func (c *config) isStoreHost() bool { return !c.elastic && c.nodeRank == 0 }
