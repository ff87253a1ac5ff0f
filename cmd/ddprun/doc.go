// Command ddprun is goddp's launcher, the torchrun of Go: it starts the ranks of a
// data-parallel job on this node, hosts the job's rendezvous store, and restarts the whole
// group when a rank fails.
//
// # Usage
//
//	ddprun [flags] PROGRAM [--] [args...]
//
//	ddprun --nproc_per_node 2 ./examples/transformer -- --bucket_cap_mb 25
//	ddprun --standalone --nproc_per_node 4 --max_restarts 3 --log_dir logs ./bin/trainer
//	GODDP_TOKEN=$(cat job.token) ddprun --nnodes 2 --node_rank 0 --master_addr node0 --master_port 29500 ./bin/trainer
//	GODDP_TOKEN=$(cat job.token) ddprun --nnodes 2 --node_rank 1 --master_addr node0 --master_port 29500 ./bin/trainer
//	GODDP_TOKEN=$(cat job.token) ddprun --nnodes 2:3 --rdzv_endpoint node0:29500 ./bin/trainer  # on each node
//
// Flags come before PROGRAM, in torchrun's spelling (--nproc_per_node or --nproc-per-node,
// "--flag value" or "--flag=value"); everything after PROGRAM, after one optional "--", is
// passed to it. PROGRAM is an executable, a bare command name found in PATH, or a Go main
// package (a directory, a .go file, or an import path such as example.com/x/cmd/y), which
// ddprun builds once with 'go build' into a temporary directory (--go_build_flags adds
// flags; GODDP_GO_TAGS adds -tags).
//
// # What each rank gets
//
// torchrun's environment: RANK (= node_rank*nproc_per_node + LOCAL_RANK), WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE,
// ROLE_NAME, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
// TORCHELASTIC_RUN_ID; and goddp's: GODDP_STORE_ADDR (host:port of the gRPC rendezvous
// store), GODDP_TOKEN_FILE (a 0600 file holding the job token, which never appears on a
// command line or in the ranks' environment) and GODDP_RUN_ID (a prefix for store keys that
// changes with every restart, so a restarted group never sees its predecessor's keys). With
// more than one rank per node, OMP_NUM_THREADS and OPENBLAS_NUM_THREADS default to 1.
// OPENBLAS_CORETYPE defaults to the OpenBLAS kernels for the CPU (SkylakeX with AVX-512,
// Haswell with AVX2 and FMA): an older OpenBLAS takes a CPU it does not know for a Prescott.
// GOMAXPROCS is left as it is unless --gomaxprocs says split (the cores divided among the
// node's ranks) or a number: dividing them measured slower (see setGoMaxProcs).
//
// # The store and the token
//
// Node 0's ddprun hosts the store: on --master_addr:--master_port for one node (--standalone:
// 127.0.0.1 and a free port), or on every interface at that port (or --rdzv_endpoint's) for
// several. A single-node job gets a fresh random token; a multi-node job reads its token from
// GODDP_TOKEN or GODDP_TOKEN_FILE in ddprun's environment (the same on every node), and the
// other nodes wait up to --rdzv_timeout for node 0's store to accept it.
//
// # Output
//
// Each line a rank writes goes to ddprun's stdout or stderr (the same stream the rank used),
// prefixed "[rankN]: ", written whole. With --log_dir each rank's streams also go to
// LOG_DIR/attempt_K/RANK/stdout.log and stderr.log, and --tee (0 none, 1 stdout, 2 stderr,
// 3 both, the default) picks which streams still reach the console.
//
// # Failures
//
// Every rank runs in its own process group, dies with ddprun (Pdeathsig), and takes with it
// anything it started when it exits (Note [Reaping]). When a rank exits non-zero or is killed
// by a signal, ddprun sends SIGTERM to the others, SIGKILL after --stop_timeout, prints the
// first failure (rank, host, pid, exit code or signal, the last lines of its stdout and
// stderr) and starts the group again, up to --max_restarts times. If it gives up it exits with
// the first failure's exit code (128+N for signal N). SIGINT, SIGTERM, SIGHUP or SIGQUIT to
// ddprun stop every rank the same way, and ddprun exits 128+N. A bad command line exits 2;
// other errors before the ranks start (no such program, a failed build, the store's port in
// use) exit 1.
//
// With --nnodes MIN:MAX (or --rdzv_backend c10d) the job is elastic (Note [Elastic ddprun]):
// the ranks get no RANK or WORLD_SIZE but package ddp/elastic's variables, a failed node
// does not stop the others, and --max_restarts restarts this node's ranks, which join the
// running job as new processes.
//
// In a multi-node job the nodes' ddprun keep in step through the store (Note [Multi-node
// restarts]): they start each attempt together, a failure on one node stops and restarts the
// ranks of every node, and an interrupt on one node stops the job everywhere.
package main
