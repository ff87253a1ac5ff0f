package gloo

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// startGroupsErrs runs New on size ranks of one group, rank r with cfgOf(r), and returns
// each rank's groups and errors; the groups that came up are closed at the end of the test.
func startGroupsErrs(t *testing.T, size int, cfgOf func(r int) *Config) ([]procgroup.ProcessGroup, []error) {
	t.Helper()
	store := procgroup.NewMemStore()
	t.Cleanup(func() { store.Close() })
	prefix := fmt.Sprintf("t%d", prefixN.Add(1))
	groups, errs := make([]procgroup.ProcessGroup, size), make([]error, size)
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for r := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			groups[r], errs[r] = procgroup.New(c, "gloo", procgroup.Options{
				Rank: r, Size: size, Store: store, Prefix: prefix, Token: "secret", Backend: cfgOf(r)})
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, g := range groups {
			if g != nil {
				g.Close()
			}
		}
	})
	return groups, errs
}

// TestAgreeRefuses (issue 53): a setting that shapes the wire and differs between ranks
// (one host's piece size, segment size, direct limit or algorithm) is refused at New on
// every rank, at once, with procgroup.ErrInvalidArgument and an error that names the
// setting, the ranks and their values. Tune and SharedMemory may differ (reconciled).
func TestAgreeRefuses(t *testing.T) {
	hosts := []string{"a", "a", "b", "b"}
	for _, c := range []struct {
		name string
		set  func(c *Config)
		want []string
	}{
		{"piece", func(c *Config) { c.HierPieceSize = 64 << 10 },
			[]string{"GODDP_GLOO_HIER_PIECE", "ranks 0-1: 2097152", "ranks 2-3: 65536"}},
		{"segment", func(c *Config) { c.SegmentSize = 4096 },
			[]string{"SegmentSize", "ranks 0-1: 1048576", "ranks 2-3: 4096"}},
		{"direct", func(c *Config) { c.DirectMaxBytes = 1 << 20 },
			[]string{"DirectMaxBytes", "ranks 0-1: 65536", "ranks 2-3: 1048576"}},
		{"algorithm", func(c *Config) { c.Algorithm = AlgoRing },
			[]string{"GODDP_GLOO_ALGO", `ranks 0-1: "auto"`, `ranks 2-3: "ring"`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			_, errs := startGroupsErrs(t, len(hosts), func(r int) *Config {
				cfg := &Config{HostID: hosts[r], Tune: TuneOff}
				if hosts[r] == "b" {
					c.set(cfg)
				}
				return cfg
			})
			for r, err := range errs {
				if !errors.Is(err, procgroup.ErrInvalidArgument) {
					t.Errorf("rank %d: New: %v; want procgroup.ErrInvalidArgument", r, err)
					continue
				}
				for _, w := range c.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("rank %d: %v; want it to say %q", r, err, w)
					}
				}
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("refused after %v", d)
			}
		})
	}
	// Only the differing ranks are named: one rank's piece on a host of three.
	_, errs := startGroupsErrs(t, 6, func(r int) *Config {
		cfg := &Config{HostID: []string{"a", "a", "a", "b", "b", "b"}[r], Tune: TuneOff}
		if r == 4 {
			cfg.HierPieceSize = -1
		}
		return cfg
	})
	for r, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "ranks 0-3, 5: 2097152; rank 4: -1") {
			t.Errorf("rank %d: New: %v; want ranks 0-3, 5 and rank 4 named with their pieces", r, err)
		}
	}
}

func TestRankList(t *testing.T) {
	for _, c := range []struct {
		rs   []int
		want string
	}{
		{[]int{3}, "rank 3"},
		{[]int{0, 1}, "ranks 0-1"},
		{[]int{0, 2, 3, 4, 7, 9, 10}, "ranks 0, 2-4, 7, 9-10"},
	} {
		if got := rankList(c.rs); got != c.want {
			t.Errorf("rankList(%v) = %q, want %q", c.rs, got, c.want)
		}
	}
}
