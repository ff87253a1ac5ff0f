package blobs

import (
	"bytes"
	"context"
	"fmt"
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestAllGatherBroadcast: 4 ranks' byte strings of lengths 0 to 17 (one nil, one empty)
// reach every rank whole and in rank order, a nil one as nil; root 2's strings reach
// every rank by Broadcast, and an empty list too.
func TestAllGatherBroadcast(t *testing.T) {
	own := func(r int) []byte {
		switch r {
		case 1:
			return nil
		case 3:
			return []byte{}
		}
		b := make([]byte, 9+8*r)
		for i := range b {
			b[i] = byte(r*31 + i)
		}
		return b
	}
	c := pgtest.NewCluster(4)
	defer c.Close()
	err := c.Each(func(r int, pg procgroup.ProcessGroup) error {
		ctx := context.Background()
		all, err := AllGather(ctx, pg, own(r))
		if err != nil {
			return err
		}
		for w, b := range all {
			if want := own(w); !bytes.Equal(b, want) || (want == nil) != (b == nil) {
				return fmt.Errorf("rank %d: rank %d's string %v, want %v", r, w, b, want)
			}
		}
		var mine [][]byte
		if r == 2 {
			mine = [][]byte{own(0), {}, own(2)}
		}
		got, err := Broadcast(ctx, pg, mine, 2)
		if err != nil {
			return err
		}
		if len(got) != 3 || !bytes.Equal(got[0], own(0)) || len(got[1]) != 0 || !bytes.Equal(got[2], own(2)) {
			return fmt.Errorf("rank %d: broadcast %v", r, got)
		}
		if got, err := Broadcast(ctx, pg, nil, 0); err != nil || len(got) != 0 {
			return fmt.Errorf("rank %d: an empty broadcast: %v, %v", r, got, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
