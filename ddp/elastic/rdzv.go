package elastic

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// Note [Elastic rounds]: the job's membership is a sequence of epochs, each formed by one
// round of a rendezvous in the store, under "elastic/<run id>/":
//
//   - r<K>/open: round K may close. Round 0 is open from the start; round K+1 opens when
//     epoch K ends, its value the reason (a rank lost, a heartbeat silent, nodes waiting
//     to join). Every rank of epoch K watches this key, and aborts its collectives the
//     moment it appears: a loss seen by one rank stops them all.
//   - r<K>/arrive, r<K>/m<I>: each process adds 1 to arrive and writes its record (id,
//     node, host, the epoch and rank it had, the step of its last commit, its model's
//     fingerprint) under the index it got. A new process arrives at the round after the
//     newest epoch, and waits there, counted, until it opens: that count is how epoch K
//     learns that nodes wait to join.
//   - r<K>/closed: the outcome, set once (compare-and-set) by whichever waiting process
//     first sees the round ready: MAX processes arrived, or as many as the epoch that
//     ended expected (r<K>/expect, set for a join), or a last call (DefaultLastCall)
//     without a new arrival once at least MIN have. The members are the survivors of
//     epoch K−1 in their old rank order, then the others by arrival; the size is the
//     largest that the shards divide (Options.Shards), and the processes beyond it wait
//     as standbys for the next round. "epoch" then says K.
//
// A process that belonged to an older epoch than K−1, or arrives after round K closed
// without it, was dropped (its heartbeat stopped, its link was down): it is refused with
// an error, and its launcher may start it again as a new process. A process whose model or
// settings differ from the job's ("model", the first epoch's description) is refused
// before it arrives. The epoch's group has its own key prefix, and the data plane's
// handshakes are keyed by that prefix, so no message of an old epoch reaches a new one.

// member is one process's record in a round.
type member struct {
	ID    string `json:"id"` // node/local rank/pid: unique in the job
	Node  string `json:"node"`
	Host  string `json:"host"`
	Epoch int    `json:"epoch"` // the epoch it belonged to; -1: none
	Rank  int    `json:"rank"`  // its rank there
	Step  int64  `json:"step"`  // the step of its last commit; -1: none
	Model string `json:"model"` // fingerprint of State.describe
	Index int    `json:"index"` // its arrival index in this round (from 1)
}

func (m member) String() string {
	s := fmt.Sprintf("node %s (host %s", m.Node, m.Host)
	if m.Epoch >= 0 {
		s += fmt.Sprintf(", rank %d of epoch %d", m.Rank, m.Epoch)
	}
	return s + ")"
}

// outcome is a closed round.
type outcome struct {
	Round   int      `json:"round"`
	Cause   string   `json:"cause"`
	Members []member `json:"members"` // the new epoch's ranks, in order
	Standby []member `json:"standby"`
	Gone    []member `json:"gone"` // the previous epoch's members that did not arrive
}

// rounds is one process's side of Note [Elastic rounds].
type rounds struct {
	st  procgroup.Store // under elastic/<run id>/
	cfg *config
	L   int // shards; 0: any size
	now func() time.Time
}

const poll = 50 * time.Millisecond

func roundKey(k int, name string) string { return fmt.Sprintf("r%d/%s", k, name) }

// peek reads key without waiting: nil when it is absent.
func peek(ctx context.Context, st procgroup.Store, key string) ([]byte, error) {
	// A compare-and-set that cannot match reads the key's value and changes nothing.
	v, _, err := st.CompareAndSet(ctx, key, []byte("\x00peek\x00"), []byte("\x00peek\x00"))
	return v, err
}

// count reads the counter key without changing it.
func count(ctx context.Context, st procgroup.Store, key string) (int, error) {
	n, err := st.Add(ctx, key, 0)
	return int(n), err
}

// epoch is the newest formed epoch, -1 before the first.
func (r *rounds) epoch(ctx context.Context) (int, error) {
	v, err := peek(ctx, r.st, "epoch")
	if err != nil || v == nil {
		return -1, err
	}
	return strconv.Atoi(string(v))
}

// open opens round k with cause, unless it is open already.
func (r *rounds) open(ctx context.Context, k int, cause string) error {
	_, _, err := r.st.CompareAndSet(ctx, roundKey(k, "open"), nil, []byte(cause))
	return err
}

// arrive enters round k with me's record and returns its arrival index.
func (r *rounds) arrive(ctx context.Context, k int, me member) (int, error) {
	n, err := r.st.Add(ctx, roundKey(k, "arrive"), 1)
	if err != nil {
		return 0, err
	}
	me.Index = int(n)
	b, _ := json.Marshal(me)
	if err := r.st.Set(ctx, roundKey(k, "m"+strconv.Itoa(int(n))), b); err != nil {
		return 0, err
	}
	return int(n), nil
}

