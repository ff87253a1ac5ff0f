package procgroup

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
)

// Env is where this process sits in the job, as its launcher described it in environment
// variables.
type Env struct {
	Rank, WorldSize           int
	LocalRank, LocalWorldSize int
	// GroupRank is the index of this process's node (torchrun GROUP_RANK, SLURM_NODEID;
	// under Open MPI, Rank/LocalWorldSize).
	GroupRank int
	// MasterAddr and MasterPort locate rank 0's store when StoreAddr is empty.
	MasterAddr string
	MasterPort int
	// StoreAddr is a store already hosted by the launcher, "host:port": ddprun's gRPC store
	// (GODDP_STORE_ADDR, or GODDP_STORE=grpc://host:port), or a PyTorch TCPStore
	// (GODDP_STORE=tcpstore://host:port, or torchrun's agent store at MASTER_ADDR:MASTER_PORT
	// when TORCHELASTIC_USE_AGENT_STORE=True); StoreKind says which.
	StoreAddr string
	// StoreKind is StoreGRPC or StoreTCPStore when StoreAddr is set, StoreMemory for a
	// single-process world, and empty when rank 0 hosts the store at MasterAddr:MasterPort.
	StoreKind string
	// StorePrefix, when set, prefixes every key this job writes to the store: a store that
	// outlives a restart (torchrun's agent store) gets a new prefix per attempt
	// ("goddp/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>").
	StorePrefix string
	// Token is the job's secret (GODDP_TOKEN, or the contents of GODDP_TOKEN_FILE); empty
	// when neither is set.
	Token string
	// Source names the launcher the variables came from: "torchrun", "indexed-job" (a
	// Kubernetes Indexed Job: JOB_COMPLETION_INDEX), "slurm", "openmpi", or "single" when
	// no launcher variable is set at all.
	Source string
}

// Kinds of Env.StoreKind.
const (
	StoreGRPC     = "grpc"
	StoreTCPStore = "tcpstore"
	StoreMemory   = "memory"
)

// launcherVars are the variables whose presence means "a launcher started this process":
// with none of them set, EnvFrom describes a single-process world.
var launcherVars = []string{
	"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
	"JOB_COMPLETION_INDEX", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID",
	"SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "GODDP_STORE", "GODDP_STORE_ADDR",
}

// DefaultMasterPort is the store port when the launcher names none (torch's default).
const DefaultMasterPort = 29500

// InitFromEnv reads the process's environment; see EnvFrom.
func InitFromEnv() (Env, error) { return EnvFrom(os.LookupEnv) }

