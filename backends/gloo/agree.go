package gloo

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/goddp/goddp/procgroup"
)

// Note [Agreement]: each rank reads its settings from its own Config and environment, and
// a host's shared memory can fail where another's works, but the ranks of a collective
// must cut their messages alike: the same frames (segment sizes), the same algorithm for
// a size, the same pieces in Note [Hierarchical pipeline]. A difference there does not
// always fail: frames that agree in number, length and sequence number but cover
// different bytes give wrong sums without a word. So New makes these choices the group's:
//
//   - The settings that shape the wire (Config.Algorithm, SegmentSize, DirectMaxBytes,
//     HierPieceSize) travel with each rank's address in the store (addrInfo.Settings),
//     and every rank compares all of them before it dials anyone: a difference is
//     refused on every rank alike, with an error that names the setting and each rank's
//     value (procgroup.ErrInvalidArgument).
//   - The settings a rank may hold alone are reconciled from the same record: the
//     calibration (Config.Tune) runs only where every rank asks for it; a rank whose
//     SharedMemory is off is left out of its host's region, so its leader neither sends
//     it one nor waits for it to join.
//   - Whether a host's ranks really share memory (the region may fail to be created: only
//     a warning) is known only after the set-up, so the ranks then exchange it in one
//     small all-reduce (Max of a flag per rank), before the calibration and any
//     collective of the user's. Each host's host phases run through shared memory only
//     where all its ranks have it (hostShm), and the pieces of Note [Hierarchical
//     pipeline] are cut only where every host's ranks have it (group.piece); elsewhere
//     every rank runs the whole message as one piece, whose middle ring is the one the
//     socket path runs, so that shared-memory and socket hosts send the same frames over
//     the same bytes. Segment sizes follow from the agreed message cuts (ringSegment).
//
// The other settings are the rank's own: the transport (each connection's kind is fixed
// by the dialer from the listener's addresses, the same at both ends), InlineMaxBytes
// (a message that fits in it is one frame of at most a segment either way), the
// shared-memory slots and arena (the host's leader lays them out for its host), VMReadv
// (New's probe makes the group's choice of it: Note [Single copy]), timeouts and
// addresses.

// groupSettings is what each rank publishes of its settings for Note [Agreement].
type groupSettings struct {
	Algorithm      string `json:"algo"`
	SegmentSize    int    `json:"seg"`
	DirectMaxBytes int    `json:"direct_max"`
	HierPieceSize  int    `json:"hier_piece"`
	Tune           string `json:"tune"`
	SharedMemory   string `json:"shm"`
}

func (c *Config) settings() *groupSettings {
	return &groupSettings{Algorithm: c.Algorithm, SegmentSize: c.SegmentSize, DirectMaxBytes: c.DirectMaxBytes,
		HierPieceSize: c.HierPieceSize, Tune: c.Tune, SharedMemory: c.SharedMemory}
}

// testShmCreate, when set (by tests), runs where a host's leader creates its region; an
// error it returns stands for a failed memfd_create or mmap on that host (Config.HostID).
var testShmCreate func(hostID string) error

// agreeSettings runs the first part of Note [Agreement] on every rank's published
// settings: it refuses the settings that must match and do not, and records the others.
func (g *group) agreeSettings(infos []addrInfo) error {
	set := make([]*groupSettings, len(infos))
	for j, in := range infos {
		if in.Settings == nil {
			return fmt.Errorf("%w: rank %d published no gloo settings (another version of goddp?)", procgroup.ErrInvalidArgument, j)
		}
		set[j] = in.Settings
	}
	for _, m := range []struct {
		what string
		val  func(*groupSettings) string
	}{
		{"algorithm (GODDP_GLOO_ALGO, gloo.Config.Algorithm)", func(s *groupSettings) string { return strconv.Quote(s.Algorithm) }},
		{"segment size (gloo.Config.SegmentSize)", func(s *groupSettings) string { return strconv.Itoa(s.SegmentSize) }},
		{"direct-exchange limit (gloo.Config.DirectMaxBytes)", func(s *groupSettings) string { return strconv.Itoa(s.DirectMaxBytes) }},
		{"hierarchical piece size (GODDP_GLOO_HIER_PIECE, gloo.Config.HierPieceSize)", func(s *groupSettings) string { return strconv.Itoa(s.HierPieceSize) }},
	} {
		if err := mustMatch(set, m.what, m.val); err != nil {
			return err
		}
	}
	g.tuneAll = true
	g.shmWanted = make([]bool, len(set))
	for j, s := range set {
		g.tuneAll = g.tuneAll && s.Tune != TuneOff
		g.shmWanted[j] = s.SharedMemory != ShmOff
	}
	return nil
}

