//go:build linux

// Command testbed runs a command on every host of a cluster that it makes on this machine
// out of network namespaces (package internal/testbed), then removes the cluster: after the
// command ends, after a failure, and after Ctrl-C.
//
//	testbed [--hosts N] [--rate 1gbit] [--delay 1ms] -- COMMAND
//
// COMMAND is a shell command line, run by sh -c on each host at once, with TESTBED_HOST
// (the host's index), TESTBED_HOSTS, TESTBED_ADDR (its address) and TESTBED_MASTER (host
// 0's address) in its environment. Each output line is prefixed with "[hostN] ". For
// instance, a two-host job of the example trainer:
//
//	export GODDP_TOKEN=$(openssl rand -hex 32)
//	testbed --hosts 2 --rate 1gbit -- \
//	  'bin/ddprun --nnodes 2 --node_rank $TESTBED_HOST --nproc_per_node 1 --master_addr $TESTBED_MASTER --master_port 29500 bin/transformer'
//
// It needs root. The exit status is the first failing host's, or 0.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/goddp/goddp/internal/testbed"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("testbed", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var opts testbed.Options
	fs.IntVar(&opts.Hosts, "hosts", 2, "number of hosts")
	fs.StringVar(&opts.Rate, "rate", "", "shape every link to this rate, both ways (tc syntax: 1gbit, 10gbit, 25gbit); empty: unshaped")
	fs.StringVar(&opts.Delay, "delay", "", "add this one-way delay to every host's egress (tc syntax: 1ms); needs the kernel's sch_netem")
	fs.IntVar(&opts.Subnet, "subnet", 0, "third octet of the hosts' addresses 10.98.SUBNET.(host+1) (default: from the pid)")
	down := fs.Int("down", -1, "take this host's link down before the command starts (to try an unreachable host)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: testbed [flags] -- COMMAND   (COMMAND runs under sh -c on every host)")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return 2
	}
	command := strings.Join(fs.Args(), " ")
	if *down >= opts.Hosts {
		fmt.Fprintf(stderr, "testbed: --down %d: there are only %d hosts\n", *down, opts.Hosts)
		return 2
	}
	if opts.Delay != "" {
		if ok, why := testbed.NetemAvailable(); !ok {
			fmt.Fprintf(stderr, "testbed: --delay needs netem, which this kernel lacks: %s\n", why)
			return 1
		}
	}
	tb, err := testbed.New(opts)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	defer func() {
		if err := tb.Close(); err != nil {
			fmt.Fprintln(stderr, "testbed: teardown:", err)
		}
	}()
	describe(stderr, tb, opts)
	if *down >= 0 {
		if err := tb.SetLink(*down, false); err != nil {
			fmt.Fprintln(stderr, err)
			return 1
		}
		fmt.Fprintf(stderr, "testbed: host%d's link is down\n", *down)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	var outMu sync.Mutex
	codes := make([]int, tb.Hosts())
	var wg sync.WaitGroup
	for h := range tb.Hosts() {
		cmd := tb.Command(ctx, h, "sh", "-c", command)
		// Its own process group, so that Ctrl-C (or one host's end) reaches the shell's
		// children too, not only the shell.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
		cmd.WaitDelay = 10 * time.Second
		pr, pw := io.Pipe()
		cmd.Stdout, cmd.Stderr = pw, pw
		if err := cmd.Start(); err != nil {
			fmt.Fprintf(stderr, "testbed: host%d: %v\n", h, err)
			codes[h] = 1
			pw.Close()
			pr.Close()
			continue
		}
		wg.Add(2)
		go func() {
			defer wg.Done()
			sc := bufio.NewScanner(pr)
			sc.Buffer(make([]byte, 64<<10), 1<<20)
			for sc.Scan() {
				outMu.Lock()
				fmt.Fprintf(stdout, "[host%d] %s\n", h, sc.Text())
				outMu.Unlock()
			}
			io.Copy(io.Discard, pr)
		}()
		go func() {
			defer wg.Done()
			err := cmd.Wait()
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // anything it left behind
			pw.Close()
			var ee *exec.ExitError
			switch {
			case err == nil:
			case errors.As(err, &ee) && ee.ExitCode() > 0:
				codes[h] = ee.ExitCode()
			default:
				codes[h] = 1
				outMu.Lock()
				fmt.Fprintf(stderr, "testbed: host%d: %v\n", h, err)
				outMu.Unlock()
			}
		}()
	}
	wg.Wait()
	if ctx.Err() != nil {
		fmt.Fprintln(stderr, "testbed: interrupted; removing the hosts")
		return 130
	}
	for h, c := range codes {
		if c != 0 {
			fmt.Fprintf(stderr, "testbed: host%d exited with status %d\n", h, c)
			return c
		}
	}
	return 0
}

func describe(w io.Writer, tb *testbed.Testbed, opts testbed.Options) {
	rate := "unshaped"
	if opts.Rate != "" {
		rate = opts.Rate + " each way"
	}
	delay := "no delay"
	if opts.Delay != "" {
		delay = opts.Delay + " one-way delay (netem)"
	}
	var hosts []string
	for h := range tb.Hosts() {
		hosts = append(hosts, fmt.Sprintf("host%d=%s", h, tb.Addr(h)))
	}
	fmt.Fprintf(w, "testbed: %d hosts on one bridge (%s), links %s, %s\n", tb.Hosts(), strings.Join(hosts, " "), rate, delay)
}
