// Package slurmtest holds no code: its tests launch goddp's example trainers under a real
// SLURM cluster on this host, brought up by scripts/slurm.sh for the package's run and
// taken down after it (a cluster that was already up is used and left up). They run srun
// and sbatch as a cluster user does and check what the ranks end with against the same job
// under ddprun, a failed rank under srun --kill-on-bad-exit, and scancel of a running job.
// TestSrunTwoNodes makes a second cluster of its own, two nodes on the hosts of a testbed
// (internal/testbed, network namespaces), and runs one job across both.
//
// The tests skip, saying why, where SLURM cannot be had: its commands are missing
// (apt-get install --no-install-recommends slurm-wlm munge) or the tests do not run as
// root (slurm.sh runs the daemons as root); the two-node test also without a testbed (ip)
// or nsenter.
package slurmtest
