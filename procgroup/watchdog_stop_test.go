//go:build linux

package procgroup_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/goddp/goddp/procgroup"
)

// The frozen rank of TestWatchdogStoppedRank runs in a child process (this test binary,
// running TestWatchdogStoppedRankChild), configured by these variables.
const (
	stopEnvStore = "GODDP_WDTEST_STORE" // the store server's address; set only in the child
	stopEnvN     = "GODDP_WDTEST_N"     // how many all-reduces the child completes
)

const (
	stopToken  = "wd-stop-token"
	stopPrefix = "wdstop"
	stopCount  = 4096 // elements per all-reduce
	stopSeed   = 11
	// The child's watchdog interval. Before the fix the child published its progress only
	// once per interval, so, frozen well within its first interval, it had published
	// nothing since the group began ("it last completed #0").
	stopChildInterval = 3 * time.Second
	// How long the child stays alive, issuing nothing, between its last all-reduce and its
	// SIGSTOP: more than the bound on how long its watchdog may take to publish a change
	// (Interval/10, see Note [Stall report]) plus a store round trip.
	stopChildQuiet = time.Second
)

// TestWatchdogStoppedRank freezes a rank with SIGSTOP after a known collective, as a user
// would with kill -STOP: rank 1, a child process, completes all-reduces #1..#N with rank 0
// (this process) and stops itself; rank 0 issues #N+1. Rank 0's stall warning and its
// timeout must name rank 1 and the sequence number rank 1 really completed, #N: what a
// frozen rank can say is what it published before it froze, so it must have published it
// promptly.
func TestWatchdogStoppedRank(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a child process and waits for a timeout")
	}
	const n = 25 // all-reduces before the freeze
	srv, err := procgroup.StartStoreServer(procgroup.StoreServerOptions{Addr: "127.0.0.1:0", Token: stopToken})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	cmd := exec.Command(os.Args[0], "-test.run=^TestWatchdogStoppedRankChild$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), stopEnvStore+"="+srv.Addr(), stopEnvN+"="+strconv.Itoa(n))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 100)
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		defer close(lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default: // the test reads only the first lines
			}
		}
	}()
	var childLog []string
	defer func() {
		cmd.Process.Kill() // SIGKILL also ends a stopped process
		io.Copy(io.Discard, out)
		<-readDone
		cmd.Wait()
		for l := range lines {
			childLog = append(childLog, l)
		}
		if t.Failed() {
			t.Logf("child output:\n%s", strings.Join(childLog, "\n"))
		}
	}()

	ctx := testCtx(t)
	store, err := procgroup.DialStore(ctx, srv.Addr(), stopToken, procgroup.DialOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	inner, err := procgroup.New(ctx, "gloo", procgroup.Options{
		Rank: 0, Size: 2, Store: store, Prefix: stopPrefix, Token: stopToken,
	})
	if err != nil {
		t.Fatalf("gloo group: %v", err)
	}
	core, logs := observer.New(zap.WarnLevel)
	const warn, timeout = 300 * time.Millisecond, 3 * time.Second
	pg := mustWatchdog(t, inner, procgroup.PrefixStore{Prefix: "watchdog", Store: store}, procgroup.WatchdogOptions{
		Timeout: timeout, WarnAfter: warn, Interval: 20 * time.Millisecond,
		Host: "host-0", Logger: zap.New(core), LookupEnv: noEnv,
	})
	defer pg.Close()

	ins, sum := randomInputs(stopSeed, 2, stopCount)
	for i := 1; i <= n; i++ {
		buf := append([]float64(nil), ins[0]...)
		if err := pg.AllReduce(ctx, buf, procgroup.Sum).Wait(ctx); err != nil {
			t.Fatalf("allreduce #%d: %v", i, err)
		}
		if err := checkSum(buf, sum); err != nil {
			t.Fatalf("allreduce #%d: %v", i, err)
		}
	}
	// The child says when it has checked its results and when it is about to stop.
	for _, want := range []string{"checked", "stopping"} {
		select {
		case l, ok := <-lines:
			for ok && !strings.HasPrefix(l, "child: ") {
				childLog = append(childLog, l)
				l, ok = <-lines
			}
			if !ok {
				t.Fatalf("child exited before saying %q", want)
			}
			childLog = append(childLog, l)
			if l != "child: "+want {
				t.Fatalf("child said %q, want %q", l, "child: "+want)
			}
		case <-ctx.Done():
			t.Fatalf("child never said %q", want)
		}
	}
	errNext := pg.AllReduce(ctx, make([]float64, stopCount), procgroup.Sum).Wait(ctx)
	if st := procState(cmd.Process.Pid); st != "T" {
		t.Fatalf("child is in state %q, want T (stopped): the test did not freeze it", st)
	}

	missing := fmt.Sprintf("rank 1 (host-1) has not joined allreduce #%d; it last completed #%d", n+1, n)
	warned := logs.FilterMessageSnippet("has not joined").All()
	if len(warned) != 1 || !strings.HasPrefix(warned[0].Message, missing+" after ") {
		t.Errorf("stall warnings %v, want one that starts %q", messages(warned), missing)
	} else {
		t.Logf("warning: %s", warned[0].Message)
	}
	want := fmt.Sprintf("allreduce #%d timed out after %v: %s", n+1, timeout, missing)
	var cte *procgroup.CollectiveTimeoutError
	if !errors.As(errNext, &cte) || !strings.Contains(errNext.Error(), want) {
		t.Errorf("allreduce #%d: err = %v, want a *CollectiveTimeoutError with %q", n+1, errNext, want)
	} else {
		t.Logf("error: %v", errNext)
		if len(cte.Missing) != 1 || cte.Missing[0].Rank != 1 || cte.Missing[0].Completed != n || cte.Missing[0].Issued != n {
			t.Errorf("Missing = %+v, want rank 1 with Issued = Completed = %d", cte.Missing, n)
		}
	}
}