// ErrFinished is returned to a process that waited as a standby (or to join) when the job
// ended without it.
var ErrFinished = errors.New("elastic: the job finished while this process waited to join")

// DroppedError refuses a process that an epoch formed without.
type DroppedError struct {
	Me    string // the process, as member.String says
	Epoch int    // the epoch that formed without it
}

func (e *DroppedError) Error() string {
	return fmt.Sprintf("elastic: %s was dropped from the job: epoch %d formed without it (it was silent or unreachable); start it again to join as a new process", e.Me, e.Epoch)
}

// ModelError refuses a process whose model or settings differ from the job's.
type ModelError struct {
	Me, Diff string
}

func (e *ModelError) Error() string {
	return fmt.Sprintf("elastic: %s cannot join: its model or settings differ from the job's: %s", e.Me, e.Diff)
}

// wait waits in round k (entered with index idx) until it closes, closing it itself when it
// is ready, and returns the outcome. prev is the epoch that ended (nil for a new process).
func (r *rounds) wait(ctx context.Context, k, idx int) (*outcome, error) {
	var opened, changed time.Time
	last := -1
	seen := map[int]member{}
	missing := map[int]time.Time{} // indices added but not yet written, since when
	prev, err := r.previous(ctx, k)
	if err != nil {
		return nil, err
	}
	prevIDs := map[string]bool{}
	for _, m := range prev {
		prevIDs[m.ID] = true
	}
	for {
		if v, err := peek(ctx, r.st, roundKey(k, "closed")); err != nil {
			return nil, err
		} else if v != nil {
			var o outcome
			if err := json.Unmarshal(v, &o); err != nil {
				return nil, fmt.Errorf("elastic: round %d: a corrupt outcome in the store: %w", k, err)
			}
			return &o, nil
		}
		cause, err := peek(ctx, r.st, roundKey(k, "open"))
		if err != nil {
			return nil, err
		}
		if v, err := peek(ctx, r.st, "finished"); err != nil {
			return nil, err
		} else if v != nil {
			return nil, ErrFinished
		}
		if cause == nil {
			if err := sleep(ctx, poll); err != nil {
				return nil, err
			}
			continue
		}
		now := r.now()
		if opened.IsZero() {
			opened = now
		}
		c, err := count(ctx, r.st, roundKey(k, "arrive"))
		if err != nil {
			return nil, err
		}
		if c != last {
			last, changed = c, now
		}
		for i := 1; i <= c; i++ {
			if _, ok := seen[i]; ok {
				continue
			}
			v, err := peek(ctx, r.st, roundKey(k, "m"+strconv.Itoa(i)))
			if err != nil {
				return nil, err
			}
			if v == nil { // added but not yet written: read it next time
				if _, ok := missing[i]; !ok {
					missing[i] = now
				}
				continue
			}
			var m member
			if err := json.Unmarshal(v, &m); err != nil {
				return nil, fmt.Errorf("elastic: round %d: a corrupt record %d in the store: %w", k, i, err)
			}
			seen[i] = m
		}
		expect := 0
		if v, err := peek(ctx, r.st, roundKey(k, "expect")); err != nil {
			return nil, err
		} else if v != nil {
			expect, _ = strconv.Atoi(string(v))
		}
		cands := make([]member, 0, len(seen))
		survivors := 0
		for _, m := range seen {
			if m.Epoch < 0 || m.Epoch == k-1 {
				cands = append(cands, m)
			}
			if m.Epoch == k-1 && prevIDs[m.ID] {
				survivors++
			}
		}
		// Every record is read, or its writer has been gone a last call (it died between
		// its Add and its Set: its index is a gap, not a member).
		complete := true
		for i := 1; i <= c; i++ {
			if _, ok := seen[i]; !ok && (missing[i].IsZero() || now.Sub(missing[i]) < r.cfg.lastCall) {
				complete = false
			}
		}
		n := r.size(len(cands))
		// The round may close early (MAX, or the count a join expected) only once every
		// member of the epoch before has arrived; else after a last call. And once the job
		// has an epoch, never without a survivor, who holds the state.
		allPrev := survivors == len(prev)
		early := allPrev && (c >= r.cfg.maxProcs() || (expect > 0 && c >= expect))
		ready := complete && n > 0 && (len(prev) == 0 || survivors > 0) && (early || now.Sub(changed) >= r.cfg.lastCall)
		if ready {
			b, _ := json.Marshal(r.close(k, string(cause), cands, n, prev))
			_, won, err := r.st.CompareAndSet(ctx, roundKey(k, "closed"), nil, b)
			if err != nil {
				return nil, err
			}
			if won {
				if err := r.st.Set(ctx, "epoch", []byte(strconv.Itoa(k))); err != nil {
					return nil, err
				}
			}
			continue // read whichever outcome won
		}
		if now.Sub(opened) > r.cfg.timeout {
			return nil, fmt.Errorf("elastic: round %d: %d of at least %d processes (%d nodes × %d) arrived within %v (--rdzv_timeout); lost: %s",
				k, len(cands), r.cfg.minProcs(), r.cfg.minNodes, r.cfg.localSize, r.cfg.timeout, describeAll(gone(prev, seen)))
		}
		if err := sleep(ctx, poll); err != nil {
			return nil, err
		}
	}
}

