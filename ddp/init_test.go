package ddp

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// The "ddptest" backend hands out the ranks of testCluster after a round trip through the
// store, and records the options it was given.
var (
	testMu      sync.Mutex // guards the two below
	testCluster *pgtest.Cluster
	testOpts    = map[int]procgroup.Options{}
)

func init() {
	procgroup.Register("ddptest", func(ctx context.Context, o procgroup.Options) (procgroup.ProcessGroup, error) {
		st := procgroup.PrefixStore{Prefix: o.Prefix + "/ddptest", Store: o.Store}
		if err := st.Set(ctx, fmt.Sprintf("rank%d", o.Rank), []byte(o.Token)); err != nil {
			return nil, err
		}
		for r := 0; r < o.Size; r++ { // every rank reached this store, with the same token
			v, err := st.Get(ctx, fmt.Sprintf("rank%d", r))
			if err != nil {
				return nil, err
			}
			if string(v) != o.Token {
				return nil, fmt.Errorf("rank %d has token %q, rank %d %q", r, v, o.Rank, o.Token)
			}
		}
		testMu.Lock()
		defer testMu.Unlock()
		testOpts[o.Rank] = o
		return testCluster.Group(o.Rank), nil
	})
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func TestInitProcessGroup(t *testing.T) {
	const size = 2
	testCluster = pgtest.NewCluster(size)
	defer testCluster.Close()
	port := strconv.Itoa(freePort(t))
	var wg sync.WaitGroup
	errs := make([]error, size)
	sums := make([][]float32, size)
	for rank := 0; rank < size; rank++ {
		env := map[string]string{
			"RANK": strconv.Itoa(rank), "WORLD_SIZE": "2", "LOCAL_RANK": strconv.Itoa(rank), "LOCAL_WORLD_SIZE": "2",
			"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GODDP_TOKEN": "secret", RunIDEnv: "restart-3",
		}
		wg.Go(func() {
			lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
			pg, err := InitProcessGroup(context.Background(), "ddptest", InitOptions{LookupEnv: lookup})
			if err != nil {
				errs[rank] = err
				return
			}
			buf := []float32{float32(rank + 1), 10}
			err = pg.AllReduce(context.Background(), buf, procgroup.Sum).Wait(context.Background())
			sums[rank] = buf
			errs[rank] = err
			if err := pg.Close(); err != nil && errs[rank] == nil {
				errs[rank] = err
			}
			if err := pg.Close(); err != nil && errs[rank] == nil {
				errs[rank] = fmt.Errorf("second Close: %w", err)
			}
		})
	}
	wg.Wait()
	// Close released the store: rank 0's port is free again.
	if l, err := net.Listen("tcp", "127.0.0.1:"+port); err != nil {
		t.Errorf("the store's port after Close: %v", err)
	} else {
		l.Close()
	}
	for rank := 0; rank < size; rank++ {
		if errs[rank] != nil {
			t.Fatalf("rank %d: %v", rank, errs[rank])
		}
		if sums[rank][0] != 3 || sums[rank][1] != 20 {
			t.Errorf("rank %d: all-reduce gave %v, want [3 20]", rank, sums[rank])
		}
		o := testOpts[rank]
		if o.Rank != rank || o.Size != size || o.LocalRank != rank || o.LocalSize != size || o.Prefix != "run/restart-3" || o.Token != "secret" {
			t.Errorf("rank %d: backend got options %+v", rank, o)
		}
	}
}

func TestInitProcessGroupErrors(t *testing.T) {
	for _, tc := range []struct {
		env     map[string]string
		backend string
		want    string
	}{
		{map[string]string{"MASTER_ADDR": "127.0.0.1"}, "ddptest", "ddp: init: procgroup: env: MASTER_ADDR is set but RANK and WORLD_SIZE are not"},
		{map[string]string{"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "nosuch",
			`ddp: init: procgroup: unknown backend "nosuch": no backend of that name exists (known backends: gloo → github.com/goddp/goddp/backends/gloo, nccl → github.com/goddp/goddp/backends/nccl; linked in: `},
	} {
		lookup := func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok }
		_, err := InitProcessGroup(context.Background(), tc.backend, InitOptions{LookupEnv: lookup})
		if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("env %v backend %s: %v, want %s…", tc.env, tc.backend, err, tc.want)
		}
	}
}

// With no launcher variable in the environment, InitProcessGroup makes a world of one
// process (rank 0 of 1, an in-process store).
func TestInitProcessGroupSingleProcess(t *testing.T) {
	testCluster = pgtest.NewCluster(1)
	defer testCluster.Close()
	lookup := func(k string) (string, bool) { return "", false }
	pg, err := InitProcessGroup(context.Background(), "ddptest", InitOptions{LookupEnv: lookup})
	if err != nil {
		t.Fatal(err)
	}
	if pg.Rank() != 0 || pg.Size() != 1 {
		t.Errorf("rank %d of %d, want 0 of 1", pg.Rank(), pg.Size())
	}
	// The backend's group is reached through Unwrap, as procgroup.Find walks it.
	var g procgroup.ProcessGroup = pg
	for g != testCluster.Group(0) {
		u, ok := g.(procgroup.Unwrapper)
		if !ok {
			t.Fatalf("%T does not unwrap to the backend's group", g)
		}
		g = u.Unwrap()
	}
	buf := []float32{2.5, -1}
	if err := pg.AllReduce(context.Background(), buf, procgroup.Sum).Wait(context.Background()); err != nil || buf[0] != 2.5 || buf[1] != -1 {
		t.Errorf("all-reduce over one rank: %v, %v", buf, err)
	}
	if err := pg.Close(); err != nil {
		t.Fatal(err)
	}
}
