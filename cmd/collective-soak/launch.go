package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"

	"github.com/goddp/goddp/procgroup"
)

// rankVars are the variables launch sets for each rank; inherited values are dropped.
var rankVars = []string{
	"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
	"MASTER_PORT", "GODDP_STORE_ADDR", "GODDP_TOKEN", "GODDP_TOKEN_FILE", childEnv,
}

// launch hosts a store on 127.0.0.1 and runs n copies of this program (with the same
// arguments) as ranks 0..n-1, with torchrun variables, the store's address and a fresh
// token in their environment, and their output going straight to ours. The first rank to
// fail, or ctx ending, makes it kill the others. It returns 0 if every rank succeeded, else
// the first failed rank's exit status (at least 1). This is cmd/allreduce-perf's launcher,
// trimmed.
func launch(ctx context.Context, n int, args []string, stdout, stderr io.Writer) int {
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "collective-soak: "+format+"\n", a...)
		return 1
	}
	exe, err := os.Executable()
	if err != nil {
		return fail("cannot re-execute myself: %v", err)
	}
	var secret [16]byte
	if _, err := rand.Read(secret[:]); err != nil {
		return fail("token: %v", err)
	}
	token := hex.EncodeToString(secret[:])
	srv, err := procgroup.StartStoreServer(procgroup.StoreServerOptions{
		Addr: "127.0.0.1:0", Token: token, Logger: newLogger(stderr, -1),
	})
	if err != nil {
		return fail("%v", err)
	}
	defer srv.Close()
	_, port, err := net.SplitHostPort(srv.Addr())
	if err != nil {
		return fail("store address %q: %v", srv.Addr(), err)
	}
	var base []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if !slices.Contains(rankVars, name) {
			base = append(base, kv)
		}
	}
	type exit struct {
		rank int
		err  error
	}
	exits := make(chan exit, n) // one slot per rank: the waiters never block
	cmds := make([]*exec.Cmd, 0, n)
	for r := range n {
		cmd := exec.Command(exe, args...)
		cmd.Env = append(slices.Clone(base),
			"RANK="+strconv.Itoa(r), "WORLD_SIZE="+strconv.Itoa(n),
			"LOCAL_RANK="+strconv.Itoa(r), "LOCAL_WORLD_SIZE="+strconv.Itoa(n), "GROUP_RANK=0",
			"MASTER_ADDR=127.0.0.1", "MASTER_PORT="+port,
			"GODDP_STORE_ADDR="+srv.Addr(), "GODDP_TOKEN="+token, childEnv+"=1")
		cmd.Stdout, cmd.Stderr = stdout, stderr
		setDeathSignal(cmd)
		if err := cmd.Start(); err != nil {
			killAll(cmds)
			for range cmds {
				<-exits
			}
			return fail("start rank %d: %v", r, err)
		}
		cmds = append(cmds, cmd)
		go func() { exits <- exit{r, cmd.Wait()} }()
	}
	status, killed := 0, false
	for remaining := n; remaining > 0; {
		select {
		case e := <-exits:
			remaining--
			if e.err == nil || killed {
				continue
			}
			status = 1
			var ee *exec.ExitError
			if errors.As(e.err, &ee) && ee.ExitCode() > 0 {
				status = ee.ExitCode()
			}
			fmt.Fprintf(stderr, "collective-soak: rank %d failed (%v); stopping the other ranks\n", e.rank, e.err)
			killed = true
			killAll(cmds)
		case <-ctx.Done():
			if !killed {
				fmt.Fprintf(stderr, "collective-soak: %v; stopping the ranks\n", context.Cause(ctx))
				killed, status = true, 1
				killAll(cmds)
			}
			ctx = context.Background() // never done: wait for the exits only
		}
	}
	return status
}

// killAll kills the rank processes (those already gone are ignored).
func killAll(cmds []*exec.Cmd) {
	for _, c := range cmds {
		c.Process.Kill()
	}
}