func messages(es []observer.LoggedEntry) []string {
	m := make([]string, len(es))
	for i, e := range es {
		m[i] = e.Message
	}
	return m
}

// procState is the state letter of process pid (/proc/PID/stat), or "" if unreadable.
func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	// pid (comm) state ...; comm may hold spaces and parentheses.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+3 > len(s) {
		return ""
	}
	return s[i+2 : i+3]
}

// TestWatchdogStoppedRankChild is rank 1 of TestWatchdogStoppedRank; it runs only in the
// child process that test starts.
func TestWatchdogStoppedRankChild(t *testing.T) {
	addr := os.Getenv(stopEnvStore)
	if addr == "" {
		t.Skip("the child of TestWatchdogStoppedRank")
	}
	n, err := strconv.Atoi(os.Getenv(stopEnvN))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store, err := procgroup.DialStore(ctx, addr, stopToken, procgroup.DialOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	inner, err := procgroup.New(ctx, "gloo", procgroup.Options{
		Rank: 1, Size: 2, Store: store, Prefix: stopPrefix, Token: stopToken,
	})
	if err != nil {
		t.Fatalf("gloo group: %v", err)
	}
	pg := mustWatchdog(t, inner, procgroup.PrefixStore{Prefix: "watchdog", Store: store}, procgroup.WatchdogOptions{
		Timeout: time.Minute, Interval: stopChildInterval, Host: "host-1", LookupEnv: noEnv,
	})
	defer pg.Close()
	ins, sum := randomInputs(stopSeed, 2, stopCount)
	for i := 1; i <= n; i++ {
		buf := append([]float64(nil), ins[1]...)
		if err := pg.AllReduce(ctx, buf, procgroup.Sum).Wait(ctx); err != nil {
			t.Fatalf("allreduce #%d: %v", i, err)
		}
		if err := checkSum(buf, sum); err != nil {
			t.Fatalf("allreduce #%d: %v", i, err)
		}
	}
	fmt.Println("child: checked")
	time.Sleep(stopChildQuiet) // alive, issuing nothing: a trainer between two steps
	fmt.Println("child: stopping")
	os.Stdout.Sync()
	if err := syscall.Kill(os.Getpid(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	select {} // the parent kills this process
}
