package gloo

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/goddp/goddp/procgroup"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var prefixN atomic.Int64

// startGroups creates size ranks as goroutines of this process, connected through a
// MemStore over real sockets; they are closed at the end of the test.
func startGroups(t testing.TB, size int, cfg *Config) []procgroup.ProcessGroup {
	t.Helper()
	groups := startGroupsNoCleanup(t, size, cfg)
	t.Cleanup(func() {
		for _, g := range groups {
			g.Close()
		}
	})
	return groups
}

// startGroupsNoCleanup is startGroups for callers that close the groups themselves.
func startGroupsNoCleanup(t testing.TB, size int, cfg *Config) []procgroup.ProcessGroup {
	t.Helper()
	return startGroupsWith(t, size, cfg, nil, 0)
}

func startGroupsLogged(t testing.TB, size int, cfg *Config, log *zap.Logger) []procgroup.ProcessGroup {
	t.Helper()
	groups := startGroupsWith(t, size, cfg, log, 0)
	t.Cleanup(func() {
		for _, g := range groups {
			g.Close()
		}
	})
	return groups
}

func startGroupsTimeout(t testing.TB, size int, cfg *Config, timeout time.Duration) []procgroup.ProcessGroup {
	t.Helper()
	groups := startGroupsWith(t, size, cfg, nil, timeout)
	t.Cleanup(func() {
		for _, g := range groups {
			g.Abort(nil)
		}
	})
	return groups
}

func startGroupsWith(t testing.TB, size int, cfg *Config, log *zap.Logger, timeout time.Duration) []procgroup.ProcessGroup {
	t.Helper()
	return startGroupsCfg(t, size, func(int) *Config { return cfg }, log, timeout)
}

// startGroupsHosts starts one group whose rank r claims to run on host hosts[r]
// (Config.HostID): ranks of one host use Unix sockets and shared memory, the others TCP.
func startGroupsHosts(t testing.TB, hosts []string, cfg Config) []procgroup.ProcessGroup {
	t.Helper()
	groups := startGroupsCfg(t, len(hosts), func(r int) *Config {
		c := cfg
		c.HostID = hosts[r]
		return &c
	}, nil, 0)
	t.Cleanup(func() {
		for _, g := range groups {
			g.Close()
		}
	})
	return groups
}

// startGroupsCfg starts size ranks of one group, rank r with a copy of cfgOf(r).
func startGroupsCfg(t testing.TB, size int, cfgOf func(r int) *Config, log *zap.Logger, timeout time.Duration) []procgroup.ProcessGroup {
	t.Helper()
	store := procgroup.NewMemStore()
	prefix := fmt.Sprintf("t%d", prefixN.Add(1))
	groups := make([]procgroup.ProcessGroup, size)
	errs := make([]error, size)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for r := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var c *Config
			if cfg := cfgOf(r); cfg != nil {
				cc := *cfg
				c = &cc
			}
			groups[r], errs[r] = procgroup.New(ctx, "gloo", procgroup.Options{
				Rank: r, Size: size, Store: store, Prefix: prefix, Token: "secret", Backend: c,
				Logger: log, Timeout: timeout,
			})
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			for _, g := range groups {
				if g != nil {
					g.Abort(nil)
				}
			}
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	t.Cleanup(func() { store.Close() })
	return groups
}

// each runs f on every rank concurrently and fails the test on any error.
func each(t testing.TB, groups []procgroup.ProcessGroup, f func(r int, g procgroup.ProcessGroup) error) {
	t.Helper()
	errs := make([]error, len(groups))
	var wg sync.WaitGroup
	for r, g := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = f(r, g)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
}

func wait(w procgroup.Work) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return w.Wait(ctx)
}

// cmaEverySize lowers Note [Single copy]'s thresholds to one byte until t's end, so that
// a forced algorithm (ring) takes it at every size; call it before starting the groups.
func cmaEverySize(t testing.TB) {
	saved := cmaMinBytes
	for k := range cmaMinBytes {
		cmaMinBytes[k] = 1
	}
	t.Cleanup(func() { cmaMinBytes = saved })
}

// vmOffAt is Config.VMReadv for rank r: off at rank off, the default elsewhere.
func vmOffAt(r, off int) string {
	if r == off {
		return VMReadvOff
	}
	return ""
}

// adoptEverySize makes Note [Adopted buffers] adopt every buffer with a whole page, at
// its first collective, until t's end; call it before starting the groups.
func adoptEverySize(t testing.TB) {
	savedMin, savedFirst := adoptMinBytes, adoptFirst
	adoptMinBytes, adoptFirst = 1, true
	t.Cleanup(func() { adoptMinBytes, adoptFirst = savedMin, savedFirst })
}
