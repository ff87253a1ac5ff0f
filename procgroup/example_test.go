package procgroup_test

import (
	"context"
	"errors"
	"fmt"
	"sync"

	_ "github.com/goddp/goddp/backends/gloo" // registers the "gloo" backend: procgroup imports none
	"github.com/goddp/goddp/procgroup"
)

// Two ranks join a gloo group through a shared store and sum a vector. Here the ranks are
// goroutines sharing a MemStore; in a job each rank is a process, and its store comes from
// procgroup.Rendezvous (or the whole setup from ddp.InitProcessGroup).
func Example() {
	ctx := context.Background()
	store := procgroup.NewMemStore()
	defer store.Close()
	const size = 2
	out := make([]string, size)
	var wg sync.WaitGroup
	for rank := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[rank] = allReduce(ctx, rank, size, store)
		}()
	}
	wg.Wait()
	for _, line := range out {
		fmt.Println(line)
	}
	// Output:
	// rank 0: [3 30]
	// rank 1: [3 30]
}

// allReduce is one rank of Example.
func allReduce(ctx context.Context, rank, size int, store procgroup.Store) string {
	pg, err := procgroup.New(ctx, "gloo", procgroup.Options{
		Rank: rank, Size: size, Store: store, Prefix: "example", Token: "example-token",
	})
	if err != nil {
		return err.Error()
	}
	defer pg.Close()
	grads := []float32{float32(rank + 1), 10 * float32(rank+1)}
	w := pg.AllReduce(ctx, grads, procgroup.Sum) // returns at once; grads belongs to w until done
	if err := w.Wait(ctx); err != nil {
		return err.Error()
	}
	// Leave together: no rank closes its connections while a peer may still be finishing.
	if err := pg.Barrier(ctx).Wait(ctx); err != nil {
		return err.Error()
	}
	return fmt.Sprintf("rank %d: %v", rank, grads)
}

// A backend is linked in by a blank import of its package; this program imports gloo only,
// so asking for nccl names the import to add.
func ExampleLookup() {
	_, err := procgroup.Lookup("nccl")
	fmt.Println(err)
	fmt.Println(errors.Is(err, procgroup.ErrUnknownBackend))
	// Output:
	// procgroup: unknown backend "nccl": not linked into this program; add import _ "github.com/goddp/goddp/backends/nccl" (known backends: gloo → github.com/goddp/goddp/backends/gloo, nccl → github.com/goddp/goddp/backends/nccl; linked in: gloo)
	// true
}
