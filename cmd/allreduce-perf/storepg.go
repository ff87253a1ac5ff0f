package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"sync"

	"github.com/goddp/goddp/procgroup"
)

// The "store" backend runs AllReduce and Barrier through the rendezvous store itself: each
// rank publishes its buffer under a key and reduces everyone's. It is slow (every byte goes
// through the store server, and values are capped at its 64 MiB limit) and exists to check
// this command's harness and result checking independently of any real backend; the other
// collectives are not implemented. Collectives run synchronously: the Work returned has
// completed.
func init() { procgroup.Register("store", newStoreGroup) }

type storeGroup struct {
	rank, size int
	st         procgroup.Store

	mu     sync.Mutex // guards the fields below; held for the whole of each collective
	seq    int64
	closed error // ErrClosed or an ErrAborted error once the group is unusable
}

var _ procgroup.ProcessGroup = (*storeGroup)(nil)

func newStoreGroup(ctx context.Context, opts procgroup.Options) (procgroup.ProcessGroup, error) {
	g := &storeGroup{rank: opts.Rank, size: opts.Size, st: procgroup.PrefixStore{Prefix: "storepg", Store: opts.Store}}
	if err := g.Barrier(ctx).Wait(ctx); err != nil {
		return nil, fmt.Errorf("store backend: rank %d: join: %w", opts.Rank, err)
	}
	return g, nil
}

func (g *storeGroup) Rank() int { return g.rank }
func (g *storeGroup) Size() int { return g.size }

// run runs one collective under g.mu and returns its completed Work; a failure aborts the
// group, since the peers are mid-protocol.
func (g *storeGroup) run(op procgroup.CollectiveOp, f func(seq int64) error) procgroup.Work {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed != nil {
		return procgroup.Completed(g.closed)
	}
	g.seq++
	if err := f(g.seq); err != nil {
		err = fmt.Errorf("store backend: rank %d: %s #%d: %w", g.rank, op, g.seq, err)
		g.closed = fmt.Errorf("%w: %w", procgroup.ErrAborted, err)
		return procgroup.Completed(err)
	}
	return procgroup.Completed(nil)
}

func (g *storeGroup) AllReduce(ctx context.Context, buf any, op procgroup.ReduceOp) procgroup.Work {
	dt, n, err := procgroup.DTypeOf(buf)
	if err != nil {
		return procgroup.Completed(err)
	}
	if op < procgroup.Sum || op > procgroup.Prod {
		return procgroup.Completed(fmt.Errorf("%w: reduce op %v", procgroup.ErrInvalidArgument, op))
	}
	return g.run(procgroup.OpAllReduce, func(seq int64) error {
		key := func(r int) string { return fmt.Sprintf("ar/%d/%d", seq, r) }
		mine, err := binary.Append(nil, binary.LittleEndian, buf)
		if err != nil {
			return err
		}
		if err := g.st.Set(ctx, key(g.rank), mine); err != nil {
			return err
		}
		acc := make([]float64, n)
		in := make([]float64, n)
		for r := range g.size {
			raw, err := g.st.Get(ctx, key(r))
			if err != nil {
				return err
			}
			other := procgroup.NewBuffer(dt, n)
			if _, err := binary.Decode(raw, binary.LittleEndian, other); err != nil {
				return fmt.Errorf("rank %d's buffer: %w", r, err)
			}
			load(in, other, 0)
			for i, v := range in {
				switch {
				case r == 0:
					acc[i] = v
				case op == procgroup.Sum || op == procgroup.Avg:
					acc[i] += v
				case op == procgroup.Prod:
					acc[i] *= v
				case op == procgroup.Min:
					acc[i] = math.Min(acc[i], v)
				case op == procgroup.Max:
					acc[i] = math.Max(acc[i], v)
				}
			}
		}
		if op == procgroup.Avg {
			for i := range acc {
				acc[i] /= float64(g.size)
				if dt == procgroup.Int32 || dt == procgroup.Int64 {
					acc[i] = math.Trunc(acc[i])
				}
			}
		}
		store(buf, acc)
		// The last rank to finish reading removes the keys.
		if done, err := g.st.Add(ctx, fmt.Sprintf("ar/%d/read", seq), 1); err != nil {
			return err
		} else if done == int64(g.size) {
			for r := range g.size {
				if _, err := g.st.Delete(ctx, key(r)); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// store writes acc into buf, rounding to buf's element type.
func store(buf any, acc []float64) {
	switch b := buf.(type) {
	case []float32:
		for i := range b {
			b[i] = float32(acc[i])
		}
	case []float64:
		copy(b, acc)
	case []int32:
		for i := range b {
			b[i] = int32(acc[i])
		}
	case []int64:
		for i := range b {
			b[i] = int64(acc[i])
		}
	case []procgroup.BF16:
		for i := range b {
			b[i] = procgroup.BF16FromFloat32(float32(acc[i]))
		}
	case []procgroup.F16:
		for i := range b {
			b[i] = procgroup.F16FromFloat32(float32(acc[i]))
		}
	}
}

func (g *storeGroup) Barrier(ctx context.Context) procgroup.Work {
	return g.run(procgroup.OpBarrier, func(seq int64) error {
		n, err := g.st.Add(ctx, fmt.Sprintf("barrier/%d", seq), 1)
		if err != nil {
			return err
		}
		all := fmt.Sprintf("barrier/%d/all", seq)
		if n == int64(g.size) {
			return g.st.Set(ctx, all, nil)
		}
		return g.st.Wait(ctx, all)
	})
}

func (g *storeGroup) unsupported(op procgroup.CollectiveOp) procgroup.Work {
	return procgroup.Completed(fmt.Errorf("%w: the store backend has no %s", procgroup.ErrInvalidArgument, op))
}

func (g *storeGroup) Broadcast(context.Context, any, int) procgroup.Work {
	return g.unsupported(procgroup.OpBroadcast)
}

func (g *storeGroup) AllGather(context.Context, any, any) procgroup.Work {
	return g.unsupported(procgroup.OpAllGather)
}

func (g *storeGroup) ReduceScatter(context.Context, any, any, procgroup.ReduceOp) procgroup.Work {
	return g.unsupported(procgroup.OpReduceScatter)
}

func (g *storeGroup) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed == nil {
		g.closed = procgroup.ErrClosed
	}
	return nil
}

func (g *storeGroup) Abort(cause error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed == nil {
		g.closed = fmt.Errorf("%w: %w", procgroup.ErrAborted, cause)
	}
}
