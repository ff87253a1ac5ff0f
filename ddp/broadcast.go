package ddp

import (
	"context"
	"fmt"

	"github.com/goddp/goddp/procgroup"
)

func chunkBytes(mb float64) int {
	return max(int(mb*(1<<20)), 8)
}

// broadcastAll copies rank 0's tensors (each a host slice of a procgroup element type) to
// every rank. Tensors of one element type are packed, in order, into chunks of at most
// chunk bytes and each chunk is one Broadcast: a model takes a few large collectives, not one
// per tensor. The element types are visited in procgroup.DTypes order, so that every rank
// issues the same collectives in the same order.
//
// Device tensors (procgroup.DeviceBuffer) follow, one Broadcast each, in order, waited for
// on the host (they are not packed: that would need a device staging buffer per type).
func broadcastAll(ctx context.Context, pg procgroup.ProcessGroup, tensors []any, chunk int) error {
	return broadcastFrom(ctx, pg, tensors, chunk, 0)
}

// broadcastFrom is broadcastAll from rank root.
func broadcastFrom(ctx context.Context, pg procgroup.ProcessGroup, tensors []any, chunk, root int) error {
	byType := map[procgroup.DType][]any{}
	var devs []procgroup.DeviceBuffer
	for _, t := range tensors {
		if d, ok := t.(procgroup.DeviceBuffer); ok {
			devs = append(devs, d)
			continue
		}
		dt, _, err := procgroup.DTypeOf(t)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrInvalidArgument, err)
		}
		byType[dt] = append(byType[dt], t)
	}
	for _, dt := range procgroup.DTypes {
		ts := byType[dt]
		if len(ts) == 0 {
			continue
		}
		n := max(chunk/dt.Size(), 1)
		var err error
		switch dt {
		case procgroup.Float32:
			err = broadcastFlat(ctx, pg, asSlices[float32](ts), n, root)
		case procgroup.Float64:
			err = broadcastFlat(ctx, pg, asSlices[float64](ts), n, root)
		case procgroup.Int32:
			err = broadcastFlat(ctx, pg, asSlices[int32](ts), n, root)
		case procgroup.Int64:
			err = broadcastFlat(ctx, pg, asSlices[int64](ts), n, root)
		case procgroup.BFloat16:
			err = broadcastFlat(ctx, pg, asSlices[procgroup.BF16](ts), n, root)
		case procgroup.Float16:
			err = broadcastFlat(ctx, pg, asSlices[procgroup.F16](ts), n, root)
		}
		if err != nil {
			return fmt.Errorf("%v tensors: %w", dt, err)
		}
	}
	for k, d := range devs {
		if err := pg.Broadcast(ctx, d, root).Wait(ctx); err != nil {
			return fmt.Errorf("device tensor %d of %d (%v×%d): %w", k+1, len(devs), d.Type, d.Count, err)
		}
	}
	return nil
}

func asSlices[T any](ts []any) [][]T {
	out := make([][]T, len(ts))
	for i, t := range ts {
		out[i] = t.([]T)
	}
	return out
}

// broadcastFlat broadcasts the concatenation of bufs from rank src, chunk elements at a
// time, through one staging buffer.
func broadcastFlat[T any](ctx context.Context, pg procgroup.ProcessGroup, bufs [][]T, chunk, src int) error {
	total := 0
	for _, b := range bufs {
		total += len(b)
	}
	if total == 0 {
		return nil
	}
	stage := make([]T, min(total, chunk))
	root := pg.Rank() == src
	var cur cursor
	for done := 0; done < total; {
		s := stage[:min(chunk, total-done)]
		next := cur
		if root {
			next = moveT(cur, bufs, s, true)
		}
		if err := pg.Broadcast(ctx, s, src).Wait(ctx); err != nil {
			return fmt.Errorf("broadcast of elements [%d, %d): %w", done, done+len(s), err)
		}
		if !root {
			next = moveT(cur, bufs, s, false)
		}
		cur = next
		done += len(s)
	}
	return nil
}

// cursor is a position in a list of slices: slice t, element off.
type cursor struct{ t, off int }

// moveT moves len(stage) elements between bufs, from c on, and stage (into stage when
// pack is set, out of it otherwise), and returns the position after them.
func moveT[T any](c cursor, bufs [][]T, stage []T, pack bool) cursor {
	for k := 0; k < len(stage); {
		if c.off == len(bufs[c.t]) {
			c.t, c.off = c.t+1, 0
			continue
		}
		src := bufs[c.t][c.off:]
		var n int
		if pack {
			n = copy(stage[k:], src)
		} else {
			n = copy(src, stage[k:])
		}
		k += n
		c.off += n
	}
	return c
}
