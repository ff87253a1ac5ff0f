package main

import (
	"context"
	"fmt"

	"github.com/goddp/goddp/procgroup"
)

// The collectives --collective measures, with nccl-tests' sizes and bus bandwidths
// (nccl-tests' doc/PERFORMANCE.md): the size is the buffer of AllReduce and Broadcast, the
// gathered output of AllGather and the input of ReduceScatter (n·count elements, each
// rank's share count); busbw is algbw times 2(n−1)/n for AllReduce, (n−1)/n for AllGather
// and ReduceScatter, 1 for Broadcast (from rank 0).
const (
	collAllReduce     = "allreduce"
	collAllGather     = "allgather"
	collReduceScatter = "reducescatter"
	collBroadcast     = "broadcast"
)

var collectives = []string{collAllReduce, collAllGather, collReduceScatter, collBroadcast}

// busFactor is busbw/algbw for collective on n ranks.
func busFactor(collective string, n int) float64 {
	switch collective {
	case collAllGather, collReduceScatter:
		return float64(n-1) / float64(n)
	case collBroadcast:
		return 1
	}
	return 2 * float64(n-1) / float64(n)
}

// task is one size of one collective on this rank: its buffers, the call, and the check.
type task struct {
	count int   // elements in the size column
	bytes int64 // the size column
	src   any   // the rank's pristine input
	in    any   // the collective's input: the buffer itself for AllReduce and Broadcast
	out   any   // what it writes (in, for AllReduce and Broadcast)
	free  func()
	run   func(ctx context.Context) error
}

// newTask sets up cfg.collective for a size of size bytes (rounded down to what the
// collective can split): nil when the size holds less than one element per rank.
func newTask(pg procgroup.ProcessGroup, cfg config, size int64) (*task, error) {
	rank, world := pg.Rank(), pg.Size()
	es := int64(cfg.dtype.Size())
	count := int(size / es)
	share := count
	switch cfg.collective {
	case collAllGather, collReduceScatter:
		share = count / world
		count = share * world
	}
	if share == 0 {
		return nil, nil
	}
	t := &task{count: count, bytes: int64(count) * es}
	inCount := count
	if cfg.collective == collAllGather {
		inCount = share
	}
	t.src = procgroup.NewBuffer(cfg.dtype, inCount)
	fill(t.src, newGen(rank, world, t.bytes, cfg.dtype, cfg.op))
	var err error
	if cfg.inPlace && cfg.collective == collAllGather { // the input is slot rank of the output
		if t.out, t.free, err = newBuffer(pg, cfg, count); err != nil {
			return nil, err
		}
		t.in = procgroup.SliceBuffer(t.out, rank*share, (rank+1)*share)
	} else if t.in, t.free, err = newBuffer(pg, cfg, inCount); err != nil {
		return nil, err
	}
	copyBuf(t.in, t.src)
	switch cfg.collective {
	case collAllReduce:
		t.out = t.in
		t.run = func(ctx context.Context) error { return pg.AllReduce(ctx, t.in, cfg.op).Wait(ctx) }
	case collBroadcast:
		t.out = t.in
		t.run = func(ctx context.Context) error { return pg.Broadcast(ctx, t.in, 0).Wait(ctx) }
	case collAllGather:
		if !cfg.inPlace {
			t.out = procgroup.NewBuffer(cfg.dtype, count)
		}
		t.run = func(ctx context.Context) error { return pg.AllGather(ctx, t.out, t.in).Wait(ctx) }
	case collReduceScatter:
		if cfg.inPlace { // the output is chunk rank of the input
			t.out = procgroup.SliceBuffer(t.in, rank*share, (rank+1)*share)
		} else {
			t.out = procgroup.NewBuffer(cfg.dtype, share)
		}
		t.run = func(ctx context.Context) error { return pg.ReduceScatter(ctx, t.out, t.in, cfg.op).Wait(ctx) }
	default:
		return nil, fmt.Errorf("unknown collective %q", cfg.collective)
	}
	return t, nil
}

// wrong counts this rank's result elements that differ from the reference, computed here
// from every rank's data regenerated from its seed.
func (t *task) wrong(rank, world int, cfg config) int64 {
	switch cfg.collective {
	case collAllGather: // rank j's input, exactly, in slot j
		share := t.count / world
		var n int64
		for j := range world {
			n += verifyCopy(t.out, j*share, share, newGen(j, world, t.bytes, cfg.dtype, cfg.op))
		}
		return n
	case collBroadcast: // rank 0's input, exactly
		return verifyCopy(t.out, 0, t.count, newGen(0, world, t.bytes, cfg.dtype, cfg.op))
	case collReduceScatter: // the reduction of chunk rank of every rank's input
		share := t.count / world
		return verifyAt(t.out, world, t.bytes, cfg.dtype, cfg.op, rank*share)
	}
	return verifyAt(t.out, world, t.bytes, cfg.dtype, cfg.op, 0)
}

// verifyCopy counts the elements of buf[off:off+n] that differ from what g draws.
func verifyCopy(buf any, off, n int, g *gen) int64 {
	got := make([]float64, n)
	load(got, buf, off)
	var wrong int64
	for _, x := range got {
		if want := g.next(); x != want {
			wrong++
		}
	}
	return wrong
}
