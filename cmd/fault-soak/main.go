//go:build linux

// Command fault-soak runs a data-parallel job under faults for a while and checks that it
// recovers from each one and ends with the parameters of an uninterrupted run.
//
//	fault-soak [flags] -- TRAINER [trainer flags]
//	fault-soak --ddprun bin/ddprun --duration 20m -- bin/transformer --num_layers 1 --hidden_size 64 \
//	    --seq_len 16 --global_batch_size 16 --micro_batch_size 4 --warmup_steps 0 --bench_steps 20000 \
//	    --log_every 50 --checkpoint_every 100
//
// scripts/soak.sh builds the binaries and runs it with the defaults above.
//
// First the job runs once without faults (the reference: its params_crc32). Then it runs
// again and again ("rounds"), each round under ddprun --max_restarts with a fresh
// --checkpoint_dir (ddprun restarts the group after a failure and the trainer resumes from
// its newest checkpoint), until --duration is over; a round started before then runs to its
// end. While the duration lasts, every --gap (drawn at random) one fault is injected, the
// kinds dealt out in turn in a random order:
//
//	kill      kill -9 of a rank (any rank, at random)
//	stop      SIGSTOP of a rank, SIGCONT after --stop_for
//	stranger  4 KiB of random bytes on every listening TCP and Unix socket of the job's
//	          processes (the store, the data plane), dialled in their network namespace
//	link      a testbed host's link down, up after --link_down (with the testbed only)
//
// A fault is injected only when every rank is up and rank 0 has stepped since the last
// recovery. A fault is recovered from when rank 0 steps past the step it was at (after the
// group's restart, where one followed), or the round ends well, within --recover_timeout.
// Every round must end with the reference's params_crc32 on every rank. Between faults,
// every --sample_every, the soak reads the resident memory (VmRSS) and the open descriptors
// of ddprun and of every rank from /proc.
//
// With --testbed (default auto: when run as root with ip(8)), the job runs on two hosts of
// a network-namespace testbed (package internal/testbed), half of the ranks on each, under
// ddprun --nnodes 2 with a fresh job token; otherwise on this host under ddprun
// --standalone, without the link fault.
//
// It prints one line per fault as it goes and, at the end, the tables (faults by kind,
// rounds, RSS and descriptors at the start and end, every fault), also written to
// OUT/report.md; the launchers' output goes to OUT/job.log. The exit status is 0 if every
// fault was recovered from and every round ended at the reference's params_crc32, 1 if
// not, 2 for bad flags.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/goddp/goddp/internal/testbed"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("fault-soak", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg soakConfig
	var spec jobSpec
	nproc := fs.Int("nproc", 4, "ranks of the job")
	fs.DurationVar(&cfg.duration, "duration", 20*time.Minute, "how long faults are injected (a round started before the end runs to its end)")
	gap := fs.String("gap", "30s-90s", "time between faults, drawn at random from LO-HI")
	stopFor := fs.String("stop_for", "2s-15s", "how long a stopped rank stays stopped, LO-HI")
	linkDown := fs.String("link_down", "2s-15s", "how long a host's link stays down, LO-HI")
	faults := fs.String("faults", "kill,stop,stranger,link", "the kinds of fault, comma-separated (link only with the testbed)")
	tbMode := fs.String("testbed", "auto", "run on a two-host testbed: on, off, or auto (when root with ip(8))")
	fs.IntVar(&spec.maxRestarts, "max_restarts", 1000, "ddprun's --max_restarts")
	timeout := fs.Duration("collective_timeout", 10*time.Second, "the ranks' GODDP_COLLECTIVE_TIMEOUT (0: leave it unset): a rank stopped longer is given up on and the group restarted")
	fs.DurationVar(&cfg.recoverTimeout, "recover_timeout", 3*time.Minute, "a fault not recovered from within this time fails the soak")
	fs.DurationVar(&cfg.sampleEvery, "sample_every", 10*time.Second, "how often the processes' RSS and descriptors are read")
	fs.Uint64Var(&cfg.seed, "seed", 0, "seed of the faults' schedule (0: a random one, printed)")
	fs.StringVar(&cfg.out, "out", "", "directory for job.log and report.md (default: a new temporary directory)")
	fs.StringVar(&spec.ddprun, "ddprun", "ddprun", "the ddprun binary")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: fault-soak [flags] -- TRAINER [trainer flags]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	bad := func(err error) int {
		fmt.Fprintln(stderr, "fault-soak:", err)
		return 2
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return 2
	}
	spec.trainer, spec.args = fs.Arg(0), fs.Args()[1:]
	for _, a := range spec.args {
		if a == "--checkpoint_dir" || len(a) > 17 && a[:17] == "--checkpoint_dir=" {
			return bad(errors.New("the trainer's --checkpoint_dir is the soak's: drop it"))
		}
	}
	var err error
	if cfg.gap, err = parseSpan("gap", *gap); err != nil {
		return bad(err)
	}
	if cfg.stopFor, err = parseSpan("stop_for", *stopFor); err != nil {
		return bad(err)
	}
	if cfg.linkDown, err = parseSpan("link_down", *linkDown); err != nil {
		return bad(err)
	}
	if cfg.kinds, err = parseFaults(*faults); err != nil {
		return bad(err)
	}
	switch {
	case *nproc < 2:
		return bad(fmt.Errorf("--nproc %d: want at least 2", *nproc))
	case cfg.duration <= 0 || cfg.recoverTimeout <= 0 || cfg.sampleEvery <= 0:
		return bad(fmt.Errorf("--duration %v, --recover_timeout %v, --sample_every %v: want positive durations", cfg.duration, cfg.recoverTimeout, cfg.sampleEvery))
	case spec.maxRestarts < 1:
		return bad(fmt.Errorf("--max_restarts %d: want at least 1 (the job restarts after a kill)", spec.maxRestarts))
	case *timeout < 0:
		return bad(fmt.Errorf("--collective_timeout %v: want 0 or more", *timeout))
	}
	for _, p := range []*string{&spec.ddprun, &spec.trainer} {
		if *p, err = exec.LookPath(*p); err != nil {
			return bad(err)
		}
		if *p, err = filepath.Abs(*p); err != nil {
			return bad(err)
		}
	}
	if *timeout > 0 {
		spec.env = append(spec.env, "GODDP_COLLECTIVE_TIMEOUT="+timeout.String())
	}
	if cfg.seed == 0 {
		cfg.seed = rand.Uint64()
	}

	c := &cluster{nproc: *nproc}
	switch *tbMode {
	case "on", "auto":
		tb, err := testbed.New(testbed.Options{Hosts: 2})
		switch {
		case err == nil:
			defer tb.Close()
			c.tb, c.token = tb, newToken()
		case *tbMode == "on":
			fmt.Fprintln(stderr, "fault-soak:", err)
			return 1
		default:
			fmt.Fprintf(stderr, "fault-soak: no testbed (%v): the job runs on this host, without the link fault\n", err)
		}
	case "off":
	default:
		return bad(fmt.Errorf("--testbed %q: want on, off or auto", *tbMode))
	}
	if c.tb != nil && c.nproc%c.tb.Hosts() != 0 {
		return bad(fmt.Errorf("--nproc %d: want a multiple of the testbed's %d hosts", c.nproc, c.tb.Hosts()))
	}
	if c.tb == nil {
		if slices.Contains(cfg.kinds, faultLink) {
			cfg.kinds = slices.DeleteFunc(cfg.kinds, func(k string) bool { return k == faultLink })
		}
		if len(cfg.kinds) == 0 {
			return bad(errors.New("--faults: only link faults, and no testbed to make them on"))
		}
	}

	if cfg.out, err = mkOut(cfg.out); err != nil {
		fmt.Fprintln(stderr, "fault-soak:", err)
		return 1
	}
	logFile, err := os.Create(filepath.Join(cfg.out, "job.log"))
	if err != nil {
		fmt.Fprintln(stderr, "fault-soak:", err)
		return 1
	}
	defer logFile.Close()
	rng := rand.New(rand.NewPCG(cfg.seed, 0x50a4))
	s := &soak{cfg: cfg, c: c, spec: spec, rng: rng, sched: schedule{rng: rng, kinds: cfg.kinds}, log: logFile, events: stdout}
	fmt.Fprintf(stdout, "fault-soak: %s, seed %d, output in %s\n", c, cfg.seed, cfg.out)

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	stopSigs := make(chan struct{})
	defer close(stopSigs)
	go func() {
		select {
		case sig := <-sigs:
			s.fail(fmt.Errorf("interrupted (%v)", sig))
		case <-stopSigs:
		}
	}()

	err = s.run()
	if err == nil {
		err = s.failed()
	}
	fmt.Fprintln(stdout)
	s.report(stdout, err)
	if f, ferr := os.Create(filepath.Join(cfg.out, "report.md")); ferr == nil {
		s.report(f, err)
		f.Close()
	}
	if err != nil {
		fmt.Fprintln(stderr, "fault-soak:", err, "(see "+filepath.Join(cfg.out, "job.log")+")")
		return 1
	}
	return 0
}
