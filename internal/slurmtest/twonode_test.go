package slurmtest

import (
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/goddp/goddp/internal/testbed"
)

// twoNodes is a SLURM cluster of two nodes, tb0 and tb1, each a host of a testbed (a
// network namespace of its own): slurmctld and tb0's slurmd on host 0, tb1's slurmd on
// host 1, with a munged of its own. srun runs on host 0, as on a login node of the
// cluster's network.
type twoNodes struct {
	tb   *testbed.Testbed
	ns   [2]string // the hosts' namespaces
	dir  string
	conf string
}

// netns runs name with args in host h's network namespace, keeping this process's mounts
// (ip netns exec remounts /sys, which hides the cgroup file system slurmd wants).
func (c *twoNodes) netns(h int, name string, args ...string) []string {
	return append([]string{"nsenter", "--net=/var/run/netns/" + c.ns[h], name}, args...)
}

func (c *twoNodes) run(t *testing.T, timeout time.Duration, h int, env []string, name string, args ...string) (string, error) {
	t.Helper()
	argv := c.netns(h, name, args...)
	return command(timeout, bin, env, argv[0], argv[1:]...)
}

// env is jobEnv's, with this cluster's SLURM_CONF (the last value wins).
func (c *twoNodes) env(withToken bool, extra ...string) []string {
	return append(jobEnv(withToken, extra...), "SLURM_CONF="+c.conf)
}