// EnvFrom reads the job description through lookup (os.LookupEnv in InitFromEnv).
//
// With none of the launcher variables set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// GROUP_RANK, MASTER_ADDR, MASTER_PORT, JOB_COMPLETION_INDEX, TORCHELASTIC_*, SLURM_PROCID,
// OMPI_COMM_WORLD_RANK, GODDP_STORE, GODDP_STORE_ADDR), the process is a world of its own:
// rank 0 of 1, with an in-process store (Source "single", StoreKind StoreMemory). Setting
// only some of them is an error that names a missing one.
//
// torchrun's variables come first: RANK, WORLD_SIZE (required), LOCAL_RANK and
// LOCAL_WORLD_SIZE (both absent means 0 and 1), GROUP_RANK (default RANK/LOCAL_WORLD_SIZE),
// MASTER_ADDR and MASTER_PORT. Without RANK, SLURM's are read (SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID, SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE, SLURM_NODEID; the master is
// MASTER_ADDR, else the first host of SLURM_JOB_NODELIST, else SLURM_LAUNCH_NODE_IPADDR; the
// port MASTER_PORT, else one derived from SLURM_JOB_ID), then Open MPI's
// (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE; the master is MASTER_ADDR, or
// 127.0.0.1 when every rank is on this host; the port MASTER_PORT, else one derived from
// the job id OMPI_MCA_ess_base_jobid, else DefaultMasterPort). MASTER_ADDR and MASTER_PORT are not needed when GODDP_STORE_ADDR names
// the launcher's store. A Kubernetes Indexed Job gives no RANK: with WORLD_SIZE set, the rank
// is JOB_COMPLETION_INDEX.
//
// The store: GODDP_STORE=tcpstore://host:port names a PyTorch TCPStore,
// GODDP_STORE=grpc://host:port (or GODDP_STORE_ADDR=host:port) a ddprun store; under
// torchrun with TORCHELASTIC_USE_AGENT_STORE=True (its static rendezvous, the default
// without --standalone or --rdzv_backend), the agent's TCPStore at MASTER_ADDR:MASTER_PORT,
// with the key prefix goddp/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>. Otherwise
// rank 0 hosts the store at MASTER_ADDR:MASTER_PORT.
//
// The token is GODDP_TOKEN, or the contents of GODDP_TOKEN_FILE, a file only its owner may
// read.
//
// A missing, non-numeric or inconsistent variable is an error that names it.
func EnvFrom(lookup func(string) (string, bool)) (Env, error) {
	r := envReader{lookup: lookup}
	var e Env
	var err error
	switch {
	case r.has("RANK") || r.has("WORLD_SIZE") || r.has("JOB_COMPLETION_INDEX"):
		e, err = r.torchrun()
	case r.has("SLURM_PROCID"):
		e, err = r.slurm()
	case r.has("OMPI_COMM_WORLD_RANK"):
		e, err = r.openmpi()
	case r.has(ElasticEnv):
		return Env{}, fmt.Errorf("procgroup: env: %s is set (ddprun --nnodes MIN:MAX): the ranks of an elastic job are handed out by its rendezvous, not the environment; create the group with package ddp/elastic (elastic.Start)", ElasticEnv)
	default:
		for _, v := range launcherVars {
			if r.has(v) {
				return Env{}, fmt.Errorf("procgroup: env: %s is set but RANK and WORLD_SIZE are not: set them (torchrun style), start under srun or mpirun, or unset %s to run as a single process", v, v)
			}
		}
		e = Env{WorldSize: 1, LocalWorldSize: 1, Source: "single", StoreKind: StoreMemory}
	}
	if err != nil {
		return Env{}, err
	}
	if e.Source != "single" {
		if err := r.store(&e); err != nil {
			return Env{}, err
		}
	}
	if e.Token, err = r.token(); err != nil {
		return Env{}, err
	}
	if err := e.check(); err != nil {
		return Env{}, err
	}
	return e, nil
}

// check verifies that the fields agree with each other; the messages name the variables
// of e.Source.
func (e *Env) check() error {
	n := envNames[e.Source]
	bad := func(format string, args ...any) error {
		return fmt.Errorf("procgroup: env: "+format, args...)
	}
	switch {
	case e.WorldSize < 1:
		return bad("%s=%d: want at least 1", n.world, e.WorldSize)
	case e.Rank < 0 || e.Rank >= e.WorldSize:
		return bad("%s=%d outside [0, %s=%d)", n.rank, e.Rank, n.world, e.WorldSize)
	case e.LocalWorldSize < 1 || e.LocalWorldSize > e.WorldSize:
		return bad("%s=%d outside [1, %s=%d]", n.localWorld, e.LocalWorldSize, n.world, e.WorldSize)
	case e.LocalRank < 0 || e.LocalRank >= e.LocalWorldSize:
		return bad("%s=%d outside [0, %s=%d)", n.localRank, e.LocalRank, n.localWorld, e.LocalWorldSize)
	case e.GroupRank < 0 || e.GroupRank >= e.WorldSize:
		return bad("%s=%d outside [0, %s=%d)", n.group, e.GroupRank, n.world, e.WorldSize)
	}
	if e.StoreAddr == "" && e.StoreKind != StoreMemory {
		if e.MasterAddr == "" {
			return bad("MASTER_ADDR not set (and no GODDP_STORE_ADDR)")
		}
		if e.MasterPort < 1 || e.MasterPort > 65535 {
			return bad("MASTER_PORT=%d outside [1, 65535]", e.MasterPort)
		}
	}
	return nil
}

