package pgtest

import (
	"fmt"

	"github.com/goddp/goddp/procgroup"
)

// Record describes one collective as one rank issued it.
//
// Seq is the collective's sequence number on its rank, starting at 1. Count is the number of
// elements each rank contributes: len(buf) for AllReduce and Broadcast, len(in) for
// AllGather, len(out) for ReduceScatter (its block), 0 for Barrier. Root is set for
// Broadcast only and ReduceOp for AllReduce and ReduceScatter only; DType is 0 for Barrier.
type Record struct {
	Seq      int
	Op       procgroup.CollectiveOp
	DType    procgroup.DType
	Count    int
	Root     int
	ReduceOp procgroup.ReduceOp
}

// String renders r as, for instance, "allreduce float32×1024 sum".
func (r Record) String() string {
	switch r.Op {
	case procgroup.OpBarrier:
		return r.Op.String()
	case procgroup.OpBroadcast:
		return fmt.Sprintf("%s %v×%d root %d", r.Op, r.DType, r.Count, r.Root)
	case procgroup.OpAllReduce, procgroup.OpReduceScatter:
		return fmt.Sprintf("%s %v×%d %v", r.Op, r.DType, r.Count, r.ReduceOp)
	}
	return fmt.Sprintf("%s %v×%d", r.Op, r.DType, r.Count)
}

// matches reports whether r and o are the same collective, ignoring Seq.
func (r Record) matches(o Record) bool {
	r.Seq, o.Seq = 0, 0
	return r == o
}

// MismatchError is the error of a collective that two ranks issued differently at the same
// sequence number. Every rank's work at that sequence number fails with an error wrapping
// it, and the group is aborted (as a real backend must: its ranks are out of step).
type MismatchError struct {
	Seq  int
	Rank int    // the rank whose call did not match
	Got  Record // what Rank issued
	Peer int    // a rank that had already issued the collective at Seq
	Want Record // what Peer issued
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("pgtest: collective mismatch at seq %d: rank %d issued %v, rank %d issued %v",
		e.Seq, e.Rank, e.Got, e.Peer, e.Want)
}