// previous is the members of epoch k−1, each with that epoch and its rank there; none for
// k = 0.
func (r *rounds) previous(ctx context.Context, k int) ([]member, error) {
	if k == 0 {
		return nil, nil
	}
	v, err := peek(ctx, r.st, roundKey(k-1, "closed"))
	if err != nil || v == nil {
		return nil, err
	}
	var o outcome
	if err := json.Unmarshal(v, &o); err != nil {
		return nil, fmt.Errorf("elastic: round %d: a corrupt outcome in the store: %w", k-1, err)
	}
	for i := range o.Members {
		o.Members[i].Epoch, o.Members[i].Rank = k-1, i
	}
	return o.Members, nil
}

// size is the largest world size, at most n, within MIN and MAX, that the shards divide;
// 0 if none.
func (r *rounds) size(n int) int {
	for s := min(n, r.cfg.maxProcs()); s >= r.cfg.minProcs() && s > 0; s-- {
		if r.L == 0 || r.L%s == 0 {
			return s
		}
	}
	return 0
}

// close builds round k's outcome from its candidates: n members, the rest standbys; prev
// is the epoch before's members.
func (r *rounds) close(k int, cause string, cands []member, n int, prev []member) *outcome {
	sort.Slice(cands, func(a, b int) bool {
		x, y := cands[a], cands[b]
		if (x.Epoch == k-1) != (y.Epoch == k-1) {
			return x.Epoch == k-1 // survivors first
		}
		if x.Epoch == k-1 {
			return x.Rank < y.Rank
		}
		return x.Index < y.Index
	})
	seen := map[int]member{}
	for _, m := range cands {
		seen[m.Index] = m
	}
	return &outcome{Round: k, Cause: cause, Members: cands[:n], Standby: cands[n:], Gone: gone(prev, seen)}
}

// gone lists the members of prev that are not among arrived.
func gone(prev []member, arrived map[int]member) []member {
	here := map[string]bool{}
	for _, m := range arrived {
		here[m.ID] = true
	}
	var g []member
	for _, m := range prev {
		if !here[m.ID] {
			g = append(g, m)
		}
	}
	return g
}

// describeAll names members, or "none".
func describeAll(ms []member) string {
	if len(ms) == 0 {
		return "none"
	}
	s := make([]string, len(ms))
	for i, m := range ms {
		s[i] = m.String()
	}
	return strings.Join(s, ", ")
}

// enter checks that me may take part and makes it arrive at round k (a new process: the
// round after the newest epoch; a survivor: the round after its epoch). It returns the
// arrival index.
func (r *rounds) enter(ctx context.Context, k int, me member, desc string) (int, error) {
	// The first process to come sets the job's model; every other must match it.
	v, _, err := r.st.CompareAndSet(ctx, "model", nil, []byte(desc))
	if err != nil {
		return 0, err
	}
	if string(v) != desc {
		return 0, &ModelError{Me: me.String(), Diff: firstDifference(desc, string(v))}
	}
	if me.Epoch >= 0 {
		newest, err := r.epoch(ctx)
		if err != nil {
			return 0, err
		}
		if newest > me.Epoch {
			return 0, &DroppedError{Me: me.String(), Epoch: newest}
		}
	}
	return r.arrive(ctx, k, me)
}

// await waits in round k, entered with index idx, until me is a member of an epoch,
// waiting as a standby through as many rounds as it takes. It returns the outcome that made
// it a member and its rank there.
func (r *rounds) await(ctx context.Context, k, idx int, me member) (*outcome, int, error) {
	for {
		o, err := r.wait(ctx, k, idx)
		if err != nil {
			return nil, 0, err
		}
		if i := slices.IndexFunc(o.Members, func(m member) bool { return m.ID == me.ID }); i >= 0 {
			return o, i, nil
		}
		standby := slices.ContainsFunc(o.Standby, func(m member) bool { return m.ID == me.ID })
		if !standby && me.Epoch >= 0 {
			return nil, 0, &DroppedError{Me: me.String(), Epoch: k}
		}
		// A standby, or a new process that came as the round closed: the next round.
		// It takes its state from the members when it is let in, as a new process does:
		// its own is older than theirs.
		me.Epoch, me.Rank, me.Step = -1, 0, -1
		k++
		if idx, err = r.arrive(ctx, k, me); err != nil {
			return nil, 0, err
		}
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