// envNames are the variable names of each source, for error messages.
var envNames = map[string]struct{ rank, world, localRank, localWorld, group string }{
	"torchrun":    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"},
	"indexed-job": {"JOB_COMPLETION_INDEX", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"},
	"single":      {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"},
	"slurm":       {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID"},
	"openmpi": {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
		"OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_LOCAL_SIZE"},
}

type envReader struct {
	lookup func(string) (string, bool)
}

func (r envReader) has(name string) bool {
	_, ok := r.lookup(name)
	return ok
}

// str returns the trimmed value of name and whether it is set and not blank.
func (r envReader) str(name string) (string, bool) {
	v, ok := r.lookup(name)
	v = strings.TrimSpace(v)
	return v, ok && v != ""
}

// int reads a required integer variable.
func (r envReader) int(name string) (int, error) {
	v, ok := r.str(name)
	if !ok {
		return 0, fmt.Errorf("procgroup: env: %s not set", name)
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, fmt.Errorf("procgroup: env: %s=%q is not an integer", name, v)
	}
	return n, nil
}

// intOr reads an optional integer variable.
func (r envReader) intOr(name string, def int) (int, error) {
	if _, ok := r.str(name); !ok {
		return def, nil
	}
	return r.int(name)
}

// ints reads several required integers into the pointers that follow each name.
func (r envReader) ints(pairs ...any) error {
	for i := 0; i < len(pairs); i += 2 {
		n, err := r.int(pairs[i].(string))
		if err != nil {
			return err
		}
		*pairs[i+1].(*int) = n
	}
	return nil
}

func (r envReader) master(e *Env, defAddr string, defPort int) error {
	e.MasterAddr = defAddr
	if v, ok := r.str("MASTER_ADDR"); ok {
		e.MasterAddr = v
	}
	var err error
	e.MasterPort, err = r.intOr("MASTER_PORT", defPort)
	return err
}

func (r envReader) torchrun() (Env, error) {
	e := Env{Source: "torchrun"}
	rankVar := "RANK"
	if !r.has("RANK") && r.has("JOB_COMPLETION_INDEX") {
		rankVar, e.Source = "JOB_COMPLETION_INDEX", "indexed-job"
	}
	if err := r.ints(rankVar, &e.Rank, "WORLD_SIZE", &e.WorldSize); err != nil {
		return Env{}, err
	}
	_, hasLR := r.str("LOCAL_RANK")
	_, hasLW := r.str("LOCAL_WORLD_SIZE")
	switch {
	case hasLR && hasLW:
		if err := r.ints("LOCAL_RANK", &e.LocalRank, "LOCAL_WORLD_SIZE", &e.LocalWorldSize); err != nil {
			return Env{}, err
		}
	case hasLR:
		return Env{}, fmt.Errorf("procgroup: env: LOCAL_RANK set but LOCAL_WORLD_SIZE not set")
	case hasLW:
		return Env{}, fmt.Errorf("procgroup: env: LOCAL_WORLD_SIZE set but LOCAL_RANK not set")
	default:
		e.LocalRank, e.LocalWorldSize = 0, 1
	}
	def := 0
	if e.LocalWorldSize > 0 {
		def = e.Rank / e.LocalWorldSize
	}
	var err error
	if e.GroupRank, err = r.intOr("GROUP_RANK", def); err != nil {
		return Env{}, err
	}
	if err := r.master(&e, "", 0); err != nil {
		return Env{}, err
	}
	return e, nil
}

func (r envReader) slurm() (Env, error) {
	e := Env{Source: "slurm"}
	if err := r.ints("SLURM_PROCID", &e.Rank, "SLURM_LOCALID", &e.LocalRank, "SLURM_NODEID", &e.GroupRank); err != nil {
		return Env{}, err
	}
	worldVar := "SLURM_NTASKS"
	if !r.has(worldVar) && r.has("SLURM_NPROCS") {
		worldVar = "SLURM_NPROCS"
	}
	var err error
	if e.WorldSize, err = r.int(worldVar); err != nil {
		return Env{}, err
	}
	switch {
	case r.has("SLURM_NTASKS_PER_NODE"):
		if e.LocalWorldSize, err = r.int("SLURM_NTASKS_PER_NODE"); err != nil {
			return Env{}, err
		}
	case r.has("SLURM_TASKS_PER_NODE"):
		v, _ := r.str("SLURM_TASKS_PER_NODE")
		if e.LocalWorldSize, err = slurmTasksOnNode(v, e.GroupRank); err != nil {
			return Env{}, fmt.Errorf("procgroup: env: SLURM_TASKS_PER_NODE=%q: %w", v, err)
		}
	default:
		return Env{}, fmt.Errorf("procgroup: env: SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE not set")
	}
	addr := ""
	if v, ok := r.str("SLURM_JOB_NODELIST"); ok {
		addr = slurmFirstHost(v)
	} else if v, ok := r.str("SLURM_NODELIST"); ok {
		addr = slurmFirstHost(v)
	}
	if v, ok := r.str("SLURM_LAUNCH_NODE_IPADDR"); ok && addr == "" {
		addr = v
	}
	// Ranks of different jobs may share a node: derive the port from the job id.
	port := DefaultMasterPort
	if id, ok := r.str("SLURM_JOB_ID"); ok {
		if n, err := strconv.Atoi(id); err == nil && n >= 0 {
			port = 20000 + n%20000
		}
	}
	if err := r.master(&e, addr, port); err != nil {
		return Env{}, err
	}
	return e, nil
}

// slurmTasksOnNode expands SLURM_TASKS_PER_NODE ("2(x3),1": 2 tasks on each of the first
// three nodes, 1 on the fourth) and returns the count of node index node.
func slurmTasksOnNode(spec string, node int) (int, error) {
	i := 0
	for _, part := range strings.Split(spec, ",") {
		count, rep := part, "1"
		if j := strings.Index(part, "(x"); j >= 0 && strings.HasSuffix(part, ")") {
			count, rep = part[:j], part[j+2:len(part)-1]
		}
		c, err1 := strconv.Atoi(count)
		n, err2 := strconv.Atoi(rep)
		if err1 != nil || err2 != nil || c < 1 || n < 1 {
			return 0, fmt.Errorf("malformed element %q", part)
		}
		if node < i+n {
			return c, nil
		}
		i += n
	}
	return 0, fmt.Errorf("no entry for node %d (SLURM_NODEID)", node)
}

// slurmFirstHost returns the first host of a SLURM node list such as "gpu[07-09,12],cpu1"
// ("gpu07"), keeping zero padding.
func slurmFirstHost(list string) string {
	// The first element ends at the first comma outside brackets.
	depth, end := 0, len(list)
	for i, c := range list {
		if c == '[' {
			depth++
		} else if c == ']' {
			depth--
		} else if c == ',' && depth == 0 {
			end = i
			break
		}
	}
	first := list[:end]
	open := strings.IndexByte(first, '[')
	if open < 0 {
		return first
	}
	close := strings.IndexByte(first, ']')
	if close < open {
		return ""
	}
	inner := first[open+1 : close]
	if j := strings.IndexAny(inner, ",-"); j >= 0 {
		inner = inner[:j]
	}
	return first[:open] + inner + first[close+1:]
}

func (r envReader) openmpi() (Env, error) {
	e := Env{Source: "openmpi"}
	if err := r.ints("OMPI_COMM_WORLD_RANK", &e.Rank, "OMPI_COMM_WORLD_SIZE", &e.WorldSize,
		"OMPI_COMM_WORLD_LOCAL_RANK", &e.LocalRank, "OMPI_COMM_WORLD_LOCAL_SIZE", &e.LocalWorldSize); err != nil {
		return Env{}, err
	}
	// OMPI_COMM_WORLD_NODE_RANK is a rank among the processes on this node, not the node's
	// index: with mpirun's default placement (by slot), the node index is this.
	if e.LocalWorldSize > 0 {
		e.GroupRank = e.Rank / e.LocalWorldSize
	}
	addr := ""
	if e.LocalWorldSize == e.WorldSize {
		addr = "127.0.0.1" // every rank on this host
	}
	// Jobs of different mpirun runs may share a node: derive the port from the job id.
	port := DefaultMasterPort
	if id, ok := r.str("OMPI_MCA_ess_base_jobid"); ok {
		if n, err := strconv.ParseUint(id, 10, 64); err == nil {
			port = 20000 + int(n%20000)
		}
	}
	if err := r.master(&e, addr, port); err != nil {
		return Env{}, err
	}
	return e, nil
}

// store reads GODDP_STORE, GODDP_STORE_ADDR and torchrun's TORCHELASTIC_USE_AGENT_STORE.
func (r envReader) store(e *Env) error {
	url, hasURL := r.str("GODDP_STORE")
	addr, hasAddr := r.str("GODDP_STORE_ADDR")
	agent, _ := r.str("TORCHELASTIC_USE_AGENT_STORE")
	switch {
	case hasURL && hasAddr:
		return fmt.Errorf("procgroup: env: both GODDP_STORE and GODDP_STORE_ADDR set; set one")
	case hasURL:
		scheme, hostport, ok := strings.Cut(url, "://")
		switch {
		case !ok:
			return fmt.Errorf("procgroup: env: GODDP_STORE=%q: want tcpstore://host:port or grpc://host:port", url)
		case scheme == StoreTCPStore || scheme == StoreGRPC:
			e.StoreKind, e.StoreAddr = scheme, hostport
		default:
			return fmt.Errorf("procgroup: env: GODDP_STORE=%q: unknown scheme %q (want tcpstore or grpc)", url, scheme)
		}
		if _, _, err := net.SplitHostPort(hostport); err != nil {
			return fmt.Errorf("procgroup: env: GODDP_STORE=%q: want %s://host:port", url, scheme)
		}
	case hasAddr:
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("procgroup: env: GODDP_STORE_ADDR=%q: want host:port", addr)
		}
		e.StoreKind, e.StoreAddr = StoreGRPC, addr
	case strings.EqualFold(agent, "true") || agent == "1":
		if e.MasterAddr == "" || e.MasterPort < 1 || e.MasterPort > 65535 {
			return fmt.Errorf("procgroup: env: TORCHELASTIC_USE_AGENT_STORE=%s but MASTER_ADDR=%q, MASTER_PORT=%d do not name the agent's store", agent, e.MasterAddr, e.MasterPort)
		}
		e.StoreKind = StoreTCPStore
		e.StoreAddr = net.JoinHostPort(e.MasterAddr, strconv.Itoa(e.MasterPort))
		run, ok := r.str("TORCHELASTIC_RUN_ID")
		if !ok {
			run = "none"
		}
		restart, err := r.intOr("TORCHELASTIC_RESTART_COUNT", 0)
		if err != nil {
			return err
		}
		e.StorePrefix = fmt.Sprintf("goddp/%s/%d", run, restart)
	}
	return nil
}

// ElasticEnv names the variable that an elastic ddprun (--nnodes MIN:MAX) sets in its
// ranks' environment, "MIN:MAX" nodes, in place of RANK and WORLD_SIZE.
const ElasticEnv = "GODDP_ELASTIC_NNODES"

// TokenFromEnv reads the job token as EnvFrom does: GODDP_TOKEN, or the contents of
// GODDP_TOKEN_FILE (a file only its owner may read); "" when neither is set. lookup nil
// means os.LookupEnv.
func TokenFromEnv(lookup func(string) (string, bool)) (string, error) {
	if lookup == nil {
		lookup = os.LookupEnv
	}
	return envReader{lookup: lookup}.token()
}

// token reads GODDP_TOKEN or GODDP_TOKEN_FILE.
func (r envReader) token() (string, error) {
	tok, hasTok := r.str("GODDP_TOKEN")
	path, hasFile := r.str("GODDP_TOKEN_FILE")
	switch {
	case hasTok && hasFile:
		return "", fmt.Errorf("procgroup: env: both GODDP_TOKEN and GODDP_TOKEN_FILE set; set one")
	case hasTok:
		return tok, nil
	case !hasFile:
		return "", nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		return "", fmt.Errorf("procgroup: env: GODDP_TOKEN_FILE: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return "", fmt.Errorf("procgroup: env: GODDP_TOKEN_FILE=%s is not a regular file", path)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return "", fmt.Errorf("procgroup: env: GODDP_TOKEN_FILE=%s has mode %04o; others can read it (chmod 600)", path, perm)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("procgroup: env: GODDP_TOKEN_FILE: %w", err)
	}
	tok = strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("procgroup: env: GODDP_TOKEN_FILE=%s is empty", path)
	}
	return tok, nil
}
