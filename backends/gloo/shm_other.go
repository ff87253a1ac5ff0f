//go:build !linux

package gloo

import (
	"context"

	"github.com/goddp/goddp/procgroup"
)

// Shared memory (Note [Shared memory] in shm_linux.go) is Linux-only; elsewhere same-host
// data goes over the sockets.

const (
	maxShmSlot  = 64 << 20
	maxShmSlots = 64
)

type shmRegion struct{}

func (g *group) setupShm(context.Context) error                 { return nil }
func (g *group) releaseShm()                                    {}
func (g *group) shmAbort(peer, lost int, reason string)         {}
func (g *group) shmWake()                                       {}
func (g *group) useShmRing() bool                               { return false }
func (g *group) shmRingAllReduce(o *op) error                   { panic("gloo: no shared memory") }
func (g *group) shmRing(*op, []byte, *ringView, int, int) error { panic("gloo: no shared memory") }
func (g *group) shmHolds([]int) bool                            { return false }
func (g *group) useShmDirect(int) bool                          { return false }
func (g *group) shmDirectAllReduce(o *op) error                 { panic("gloo: no shared memory") }
func (g *group) shmAllReduce(o *op) error                       { panic("gloo: no shared memory") }
func (g *group) inPlaceOK() bool                                { return false }
func (g *group) ownsShared([]byte) bool                         { return false }
func (g *group) hostInPlaceOK() bool                            { return false }
func (g *group) hierPost(*op) (bool, error)                     { return false, nil }
func (g *group) hostReduce(*op, []byte, int) error              { panic("gloo: no shared memory") }
func (g *group) shmPhase(uint64) error                          { panic("gloo: no shared memory") }
func (g *group) hostBroadcast([]byte, int) error                { panic("gloo: no shared memory") }

// Note [Single copy] (cma_linux.go) is Linux-only.
var cmaMinBytes [procgroup.OpBarrier + 1]int

func (g *group) agreeCMA(context.Context) error               { return nil }
func (g *group) cmaFor(procgroup.CollectiveOp, int) bool      { return false }
func (g *group) peerReadFor(procgroup.CollectiveOp, int) bool { return false }
func (g *group) peerAllGather(*op) (bool, error)              { return false, nil }
func (g *group) peerReduceScatter(*op) (bool, error)          { return false, nil }
func (g *group) peerBroadcast(*op) (bool, error)              { return false, nil }

// Note [Adopted buffers] (adopt_linux.go) is Linux-only.
var (
	adoptMinBytes = 0
	adoptFirst    = false
)

func (g *group) adopting(o *op, f func(*op) error) error { return f(o) }
func (g *group) isAdopted([]byte) bool                   { return false }

// arenaAlloc and sharedAlloc have no shared memory to hand out here.
func (g *group) arenaAlloc(procgroup.DType, int) any           { return nil }
func (g *group) sharedAlloc(procgroup.DType, int) (any, error) { return nil, nil }

// FreeBuffer has nothing to give back here.
func (g *group) FreeBuffer(any) {}

func (r *shmRegion) has(int) bool { return false }
