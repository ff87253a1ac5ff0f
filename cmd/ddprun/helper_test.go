package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// The test binary doubles as the programs the tests launch, chosen by DDPRUN_TEST_ROLE:
// "rank" runs helperMain (a rank with behaviour picked by its arguments), "ddprun" runs
// ddprun itself (for the tests that need a separate ddprun process to signal or kill).
const roleEnv = "DDPRUN_TEST_ROLE"

// helperEnv lists the variables the "env" helper prints.
var helperEnv = []string{
	"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
	"ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "GODDP_STORE_ADDR",
	"GODDP_TOKEN_FILE", "GODDP_RUN_ID", "GODDP_TOKEN", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE", "GOMAXPROCS",
}

// helperMain is a rank. Its first argument picks what it does:
//
//	env                print helperEnv, the token file's mode, then meet all ranks in the store
//	lines N            print N numbered lines (some long) to stdout, some to stderr
//	fail R CODE        rank R exits CODE once every other rank is up; the others block
//	fail-noterm R CODE as fail, but the blocking ranks ignore SIGTERM
//	selfkill R         rank R kills itself with SIGKILL once every other rank is up
//	flaky R            rank R exits 5 on attempt 0; every rank prints "ok" otherwise
//	block              print its pid, report ready, block until killed
//	grandchild         start a blocking child (its pid on stdout), then exit 0
//	orphan             a grandchild: print its pid and block
func helperMain(args []string) int {
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, "helper: no mode")
		return 2
	}
	rank, _ := strconv.Atoi(os.Getenv("RANK"))
	world, _ := strconv.Atoi(os.Getenv("WORLD_SIZE"))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fmt.Printf("pid=%d\n", os.Getpid())
	switch args[0] {
	case "env":
		for _, k := range helperEnv {
			v, ok := os.LookupEnv(k)
			fmt.Printf("%s=%s set=%v\n", k, v, ok)
		}
		fi, err := os.Stat(os.Getenv("GODDP_TOKEN_FILE"))
		if err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		fmt.Printf("TOKEN_FILE_MODE=%o\n", fi.Mode().Perm())
		st, err := dialStore(ctx)
		if err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		defer st.Close()
		n, err := st.Add(ctx, key("arrived"), 1)
		if err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		if err := st.Set(ctx, key("rank/"+strconv.Itoa(rank)), []byte(strconv.Itoa(n2i(n)))); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		var keys []string
		for r := range world {
			keys = append(keys, key("rank/"+strconv.Itoa(r)))
		}
		if err := st.Wait(ctx, keys...); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		fmt.Println("STORE_OK")
		return 0
	case "lines":
		n, _ := strconv.Atoi(args[1])
		for i := range n {
			fmt.Printf("out %d %d %s\n", rank, i, strings.Repeat("x", (i%5)*3000))
			if i%10 == 0 {
				fmt.Fprintf(os.Stderr, "err %d %d\n", rank, i)
			}
		}
		fmt.Printf("long %d %s\n", rank, strings.Repeat("y", 200000))
		fmt.Printf("last %d", rank) // no newline
		return 0
	case "fail", "fail-noterm", "selfkill":
		r, _ := strconv.Atoi(args[1])
		if args[0] == "fail-noterm" && rank != r {
			signal.Ignore(syscall.SIGTERM)
		}
		st, err := dialStore(ctx)
		if err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		if err := st.Set(ctx, key("ready/"+strconv.Itoa(rank)), nil); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		if rank != r {
			select {} // until stopped
		}
		var keys []string
		for q := range world {
			keys = append(keys, key("ready/"+strconv.Itoa(q)))
		}
		if err := st.Wait(ctx, keys...); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		for i := range 15 {
			fmt.Printf("step %d\n", i)
		}
		fmt.Fprintln(os.Stderr, "fatal: boom")
		if args[0] == "selfkill" {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}
		code, _ := strconv.Atoi(args[2])
		return code
	case "flaky":
		r, _ := strconv.Atoi(args[1])
		if rank == r && os.Getenv("TORCHELASTIC_RESTART_COUNT") == "0" {
			fmt.Fprintln(os.Stderr, "flaky: failing on the first attempt")
			return 5
		}
		fmt.Printf("ok run=%s\n", os.Getenv("GODDP_RUN_ID"))
		return 0
	case "block":
		fmt.Println("ready")
		select {}
	case "grandchild":
		self, _ := os.Executable()
		cmd := exec.Command(self, "orphan")
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err == nil {
			err = cmd.Start()
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		// Relay the grandchild's own pid line before exiting: once this rank exits, ddprun
		// stops its process group, and a grandchild still starting up would print nothing.
		line, err := bufio.NewReader(out).ReadString('\n')
		if err != nil {
			fmt.Fprintln(os.Stderr, "helper: grandchild:", err)
			return 1
		}
		fmt.Print(line)
		fmt.Printf("grandchild=%d\n", cmd.Process.Pid)
		return 0
	case "orphan":
		select {}
	}
	fmt.Fprintln(os.Stderr, "helper: unknown mode", args[0])
	return 2
}

func n2i(n int64) int { return int(n) }

// key prefixes k with the attempt's store namespace.
func key(k string) string { return os.Getenv("GODDP_RUN_ID") + "/" + k }

func dialStore(ctx context.Context) (procgroup.Store, error) {
	tok, err := os.ReadFile(os.Getenv("GODDP_TOKEN_FILE"))
	if err != nil {
		return nil, err
	}
	return procgroup.DialStore(ctx, os.Getenv("GODDP_STORE_ADDR"), string(tok), procgroup.DialOptions{})
}

// syncBuffer is an io.Writer safe for concurrent use whose contents a test can wait on.
type syncBuffer struct {
	mu      sync.Mutex // guards buf and changed
	buf     bytes.Buffer
	changed chan struct{} // closed (and replaced) on every write
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.changed != nil {
		close(b.changed)
		b.changed = nil
	}
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// waitCount waits until s occurs n times in b, failing the test after a minute.
func (b *syncBuffer) waitCount(t *testing.T, s string, n int) {
	t.Helper()
	deadline := time.NewTimer(time.Minute)
	defer deadline.Stop()
	for {
		b.mu.Lock()
		got := strings.Count(b.buf.String(), s)
		if b.changed == nil {
			b.changed = make(chan struct{})
		}
		ch := b.changed
		b.mu.Unlock()
		if got >= n {
			return
		}
		select {
		case <-ch:
		case <-deadline.C:
			t.Fatalf("waited a minute for %d× %q; have:\n%s", n, s, b.String())
		}
	}
}
