package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/goddp/goddp/internal/launchtest"
)

// elasticArgs: 6 logical shards of 4 samples, 40 steps of at least 50 ms (--step_time), so
// that a node can be lost or gained mid-run.
const elasticArgs = "--hidden_size 16 --steps 40 --log_every 1 --lr 0.3 --global_batch_size 24 --micro_batch_size 4 --bucket_cap_mb 0.0001 --first_bucket_cap_mb 0.0001 --step_time 50ms"

// newElasticJob is an elastic job of this trainer (the test binary) with elasticArgs.
func newElasticJob(t *testing.T, nnodes string, env []string) *launchtest.ElasticJob {
	if testing.Short() {
		t.Skip("builds ddprun and runs an elastic job")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return launchtest.NewElasticJob(t, exe, nnodes, append([]string{asMainEnv + "=1"}, env...), elasticArgs)
}

var (
	hostsStore = regexp.MustCompile(`hosts the job's rendezvous store`)
	stepLine   = regexp.MustCompile(`^\[local0\]: step (\d+) loss`)
	crcLine    = regexp.MustCompile(`(?m)^\[local0\]: (params_crc32=[0-9a-f]{8})$`)
)

func stepAtLeast(s int) *regexp.Regexp {
	return regexp.MustCompile(fmt.Sprintf(`^\[local0\]: step (%s) loss`, strings.Join(func() []string {
		var v []string
		for i := s; i < s+30; i++ {
			v = append(v, strconv.Itoa(i))
		}
		return v
	}(), "|")))
}

// wantCRCOf checks that the node exited 0 and printed want.
func wantCRCOf(t *testing.T, n *launchtest.Node, want string) {
	t.Helper()
	if err := n.Wait(2 * time.Minute); err != nil {
		t.Fatalf("%s: ddprun: %v\n%s", n.Name, err, n.Output())
	}
	m := crcLine.FindStringSubmatch(n.Output())
	if m == nil || m[1] != want {
		t.Fatalf("%s ends with %v; the uninterrupted run with the same global batch: %s\n%s", n.Name, m, want, n.Output())
	}
}

// TestElasticLoseNode: three nodes (ddprun --nnodes 2:3, one rank each); the third is
// killed with SIGKILL (its ddprun, and with it its rank) at step 10 of 40. The two others
// go on without a restart, and end with the crc of one process that runs the same 6
// shards; each says the change in one line.
func TestElasticLoseNode(t *testing.T) {
	want := uninterrupted(t, elasticArgs)
	j := newElasticJob(t, "2:3", nil)
	a := j.Start("node a", "")
	a.WaitFor(hostsStore, 30*time.Second)
	b, c := j.Start("node b", ""), j.Start("node c", "")
	var seen time.Time
	for _, n := range []*launchtest.Node{a, b, c} {
		if at := n.WaitFor(regexp.MustCompile(`elastic: epoch 0: .*world size 0 -> 3`), time.Minute); at.After(seen) {
			seen = at
		}
	}
	launchtest.WaitAny(t, stepAtLeast(10), a, b, c) // rank 0 prints the steps: any of them
	killed := time.Now()
	c.Kill()
	for _, n := range []*launchtest.Node{a, b} {
		n.WaitFor(regexp.MustCompile(`elastic: epoch 1: .*left: node .*rank \d of epoch 0\); joined: none; world size 3 -> 2; resuming from step \d+; pause`), time.Minute)
		wantCRCOf(t, n, want)
	}
	next, _, ok := launchtest.StepAfterResume(a, b)
	if !ok {
		t.Fatalf("no step after the change:\n%s\n%s", a.Output(), b.Output())
	}
	t.Logf("pause from the kill to the next step: %v", next.Sub(killed).Round(time.Millisecond))
}

// TestElasticGainNode: two nodes (--nnodes 2:3) train; a third starts once they are past
// step 10, is let in at a step boundary with the state of a survivor, and all three end
// with the crc of one process.
func TestElasticGainNode(t *testing.T) {
	want := uninterrupted(t, elasticArgs)
	j := newElasticJob(t, "2:3", nil)
	a := j.Start("node a", "")
	a.WaitFor(hostsStore, 30*time.Second)
	b := j.Start("node b", "")
	launchtest.WaitAny(t, stepAtLeast(10), a, b)
	started := time.Now()
	c := j.Start("node c", "")
	for _, n := range []*launchtest.Node{a, b, c} {
		n.WaitFor(regexp.MustCompile(`elastic: epoch 1: 1 process\(es\) waiting to join at step \d+; left: none; joined: node .*; world size 2 -> 3; resuming from step \d+`), time.Minute)
	}
	for _, n := range []*launchtest.Node{a, b, c} {
		wantCRCOf(t, n, want)
	}
	after, before, ok := launchtest.StepAfterResume(a, b, c)
	if !ok {
		t.Fatalf("no step after the change:\n%s", a.Output())
	}
	t.Logf("pause between the last step of 2 nodes and the first of 3: %v (the joiner started %v before it)",
		after.Sub(before).Round(time.Millisecond), after.Sub(started).Round(time.Millisecond))
}

// TestElasticRefusals: a world the shards do not fit is refused at start, naming the sizes
// that work; a node left below --nnodes MIN waits --rdzv_timeout, then fails naming the
// nodes lost; a node with another model is refused when it tries to join, naming the
// difference, and the job goes on; a rank stopped past the heartbeat timeout (a silent
// host) is dropped, the others go on, and when it wakes it is refused as a stale member
// of an old epoch.
func TestElasticRefusals(t *testing.T) {
	want := uninterrupted(t, elasticArgs)
	t.Run("shards", func(t *testing.T) {
		j := newElasticJob(t, "1:1", nil)
		n := j.Start("node", "", "--nproc_per_node", "4")
		err := n.Wait(time.Minute)
		const msg = "no world size from 4 to 4 processes (1:1 nodes × 4) divides the 6 shards of a step; the world sizes that work are 1, 2, 3, 6"
		if err == nil || !strings.Contains(n.Output(), msg) {
			t.Fatalf("ddprun: %v; want a failure saying %q:\n%s", err, msg, n.Output())
		}
	})
	t.Run("model", func(t *testing.T) {
		j := newElasticJob(t, "2:3", nil)
		a := j.Start("node a", "")
		a.WaitFor(hostsStore, 30*time.Second)
		b := j.Start("node b", "")
		launchtest.WaitAny(t, stepAtLeast(5), a, b)
		odd := j.Start("odd node", strings.Replace(elasticArgs, "--hidden_size 16", "--hidden_size 32", 1))
		err := odd.Wait(time.Minute)
		const msg = `cannot join: its model or settings differ from the job's: this process has "tensor w1 [32 4]" where the job has "tensor w1 [16 4]"`
		if err == nil || !strings.Contains(odd.Output(), msg) {
			t.Fatalf("the odd node: ddprun: %v; want a failure saying %q:\n%s", err, msg, odd.Output())
		}
		wantCRCOf(t, a, want)
		wantCRCOf(t, b, want)
		if strings.Contains(a.Output()+b.Output(), "elastic: epoch 1") {
			t.Errorf("the job changed for a node it refused:\n%s", a.Output())
		}
	})
	t.Run("below min", func(t *testing.T) {
		j := newElasticJob(t, "2:3", nil)
		a := j.Start("node a", "", "--rdzv_timeout", "3s")
		a.WaitFor(hostsStore, 30*time.Second)
		b := j.Start("node b", "", "--rdzv_timeout", "3s")
		launchtest.WaitAny(t, stepAtLeast(5), a, b)
		b.Kill()
		err := a.Wait(time.Minute)
		lost := regexp.MustCompile(`elastic: round 1: 1 of at least 2 processes \(2 nodes × 1\) arrived within 3s \(--rdzv_timeout\); lost: node \S+ \(host [^,]+, rank \d of epoch 0\)`)
		if err == nil || !lost.MatchString(a.Output()) {
			t.Fatalf("the node left alone: ddprun: %v; want a failure matching %q:\n%s", err, lost, a.Output())
		}
	})
	t.Run("stale", func(t *testing.T) {
		hb := []string{"GODDP_ELASTIC_HEARTBEAT=200ms", "GODDP_ELASTIC_HEARTBEAT_TIMEOUT=1s"}
		j := newElasticJob(t, "2:3", hb)
		a := j.Start("node a", "")
		a.WaitFor(hostsStore, 30*time.Second)
		b, c := j.Start("node b", ""), j.Start("node c", "")
		launchtest.WaitAny(t, stepAtLeast(8), a, b, c)
		pid := launchtest.RankPID(t, c)
		syscall.Kill(pid, syscall.SIGSTOP)
		for _, n := range []*launchtest.Node{a, b} {
			n.WaitFor(regexp.MustCompile(`elastic: epoch 1: rank \d \(node .*\) sent no heartbeat for .*; world size 3 -> 2`), time.Minute)
		}
		syscall.Kill(pid, syscall.SIGCONT)
		err := c.Wait(time.Minute)
		stale := regexp.MustCompile(`elastic: node \S+ \(host [^,]+, rank \d of epoch 0\) was dropped from the job: epoch 1 formed without it`)
		if err == nil || !stale.MatchString(c.Output()) {
			t.Fatalf("the stopped node: ddprun: %v; want a failure matching %q:\n%s", err, stale, c.Output())
		}
		wantCRCOf(t, a, want)
		wantCRCOf(t, b, want)
	})
}

// TestElasticChaos: 200 steps of a job of 1 to 3 nodes, with a node killed (SIGKILL) or
// started every 20 to 40 steps at random, never the store's host, the last by step 180
// (a node started a few steps before the end finds the job finished, and says so). The
// nodes that are left end with the crc of one process, and the steps kept (each epoch's
// steps up to the step the next one resumed from) are 0 to 199, each once.
func TestElasticChaos(t *testing.T) {
	args := strings.Replace(elasticArgs, "--steps 40", "--steps 200", 1)
	want := uninterrupted(t, args)
	j := newElasticJob(t, "1:3", nil)
	j.SetArgs(args)
	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	t.Logf("seed %d", seed)
	a := j.Start("node 0", "")
	a.WaitFor(hostsStore, 30*time.Second)
	live := []*launchtest.Node{a, j.Start("node 1", ""), j.Start("node 2", "")}
	all := append([]*launchtest.Node(nil), live...)
	at, changes := 0, map[string]int{}
	for at < 140 {
		at += 20 + rng.IntN(21)
		launchtest.WaitAny(t, stepAtLeast(at), all...)
		kill := len(live) == 3 || (len(live) > 1 && rng.IntN(2) == 0)
		if kill {
			i := 1 + rng.IntN(len(live)-1)
			live[i].Kill()
			live = append(live[:i], live[i+1:]...)
			changes["kill"]++
		} else {
			n := j.Start(fmt.Sprintf("node %d", len(all)), "")
			live, all = append(live, n), append(all, n)
			changes["join"]++
		}
		t.Logf("step %d: %v, %d nodes", at, map[bool]string{true: "kill", false: "join"}[kill], len(live))
	}
	for _, n := range live {
		wantCRCOf(t, n, want)
	}
	kept := launchtest.KeptSteps(all...)
	for i, s := range kept {
		if s != i {
			t.Fatalf("the steps kept are %v; want 0 to 199 once each", kept)
		}
	}
	if len(kept) != 200 {
		t.Fatalf("%d steps kept, want 200: %v", len(kept), kept)
	}
	t.Logf("changes: %v; every step of 0-199 kept once", changes)
}

// TestElasticPowerSGDLoseNode: TestElasticLoseNode under --comm_hook powersgd: the hook
// reduces the shards, and each member's error feedback and the shared factors are
// committed with the state; when the third node is killed at step 10, the two others
// form epoch 1 from their own copies (Note [Elastic per-rank state]), keep training
// (the mean loss of steps 30-39 is below half that of steps 0-4), and end agreeing, bit
// for bit.
func TestElasticPowerSGDLoseNode(t *testing.T) {
	args := elasticArgs + " --comm_hook powersgd --powersgd_rank 1"
	a, b, c := loseThird(t, args)
	restored := regexp.MustCompile(`(?m)^\[local0\]: mlp: --comm_hook powersgd: its state restored from (\d) of the (\d) members' copies$`)
	var said [][]string // rank 0's lines, on whichever node it was in each epoch
	for _, n := range []*launchtest.Node{a, b, c} {
		for _, m := range restored.FindAllStringSubmatch(n.Output(), -1) {
			said = append(said, m[1:])
		}
	}
	has := func(kept, world string) bool {
		return slices.ContainsFunc(said, func(s []string) bool { return s[0] == kept && s[1] == world })
	}
	if len(said) != 2 || !has("0", "3") || !has("2", "2") {
		t.Errorf("want epoch 0 restored from 0 of 3 members' copies and epoch 1 from 2 of 2: %v", said)
	}
	losses := map[int]float64{}
	lossLine := regexp.MustCompile(`(?m)^\[local0\]: step (\d+) loss ([0-9.e+-]+)$`)
	for _, n := range []*launchtest.Node{a, b, c} {
		for _, m := range lossLine.FindAllStringSubmatch(n.Output(), -1) {
			s, _ := strconv.Atoi(m[1])
			l, _ := strconv.ParseFloat(m[2], 64)
			losses[s] = l
		}
	}
	mean := func(from, to int) float64 {
		var sum float64
		for s := from; s <= to; s++ {
			l, ok := losses[s]
			if !ok || math.IsNaN(l) {
				t.Fatalf("no finite loss of step %d: %v", s, losses)
			}
			sum += l
		}
		return sum / float64(to-from+1)
	}
	early, late := mean(0, 4), mean(30, 39)
	t.Logf("mean loss: steps 0-4 %.5f, steps 30-39 %.5f (the kill at step 10)", early, late)
	if !(late < early/2) {
		t.Errorf("the loss did not fall across the change: steps 0-4 %.5f, steps 30-39 %.5f: %v", early, late, losses)
	}
}

// TestElasticAutoLoseNode: under --comm_hook auto, 3 nodes decide after 3 synced steps and
// commit the decision with the state; when the third node is killed at step 10, the next
// epoch's hooks take the decision over from the survivors' copies instead of measuring
// again (its rank 0 says so at the end), and the survivors end with the same parameters.
func TestElasticAutoLoseNode(t *testing.T) {
	args := elasticArgs + " --comm_hook auto"
	a, b, _ := loseThird(t, args)
	// Rank 0 of the last epoch prints its plan: the decision taken over, not a new one.
	out := a.Output() + b.Output()
	if strings.Count(out, "auto decision restored from the saved state") != 1 || strings.Contains(out, "auto hook after 3 synced steps") {
		t.Errorf("epoch 1 did not take the decision over:\n%s\n%s", a.Output(), b.Output())
	}
}

// loseThird runs a job of 3 nodes of args, kills the third at step 10, and waits for the
// two others to form epoch 1 without it and to end with the same params_crc32.
func loseThird(t *testing.T, args string) (a, b, c *launchtest.Node) {
	t.Helper()
	j := newElasticJob(t, "2:3", nil)
	j.SetArgs(args)
	a = j.Start("node a", "")
	a.WaitFor(hostsStore, 30*time.Second)
	b, c = j.Start("node b", ""), j.Start("node c", "")
	launchtest.WaitAny(t, stepAtLeast(10), a, b, c)
	c.Kill()
	crcs := map[string]bool{}
	for _, n := range []*launchtest.Node{a, b} {
		n.WaitFor(regexp.MustCompile(`elastic: epoch 1: .*left: node .*; joined: none; world size 3 -> 2; resuming from step \d+`), time.Minute)
		if err := n.Wait(2 * time.Minute); err != nil {
			t.Fatalf("%s: ddprun: %v\n%s", n.Name, err, n.Output())
		}
		m := crcLine.FindStringSubmatch(n.Output())
		if m == nil {
			t.Fatalf("%s printed no params_crc32:\n%s", n.Name, n.Output())
		}
		crcs[m[1]] = true
	}
	if len(crcs) != 1 {
		t.Errorf("the survivors end with different parameters: %v\n%s\n%s", crcs, a.Output(), b.Output())
	}
	return a, b, c
}

// TestElasticPowerSGDOtherRank: a node whose --powersgd_rank differs from the job's is
// refused when it tries to join, naming both hooks, and the job goes on without it.
func TestElasticPowerSGDOtherRank(t *testing.T) {
	args := elasticArgs + " --comm_hook powersgd --powersgd_rank 1"
	j := newElasticJob(t, "2:3", nil)
	j.SetArgs(args)
	a := j.Start("node a", "")
	a.WaitFor(hostsStore, 30*time.Second)
	b := j.Start("node b", "")
	launchtest.WaitAny(t, stepAtLeast(5), a, b)
	odd := j.Start("odd node", strings.Replace(args, "--powersgd_rank 1", "--powersgd_rank 2", 1))
	err := odd.Wait(time.Minute)
	const msg = `cannot join: its model or settings differ from the job's: this process has "per-rank comm_hook powersgd(rank 2, min_compression_rate 2, start_iter 0, seed 1)" where the job has "per-rank comm_hook powersgd(rank 1, min_compression_rate 2, start_iter 0, seed 1)"`
	if err == nil || !strings.Contains(odd.Output(), msg) {
		t.Fatalf("the odd node: ddprun: %v; want a failure saying %q:\n%s", err, msg, odd.Output())
	}
	for _, n := range []*launchtest.Node{a, b} {
		if err := n.Wait(2 * time.Minute); err != nil {
			t.Fatalf("%s: ddprun: %v\n%s", n.Name, err, n.Output())
		}
	}
	if strings.Contains(a.Output()+b.Output(), "elastic: epoch 1") {
		t.Errorf("the job changed for a node it refused:\n%s", a.Output())
	}
}
