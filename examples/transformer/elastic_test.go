package main

import (
	"bytes"
	"context"
	"math"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/internal/launchtest"
)

// TestElasticLoseNode: the transformer (both tasks, dropout on) on three nodes (ddprun
// --nnodes 2:3); the third node's ddprun is killed with SIGKILL mid-run. The two others go
// on without a restart and end with the crc of one process that runs the same 6 shards.
func TestElasticLoseNode(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun and runs an elastic job")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	args := strings.Replace(shardArgs, "--bench_steps 4", "--bench_steps 400", 1)
	for _, task := range []string{"mse", "copy"} {
		t.Run(task, func(t *testing.T) {
			args := args + " --task " + task
			var out, errb bytes.Buffer
			if err := run(context.Background(), strings.Fields(args+" --no_ddp"), &out, &errb); err != nil {
				t.Fatalf("one process: %v\n%s", err, errb.String())
			}
			want := regexp.MustCompile(`params_crc32=[0-9a-f]{8}`).FindString(out.String())
			a, b, _ := loseThirdNode(t, exe, args)
			for _, n := range []*launchtest.Node{a, b} {
				if got := regexp.MustCompile(`\[local0\]: (params_crc32=[0-9a-f]{8})`).FindStringSubmatch(n.Output()); got == nil || got[1] != want {
					t.Fatalf("%s ends with %v; one process with the same 6 shards: %s\n%s", n.Name, got, want, n.Output())
				}
			}
			if strings.Contains(a.Output()+b.Output(), "step 399") == false {
				t.Errorf("the survivors did not run to the last step:\n%s", a.Output())
			}
		})
	}
}

// loseThirdNode runs the trainer with args on three nodes (ddprun --nnodes 2:3), kills
// the third's ddprun with SIGKILL once rank 0 is past step 20, and waits for the two
// others to form epoch 1 without it and to exit 0.
func loseThirdNode(t *testing.T, exe, args string) (a, b, c *launchtest.Node) {
	t.Helper()
	j := launchtest.NewElasticJob(t, exe, "2:3", []string{asMainEnv + "=1"}, args)
	a = j.Start("node a", "")
	a.WaitFor(regexp.MustCompile(`hosts the job's rendezvous store`), 30*time.Second)
	b, c = j.Start("node b", ""), j.Start("node c", "")
	launchtest.WaitAny(t, regexp.MustCompile(`^\[local0\]: step (2[0-9]|[3-9][0-9]) loss`), a, b, c)
	c.Kill()
	for _, n := range []*launchtest.Node{a, b} {
		n.WaitFor(regexp.MustCompile(`elastic: epoch 1: .*world size 3 -> 2; resuming from step \d+; pause`), time.Minute)
		if err := n.Wait(2 * time.Minute); err != nil {
			t.Fatalf("%s: ddprun: %v\n%s", n.Name, err, n.Output())
		}
	}
	return a, b, c
}

// TestElasticPowerSGDLoseNode: TestElasticLoseNode (the copy task) under --comm_hook
// powersgd: the hook reduces the shards, each member's error feedback and the shared
// factors are committed with the state and taken over by the next epoch's hook (Note
// [Elastic per-rank state]); the two survivors of a SIGKILL go on to the last step, end
// agreeing, bit for bit, and the loss keeps falling: the mean of the last 20 steps is
// below the mean of the first 20.
func TestElasticPowerSGDLoseNode(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun and runs an elastic job")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	args := strings.Replace(shardArgs, "--bench_steps 4", "--bench_steps 300", 1) + " --task copy --comm_hook powersgd --powersgd_rank 2"
	a, b, c := loseThirdNode(t, exe, args)
	survivorsAgree(t, a, b)
	losses := map[int]float64{}
	for _, n := range []*launchtest.Node{a, b, c} {
		for _, m := range regexp.MustCompile(`(?m)^\[local0\]: step (\d+) loss ([0-9.e+-]+)`).FindAllStringSubmatch(n.Output(), -1) {
			s, _ := strconv.Atoi(m[1])
			losses[s], _ = strconv.ParseFloat(m[2], 64)
		}
	}
	mean := func(from, to int) float64 {
		var sum float64
		for s := from; s <= to; s++ {
			l, ok := losses[s]
			if !ok || math.IsNaN(l) {
				t.Fatalf("no finite loss of step %d:\n%s", s, a.Output())
			}
			sum += l
		}
		return sum / float64(to-from+1)
	}
	early, late := mean(0, 19), mean(280, 299)
	t.Logf("mean loss: steps 0-19 %.4f, steps 280-299 %.4f", early, late)
	if !(late < early) {
		t.Errorf("the loss did not fall across the change: steps 0-19 %.4f, steps 280-299 %.4f", early, late)
	}
}

// TestElasticAutoLoseNode: TestElasticLoseNode under --comm_hook auto: epoch 0 decides after
// 3 synced steps and commits the decision with the state; after the SIGKILL the next
// epoch's hooks take it over from the survivors' copies instead of measuring again (rank 0
// prints the restored plan), and the survivors end agreeing, bit for bit.
func TestElasticAutoLoseNode(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun and runs an elastic job")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	args := strings.Replace(shardArgs, "--bench_steps 4", "--bench_steps 60", 1) + " --comm_hook auto"
	a, b, _ := loseThirdNode(t, exe, args)
	survivorsAgree(t, a, b)
	out := a.Output() + b.Output()
	if strings.Count(out, "auto decision restored from the saved state") != 1 || strings.Contains(out, "auto hook after 3 synced steps") {
		t.Errorf("epoch 1 did not take the decision over:\n%s\n%s", a.Output(), b.Output())
	}
}

// survivorsAgree checks that the nodes each printed one params_crc32, the same.
func survivorsAgree(t *testing.T, nodes ...*launchtest.Node) {
	t.Helper()
	crcs := map[string]bool{}
	for _, n := range nodes {
		got := regexp.MustCompile(`\[local0\]: (params_crc32=[0-9a-f]{8})`).FindStringSubmatch(n.Output())
		if got == nil {
			t.Fatalf("%s printed no params_crc32:\n%s", n.Name, n.Output())
		}
		crcs[got[1]] = true
	}
	if len(crcs) != 1 {
		t.Errorf("the survivors end with different parameters: %v", crcs)
	}
}
