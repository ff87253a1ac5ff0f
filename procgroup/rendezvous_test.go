package procgroup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// rendezvousAll runs Rendezvous for every rank of a world of n, concurrently, on
// 127.0.0.1:port.
func rendezvousAll(t *testing.T, n int, token string, logger *zap.Logger) ([]Store, []io.Closer) {
	t.Helper()
	return meetAll(t, n, freePort(t), token, func(ctx context.Context, env Env) (Store, io.Closer, error) {
		return Rendezvous(ctx, env, logger)
	})
}

// meetAll runs join for every rank of a world of n, concurrently, with rank 0's store on
// 127.0.0.1:port, and fails the test if any rank fails.
func meetAll(t *testing.T, n, port int, token string, join func(context.Context, Env) (Store, io.Closer, error)) ([]Store, []io.Closer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	stores := make([]Store, n)
	closers := make([]io.Closer, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			env := Env{Rank: r, WorldSize: n, LocalRank: r, LocalWorldSize: n,
				MasterAddr: "127.0.0.1", MasterPort: port, Token: token, Source: "torchrun"}
			stores[r], closers[r], errs[r] = join(ctx, env)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return stores, closers
}

func TestRendezvousRankZeroHostsStore(t *testing.T) {
	const n = 3
	stores, closers := rendezvousAll(t, n, testToken, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// Every rank publishes its address and reads every other one.
	for r, st := range stores {
		if err := st.Set(ctx, fmt.Sprintf("addr/%d", r), []byte(fmt.Sprintf("host-%d", r))); err != nil {
			t.Fatal(err)
		}
	}
	for r, st := range stores {
		for p := range n {
			v, err := st.Get(ctx, fmt.Sprintf("addr/%d", p))
			if err != nil || string(v) != fmt.Sprintf("host-%d", p) {
				t.Fatalf("rank %d reads addr/%d = %q, %v", r, p, v, err)
			}
		}
	}

	// Rank 0 closes first: its closer must keep the server up until ranks 1 and 2 have
	// released it, so they can still use the store meanwhile.
	closed0 := make(chan error, 1)
	go func() { closed0 <- closers[0].Close() }()
	for r := 1; r < n; r++ {
		if n, err := stores[r].Add(ctx, "after-rank0-close", 1); err != nil || n != int64(r) {
			t.Fatalf("rank %d: Add after rank 0 began closing = %d, %v", r, n, err)
		}
	}
	select {
	case err := <-closed0:
		t.Fatalf("rank 0's closer returned (%v) before the others released the store", err)
	default:
	}
	for r := 1; r < n; r++ {
		if err := closers[r].Close(); err != nil {
			t.Fatalf("rank %d: Close: %v", r, err)
		}
	}
	if err := <-closed0; err != nil {
		t.Fatalf("rank 0: Close: %v", err)
	}
	if err := closers[0].Close(); err != nil {
		t.Fatalf("rank 0: second Close: %v", err)
	}
	if err := stores[1].Set(ctx, "k", nil); !errors.Is(err, ErrStoreClosed) {
		t.Fatalf("Set after Close: %v; want ErrStoreClosed", err)
	}
}

// A rank that never releases the store delays rank 0's closer only by the timeout.
func TestRendezvousCloseTimeout(t *testing.T) {
	old := rendezvousCloseTimeout
	rendezvousCloseTimeout = 200 * time.Millisecond
	defer func() { rendezvousCloseTimeout = old }()

	core, logs := observer.New(zap.WarnLevel)
	stores, closers := rendezvousAll(t, 2, "", zap.New(core))
	_ = stores
	if err := closers[0].Close(); err != nil {
		t.Fatalf("rank 0: Close: %v", err)
	}
	if logs.FilterMessage("rendezvous: stopping the store before every rank released it").Len() != 1 {
		t.Errorf("no warning about the rank that did not release the store; logs: %v", logs.All())
	}
	// Both ranks used the development token, and warned about it.
	if n := logs.FilterMessageSnippet("development token").Len(); n != 2 {
		t.Errorf("%d development-token warnings, want 2", n)
	}
	// Rank 1's closer still returns (the server is gone: its release fails).
	if err := closers[1].Close(); err == nil {
		t.Error("rank 1: Close after the server stopped reported no error")
	}
}

func TestRendezvousLauncherStore(t *testing.T) {
	s := startServer(t, StoreServerOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	env := Env{Rank: 1, WorldSize: 2, LocalWorldSize: 2, LocalRank: 1, StoreAddr: s.Addr(), Token: testToken, Source: "torchrun"}
	st, closer, err := Rendezvous(ctx, env, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := st.Add(ctx, "x", 3); err != nil || n != 3 {
		t.Fatalf("Add = %d, %v", n, err)
	}
	if err := closer.Close(); err != nil {
		t.Fatal(err)
	}
	// The launcher's store is untouched by the rank's closer.
	other := dial(t, s.Addr(), testToken)
	if v, err := other.Get(ctx, "x"); err != nil || string(v) != "3" {
		t.Fatalf("launcher store after rank's Close: %q, %v", v, err)
	}

	env.Token = "wrong"
	if _, _, err := Rendezvous(ctx, env, nil); err == nil {
		t.Fatal("Rendezvous with a wrong token succeeded")
	}
}

func TestRendezvousBadEnv(t *testing.T) {
	ctx := context.Background()
	for _, env := range []Env{
		{Rank: 0, WorldSize: 1},
		{Rank: 0, WorldSize: 1, MasterAddr: "127.0.0.1", MasterPort: 0},
	} {
		if _, _, err := Rendezvous(ctx, env, nil); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("Rendezvous(%+v): %v; want ErrInvalidArgument", env, err)
		}
	}
	// A store host that does not resolve fails after resolveGrace, naming it, not at the
	// set-up bound.
	defer func(g time.Duration) { resolveGrace = g }(resolveGrace)
	resolveGrace = 2 * time.Second
	start := time.Now()
	_, _, err := Rendezvous(ctx, Env{Rank: 1, WorldSize: 2, LocalWorldSize: 1, MasterAddr: "no-such-host.invalid", MasterPort: 29500, Token: "t0123456789abcdef"}, nil)
	if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), `"no-such-host.invalid" does not resolve`) || time.Since(start) > 10*time.Second {
		t.Errorf("Rendezvous with an unresolvable MASTER_ADDR: %v after %v; want within seconds an error naming it", err, time.Since(start))
	}
	// The port is taken: rank 0 cannot host the store.
	s := startServer(t, StoreServerOptions{})
	port := s.lis.Addr().(*net.TCPAddr).Port
	env := Env{Rank: 0, WorldSize: 1, LocalWorldSize: 1, MasterAddr: "127.0.0.1", MasterPort: port}
	if _, _, err := Rendezvous(ctx, env, nil); err == nil {
		t.Error("Rendezvous on a taken port succeeded")
	}
}

// Under torchrun's static rendezvous every rank uses the agent's TCPStore (here the real
// torch one where installed, and fakes of both dialects), under a prefix per restart, and
// the log says that it has no authentication.
func TestRendezvousAgentStore(t *testing.T) {
	for _, srv := range tcpStoreServers(t) {
		t.Run(srv.name, func(t *testing.T) {
			host, port, _ := net.SplitHostPort(srv.addr)
			agentEnv := func(rank, restart int) Env {
				m := map[string]string{
					"RANK": fmt.Sprint(rank), "LOCAL_RANK": fmt.Sprint(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
					"GROUP_RANK": "0", "MASTER_ADDR": host, "MASTER_PORT": port,
					"TORCHELASTIC_RESTART_COUNT": fmt.Sprint(restart), "TORCHELASTIC_RUN_ID": "job7",
					"TORCHELASTIC_USE_AGENT_STORE": "True", "GODDP_TOKEN": testToken,
				}
				e, err := EnvFrom(lookupIn(m))
				if err != nil {
					t.Fatal(err)
				}
				return e
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			core, logs := observer.New(zap.WarnLevel)
			var stores [2]Store
			for r := range 2 {
				st, closer, err := Rendezvous(ctx, agentEnv(r, 1), zap.New(core))
				if err != nil {
					t.Fatal(err)
				}
				defer closer.Close()
				stores[r] = st
			}
			if err := stores[0].Set(ctx, "addr/0", []byte("127.0.0.1:1234")); err != nil {
				t.Fatal(err)
			}
			if v, err := stores[1].Get(ctx, "addr/0"); err != nil || string(v) != "127.0.0.1:1234" {
				t.Fatalf("rank 1 reads %q, %v", v, err)
			}
			raw := dialTCP(t, srv.addr)
			if ok, err := raw.Check(ctx, "goddp/job7/1/addr/0"); err != nil || !ok {
				t.Fatalf("key under the restart's prefix: %v, %v", ok, err)
			}
			if srv.torch != nil {
				if got := srv.torch.call(t, "get goddp/job7/1/addr/0"); got != fmt.Sprintf("%x", "127.0.0.1:1234") {
					t.Fatalf("torch's client reads %s", got)
				}
			}
			// The next restart sees none of this attempt's keys.
			next, closer, err := Rendezvous(ctx, agentEnv(1, 2), nil)
			if err != nil {
				t.Fatal(err)
			}
			defer closer.Close()
			if v, _, err := next.CompareAndSet(ctx, "addr/0", peekSentinel, peekSentinel); err != nil || v != nil {
				t.Fatalf("restart 2 sees addr/0 = %q, %v; want absent", v, err)
			}
			if n := logs.FilterMessageSnippet("no authentication").Len(); n != 2 {
				t.Fatalf("%d warnings about the TCPStore's missing authentication, want one per rank: %v", n, logs.All())
			}
		})
	}
}

// With no launcher variables at all, the process is a world of one with an in-process
// store, and says so once.
func TestRendezvousSingleProcess(t *testing.T) {
	env, err := EnvFrom(lookupIn(map[string]string{"PATH": "/usr/bin"}))
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	ctx := context.Background()
	st, closer, err := Rendezvous(ctx, env, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	if n, err := st.Add(ctx, "n", 2); err != nil || n != 2 {
		t.Fatalf("Add = %d, %v", n, err)
	}
	if err := closer.Close(); err != nil {
		t.Fatal(err)
	}
	if n := logs.FilterMessageSnippet("single process").Len(); n != 1 || logs.Len() != 1 {
		t.Fatalf("log = %v; want one line about the single process", logs.All())
	}
}
