// Package spawn starts a job's ranks as local processes, for the commands that can run a
// whole job on one machine by themselves (allreduce-perf --nproc, collective-soak --nproc).
//
// # Usage
//
//	if os.Getenv(childEnv) == "" && nproc > 0 {
//		os.Exit(spawn.Local(ctx, spawn.Options{Name: "tool", N: nproc, Args: os.Args[1:],
//			ChildEnv: childEnv, Logger: log, Stdout: os.Stdout, Stderr: os.Stderr}))
//	}
package spawn

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

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/goddp/goddp/procgroup"
)

// rankVars are the variables Local sets for each rank; inherited values are dropped.
var rankVars = []string{
	"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
	"MASTER_PORT", "GODDP_STORE_ADDR", "GODDP_TOKEN", "GODDP_TOKEN_FILE",
}

// Options describe the local ranks to start.
type Options struct {
	Name     string   // the command's name, for messages
	N        int      // how many ranks
	Args     []string // the ranks' arguments (the program is this executable)
	ChildEnv string   // set to 1 in each rank's environment, so it knows it is one
	Logger   *zap.Logger
	Stdout   io.Writer
	Stderr   io.Writer
}

// Local hosts a store on 127.0.0.1 and runs o.N copies of this program (with o.Args) as
// ranks 0..N-1, with torchrun variables, the store's address and a fresh token in their
// environment, and their output going straight to o.Stdout and o.Stderr. The first rank to
// fail, or ctx ending, makes it kill the others. It returns 0 if every rank succeeded, else
// the first failed rank's exit status (at least 1).
func Local(ctx context.Context, o Options) int {
	n, args, stdout, stderr := o.N, o.Args, o.Stdout, o.Stderr
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, o.Name+": "+format+"\n", a...)
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
		Addr: "127.0.0.1:0", Token: token, Logger: o.Logger,
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
		if !slices.Contains(rankVars, name) && name != o.ChildEnv {
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
			"GODDP_STORE_ADDR="+srv.Addr(), "GODDP_TOKEN="+token, o.ChildEnv+"=1")
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
			fmt.Fprintf(stderr, o.Name+": rank %d failed (%v); stopping the other ranks\n", e.rank, e.err)
			killed = true
			killAll(cmds)
		case <-ctx.Done():
			if !killed {
				fmt.Fprintf(stderr, o.Name+": %v; stopping the ranks\n", context.Cause(ctx))
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

// Logger is the console logger of a command that runs its own ranks: warnings and errors
// to w, each line tagged with rank (-1 for the launching process).
func Logger(w io.Writer, rank int) *zap.Logger {
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig()), zapcore.AddSync(w), zapcore.WarnLevel)
	return zap.New(core).With(zap.Int("rank", rank))
}
