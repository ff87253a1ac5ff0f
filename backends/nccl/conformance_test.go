//go:build cgo

package nccl

import (
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestConformance runs the shared suite against the backend over the fake libraries: host
// slices staged through pinned memory and device scratch, on the comm stream.
func TestConformance(t *testing.T) {
	if gpuMode {
		t.Skip("one GPU holds one NCCL rank: the multi-rank suite runs on the fakes")
	}
	pgtest.Run(t, func(t testing.TB, size int) []procgroup.ProcessGroup {
		gs, err := tryGroups(size, 0)
		if err != nil {
			t.Fatal(err)
		}
		pgs := make([]procgroup.ProcessGroup, size)
		for r, g := range gs {
			pgs[r] = g
		}
		return pgs
	}, pgtest.SuiteOptions{Sizes: []int{1, 2, 3, 4, 5}, Short: testing.Short(), Large: 1 << 14})
}
