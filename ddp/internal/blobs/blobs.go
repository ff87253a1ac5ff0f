// Package blobs moves byte strings over a process group, which moves typed elements only:
// the per-rank states (a comm hook's) of ddp/checkpoint and ddp/elastic.
package blobs

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/goddp/goddp/procgroup"
)

// AllGather returns every rank's b, by rank; a rank that passes a nil b has a nil entry
// (an empty b is an empty, not nil, entry). Every rank of pg must call it.
func AllGather(ctx context.Context, pg procgroup.ProcessGroup, b []byte) ([][]byte, error) {
	n := pg.Size()
	lens := make([]int64, n)
	own := []int64{-1}
	if b != nil {
		own[0] = int64(len(b))
	}
	if err := pg.AllGather(ctx, lens, own).Wait(ctx); err != nil {
		return nil, fmt.Errorf("the lengths: %w", err)
	}
	words := 1
	for _, l := range lens {
		words = max(words, int(l+7)/8)
	}
	out := make([]int64, n*words)
	if err := pg.AllGather(ctx, out, pack(b, words)).Wait(ctx); err != nil {
		return nil, err
	}
	all := make([][]byte, n)
	for r, l := range lens {
		if l >= 0 {
			all[r] = unpack(out[r*words:(r+1)*words], int(l))
		}
	}
	return all, nil
}

// Broadcast returns root's bs on every rank of pg (the other ranks pass nil): their
// count, then each one's length and bytes. Every rank of pg must call it.
func Broadcast(ctx context.Context, pg procgroup.ProcessGroup, bs [][]byte, root int) ([][]byte, error) {
	n := []int64{int64(len(bs))}
	if err := pg.Broadcast(ctx, n, root).Wait(ctx); err != nil {
		return nil, err
	}
	if n[0] < 0 || n[0] > 1<<20 {
		return nil, fmt.Errorf("%d byte strings", n[0])
	}
	lens := make([]int64, n[0])
	if pg.Rank() == root {
		for i, b := range bs {
			lens[i] = int64(len(b))
		}
	}
	if len(lens) > 0 {
		if err := pg.Broadcast(ctx, lens, root).Wait(ctx); err != nil {
			return nil, err
		}
	}
	got := make([][]byte, len(lens))
	for i, l := range lens {
		words := max(int(l+7)/8, 1)
		w := make([]int64, words)
		if pg.Rank() == root {
			w = pack(bs[i], words)
		}
		if err := pg.Broadcast(ctx, w, root).Wait(ctx); err != nil {
			return nil, err
		}
		got[i] = unpack(w, int(l))
	}
	return got, nil
}

// pack puts b into words little-endian int64s.
func pack(b []byte, words int) []int64 {
	w := make([]int64, words)
	for i := range w {
		var v [8]byte
		if 8*i < len(b) {
			copy(v[:], b[8*i:])
		}
		w[i] = int64(binary.LittleEndian.Uint64(v[:]))
	}
	return w
}

// unpack returns the first n bytes that pack put into w.
func unpack(w []int64, n int) []byte {
	b := make([]byte, 0, 8*len(w))
	for _, v := range w {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	return b[:n]
}