// mustMatch fails unless val gives the same for every rank's settings; the error lists the
// ranks that hold each value.
func mustMatch(set []*groupSettings, what string, val func(*groupSettings) string) error {
	first := val(set[0])
	same := true
	for _, s := range set[1:] {
		same = same && val(s) == first
	}
	if same {
		return nil
	}
	var vals []string
	ranks := map[string][]int{}
	for j, s := range set {
		v := val(s)
		if ranks[v] == nil {
			vals = append(vals, v)
		}
		ranks[v] = append(ranks[v], j)
	}
	parts := make([]string, len(vals))
	for i, v := range vals {
		parts[i] = rankList(ranks[v]) + ": " + v
	}
	return fmt.Errorf("%w: gloo: the ranks disagree on the %s: %s; every rank must have the same value",
		procgroup.ErrInvalidArgument, what, strings.Join(parts, "; "))
}

// rankList writes ascending ranks with runs as ranges: "rank 3", "ranks 0-3, 6".
func rankList(rs []int) string {
	var b strings.Builder
	if len(rs) == 1 {
		b.WriteString("rank ")
	} else {
		b.WriteString("ranks ")
	}
	for i := 0; i < len(rs); {
		j := i
		for j+1 < len(rs) && rs[j+1] == rs[j]+1 {
			j++
		}
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.Itoa(rs[i]))
		if j > i {
			b.WriteString("-" + strconv.Itoa(rs[j]))
		}
		i = j + 1
	}
	return b.String()
}

// agreeShm runs the last part of Note [Agreement] where Note [Hierarchical] applies: the
// ranks learn which ranks' hosts share memory, clear hostShm on every rank of a host where
// one rank lacks it, and cut pieces only where every host has it. New runs it once the
// worker is up, before any other collective.
func (g *group) agreeShm(ctx context.Context) error {
	g.piece = -1
	if !g.hier {
		return nil
	}
	lacks := make([]float64, g.size) // 1: that rank's host phases cannot use shared memory
	if !g.hostShm {
		lacks[g.rank] = 1
	}
	// Part of New: bounded like the rest of its set-up, not by the collective timeout.
	actx, cancel := context.WithTimeout(ctx, g.opts.ConnectTimeout)
	defer cancel()
	if err := g.submitPath(actx, lacks, procgroup.Max, "direct").Wait(actx); err != nil {
		return fmt.Errorf("agreeing on shared memory (bounded by %s, %s): %w", g.opts.ConnectTimeout, procgroup.ConnectTimeoutEnv, err)
	}
	var without []int
	for j, l := range lacks {
		if l != 0 {
			without = append(without, j)
			if g.hostIDs[j] == g.cfg.HostID {
				g.hostShm = false
			}
		}
	}
	if len(without) == 0 {
		g.piece = g.cfg.HierPieceSize
		return nil
	}
	if g.rank == 0 && len(without) < g.size && g.cfg.HierPieceSize > 0 { // the pipeline is lost
		hosts := map[string]bool{}
		var names []string
		for _, j := range without {
			if h := g.hosts[j]; !hosts[h] {
				hosts[h] = true
				names = append(names, h)
			}
		}
		g.log.Warn("gloo: some ranks' hosts have no shared memory among their ranks (GODDP_GLOO_SHM=off, or the region could not be created): "+
			"their host phases go over the sockets, and every host runs the hierarchical all-reduce without its pipeline",
			zap.String("ranks", rankList(without)), zap.Strings("hosts", names))
	}
	return nil
}
