package gloo

import (
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestConformance runs the shared suite over Unix sockets (auto algorithm; with Note
// [Single copy] at every size; with Note [Adopted buffers] for every buffer with a whole
// page, at its first collective; without process_vm_readv) and over TCP with each
// algorithm forced.
func TestConformance(t *testing.T) {
	for _, v := range []variant{
		{"auto", &Config{}},
		{"unix-ring-single-copy", &Config{Transport: TransportUnix, Algorithm: AlgoRing, AdoptBuffers: AdoptOff}},
		{"unix-adopt-every-buffer", &Config{Transport: TransportUnix}},
		{"auto-vmreadv-off", &Config{VMReadv: VMReadvOff}},
		{"tcp-ring", &Config{Transport: TransportTCP, Algorithm: AlgoRing, SegmentSize: 4096}},
		{"unix-direct", &Config{Transport: TransportUnix, Algorithm: AlgoDirect, SegmentSize: 4096}},
	} {
		t.Run(v.name, func(t *testing.T) {
			switch v.name {
			case "unix-ring-single-copy":
				cmaEverySize(t)
			case "unix-adopt-every-buffer":
				adoptEverySize(t)
			}
			opts := pgtest.SuiteOptions{Short: testing.Short() || v.name != "auto"}
			if v.name != "auto" {
				opts.Large = 1 << 14
			}
			pgtest.Run(t, func(t testing.TB, size int) []procgroup.ProcessGroup {
				return startGroupsNoCleanup(t, size, v.cfg)
			}, opts)
		})
	}
}