// startTwoNodes brings the cluster up, or skips the test saying why it cannot be had.
func startTwoNodes(t *testing.T) *twoNodes {
	t.Helper()
	need(t)
	if _, err := exec.LookPath("nsenter"); err != nil {
		t.Skip("nsenter not found (util-linux): slurmd runs in each testbed host's network namespace through it")
	}
	b := make([]byte, 3)
	rand.Read(b)
	name := fmt.Sprintf("sl%x", b)
	tb, err := testbed.New(testbed.Options{Hosts: 2, Name: name})
	if errors.Is(err, testbed.ErrUnavailable) {
		t.Skipf("no testbed for two nodes: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	c := &twoNodes{tb: tb, ns: [2]string{name + "-h0", name + "-h1"}}
	t.Cleanup(func() {
		if err := tb.Close(); err != nil {
			t.Errorf("testbed: %v", err)
		}
	})
	// munged must reach its key through the directory: 0755, not t.TempDir's 0700.
	if c.dir, err = os.MkdirTemp("", "slurmtest-2n-"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(c.dir) })
	for _, d := range []string{"state", "spool", "log", "munge"} {
		if err := os.MkdirAll(filepath.Join(c.dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(c.dir, 0o755)
	key := make([]byte, 1024)
	rand.Read(key)
	mdir := filepath.Join(c.dir, "munge")
	if err := os.WriteFile(filepath.Join(mdir, "munge.key"), key, 0o400); err != nil {
		t.Fatal(err)
	}
	if out, err := command(time.Minute, "", nil, "chown", "-R", "munge:munge", mdir); err != nil {
		t.Fatalf("chown munge: %v\n%s", err, out)
	}
	sock := filepath.Join(mdir, "munge.socket")
	// The daemons, by the pid files they write, stopped at the end whatever happens.
	pidFiles := []string{"slurmd-tb1.pid", "slurmd-tb0.pid", "slurmctld.pid", "munge/munged.pid"}
	t.Cleanup(func() {
		if c.conf != "" {
			argv := c.netns(0, "scancel", "--user=root")
			if out, err := command(time.Minute, "", c.env(false), argv[0], argv[1:]...); err != nil {
				t.Logf("scancel: %v %s", err, out)
			}
		}
		for _, f := range pidFiles {
			stopPidFile(t, filepath.Join(c.dir, f))
		}
	})
	if out, err := command(time.Minute, "", nil, "runuser", "-u", "munge", "--", "munged", "--socket="+sock,
		"--key-file="+filepath.Join(mdir, "munge.key"), "--pid-file="+filepath.Join(mdir, "munged.pid"),
		"--seed-file="+filepath.Join(mdir, "munged.seed"), "--log-file="+filepath.Join(mdir, "munged.log")); err != nil {
		t.Fatalf("munged: %v\n%s", err, out)
	}
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	host, _, _ = strings.Cut(host, ".")
	var nodes string
	for h := range 2 {
		// Both namespaces are this machine: the CPUs are its own, counted for each node.
		nodes += fmt.Sprintf("NodeName=tb%d NodeAddr=%s CPUs=2 State=UNKNOWN\n", h, tb.Addr(h))
	}
	c.conf = filepath.Join(c.dir, "slurm.conf")
	conf := `ClusterName=goddp2n
SlurmctldHost=` + host + `(` + tb.Addr(0) + `)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=` + sock + `
StateSaveLocation=` + c.dir + `/state
SlurmdSpoolDir=` + c.dir + `/spool/%n
SlurmctldPidFile=` + c.dir + `/slurmctld.pid
SlurmdPidFile=` + c.dir + `/slurmd-%n.pid
SlurmctldLogFile=` + c.dir + `/log/slurmctld.log
SlurmdLogFile=` + c.dir + `/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=5
` + nodes + `PartitionName=debug Nodes=tb0,tb1 Default=YES MaxTime=INFINITE State=UP
`
	if err := os.WriteFile(c.conf, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	env := c.env(false)
	if out, err := c.run(t, time.Minute, 0, env, "slurmctld", "-f", c.conf); err != nil {
		t.Fatalf("slurmctld: %v\n%s", err, out)
	}
	waitFor(t, "scontrol ping to say UP", func() bool {
		out, _ := c.run(t, 10*time.Second, 0, env, "scontrol", "ping")
		return strings.Contains(out, "is UP")
	}, c.dir)
	for h := range 2 {
		if out, err := c.run(t, time.Minute, h, env, "slurmd", "-f", c.conf, "-N", "tb"+strconv.Itoa(h)); err != nil {
			t.Fatalf("slurmd tb%d: %v\n%s", h, err, out)
		}
	}
	waitFor(t, "sinfo to show tb0 and tb1 idle", func() bool {
		out, _ := c.run(t, 10*time.Second, 0, env, "sinfo", "-h", "-N", "-o", "%N %t")
		return strings.Contains(out, "tb0 idle") && strings.Contains(out, "tb1 idle")
	}, c.dir)
	return c
}

// waitFor polls ok every 200 ms for up to 30 s, failing the test (with the daemons' logs'
// last lines) if it never holds.
func waitFor(t *testing.T, what string, ok func() bool, dir string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			logs, _ := filepath.Glob(filepath.Join(dir, "log", "*.log"))
			var tails []string
			for _, l := range logs {
				b, _ := os.ReadFile(l)
				lines := strings.Split(strings.TrimSpace(string(b)), "\n")
				tails = append(tails, l+":\n"+strings.Join(lines[max(0, len(lines)-5):], "\n"))
			}
			t.Fatalf("gave up after 30s waiting for %s\n%s", what, strings.Join(tails, "\n"))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// stopPidFile ends the process a pid file names: SIGTERM, SIGKILL after 15 s.
func stopPidFile(t *testing.T, file string) {
	b, err := os.ReadFile(file)
	if err != nil {
		return
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return
	}
	if syscall.Kill(pid, syscall.SIGTERM) != nil {
		return
	}
	deadline := time.Now().Add(15 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Logf("%s: pid %d killed after 15s", file, pid)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestSrunTwoNodes: one job across two testbed hosts, a slurmd on each, srun -N2 with one
// task a node and then two, of both examples: every rank ends at the params_crc32 of the
// same job on one host under ddprun. Without GODDP_TOKEN the ranks refuse to start (a job
// across hosts must not use the public development token), naming the variable.
//
// MASTER_ADDR is host 0's address: the testbed's node names (tb0, tb1) are SLURM's alone
// and do not resolve, which a cluster's node names do.
func TestSrunTwoNodes(t *testing.T) {
	c := startTwoNodes(t)
	master := "MASTER_ADDR=" + c.tb.Addr(0)
	mlp := filepath.Join(bin, "mlp")
	t.Run("no token", func(t *testing.T) {
		out, err := c.run(t, 2*time.Minute, 0, c.env(false, master), "srun", "-l", "-N2", "--ntasks-per-node", "1", mlp, strings.Fields(mlpFlags)[0], strings.Fields(mlpFlags)[1])
		if err == nil {
			t.Fatalf("srun -N2 without GODDP_TOKEN succeeded:\n%s", out)
		}
		for r := range 2 {
			want := fmt.Sprintf("%d: mlp: ddp: init: procgroup: rendezvous rank %d: no job token: this job spans hosts (WORLD_SIZE=2, LOCAL_WORLD_SIZE=1)", r, r)
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
		}
		if !strings.Contains(out, "set GODDP_TOKEN") {
			t.Errorf("the refusal does not say to set GODDP_TOKEN:\n%s", out)
		}
		t.Logf("srun -N2 without a token: %s", firstLine(out, "no job token"))
	})
	for _, tc := range []struct{ trainer, flags string }{{"mlp", mlpFlags}, {"transformer", transformerFlags}} {
		for _, perNode := range []int{1, 2} {
			n := 2 * perNode
			t.Run(fmt.Sprintf("%s/%d per node", tc.trainer, perNode), func(t *testing.T) {
				want := ddprunCRC32(t, tc.trainer, n, tc.flags)
				args := append([]string{"-l", "-N2", "--ntasks-per-node", strconv.Itoa(perNode), filepath.Join(bin, tc.trainer)}, strings.Fields(tc.flags)...)
				out, err := c.run(t, 2*time.Minute, 0, c.env(true, master), "srun", args...)
				if err != nil {
					t.Fatalf("srun %s: %v\n%s", strings.Join(args, " "), err, out)
				}
				got := agreedCRC(t, "srun -N2", out, srunCRC, n)
				if got != want {
					t.Errorf("srun -N2 --ntasks-per-node %d: params_crc32=%s; ddprun --nproc_per_node %d on one host: %s", perNode, got, n, want)
				} else {
					t.Logf("srun -N2 --ntasks-per-node %d %s: %d ranks on tb0 and tb1 at params_crc32=%s, as ddprun on one host", perNode, tc.trainer, n, got)
				}
				noPublicToken(t, "srun -N2", out)
			})
		}
	}
}

// firstLine returns the first line of out that holds s.
func firstLine(out, s string) string {
	for l := range strings.Lines(out) {
		if strings.Contains(l, s) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}
