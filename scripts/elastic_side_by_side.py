#!/usr/bin/python3
"""elastic_side_by_side.py -- lose a node mid-run, goddp and PyTorch under torchrun, side by side.

Each round starts three nodes on this host, kills one (SIGKILL to its launcher's whole
process group: the launcher and its ranks, as a host that dies) once rank 0 has printed step
--kill_at, and times the pause: from the kill to the first step that the job completes
after it. goddp: three `ddprun --nnodes 2:3` nodes of examples/mlp with 6 logical shards;
the two left go on in a new epoch, with the state from memory. PyTorch 1.13: three
`torchrun --nnodes 2:3 --max_restarts 3` agents (c10d rendezvous) of
scripts/torch_elastic_mlp.py, which checkpoints every step; torchrun restarts every worker,
which resume from the checkpoint.

  GODDP_TOKEN=... python3 scripts/elastic_side_by_side.py --rounds 5 --csv out/elastic.csv

Builds bin/ddprun and bin/mlp first (go build). The CSV holds every round's steps with their
losses and times, for the loss curves; the summary line gives each side's median pause.
"""
import argparse
import csv
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEP = re.compile(r"step (\d+) loss ([-0-9.e]+)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One launcher, its output read line by line with the time each line came."""

    def __init__(self, argv, env):
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)
        self.lines = []
        self.t = threading.Thread(target=self.read, daemon=True)
        self.t.start()

    def read(self):
        for line in self.p.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def kill(self):
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout):
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.p.wait()


def steps(nodes):
    """Every step line of the nodes: (time, step, loss), in time order."""
    out = []
    for n in nodes:
        for t, l in list(n.lines):
            m = STEP.search(l)
            if m:
                out.append((t, int(m.group(1)), float(m.group(2))))
    return sorted(out)


def one_round(side, cmd, kill_at, timeout):
    """Runs three nodes of cmd(i), kills the third at step kill_at; returns the pause, the
    steps after the kill, the exit codes of the two left, and every step line."""
    nodes = [Node(cmd(0), os.environ.copy())]
    time.sleep(1.0)  # the first node hosts the store
    nodes += [Node(cmd(i), os.environ.copy()) for i in (1, 2)]
    end = time.time() + timeout
    while time.time() < end and not any(s >= kill_at for _, s, _ in steps(nodes)):
        time.sleep(0.01)
    killed = time.time()
    nodes[2].kill()
    codes = [n.wait(timeout) for n in nodes[:2]]
    nodes[2].wait(10)
    after = [(t, s) for t, s, _ in steps(nodes[:2]) if t > killed]
    # The pause: from the kill to the first step completed after the job went on (a step
    # line that follows one of the lines saying so).
    marks = [t for n in nodes[:2] for t, l in n.lines if t > killed and ("elastic: epoch" in l or "resumed from step" in l)]
    pause = None
    if marks:
        first = min(marks)
        later = [t for t, _ in after if t >= first - 0.5]
        if later:
            pause = min(later) - killed
    return pause, codes, steps(nodes), nodes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill_at", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--csv", default="")
    ap.add_argument("--sides", default="goddp,torch")
    a = ap.parse_args()
    if not os.environ.get("GODDP_TOKEN"):
        os.environ["GODDP_TOKEN"] = "side-by-side-" + os.urandom(16).hex()
    bindir = tempfile.mkdtemp(prefix="elastic-sbs-")
    for pkg in ("./cmd/ddprun", "./examples/mlp"):
        subprocess.run(["go", "build", "-o", bindir + "/", pkg], cwd=ROOT, check=True)
    mlp_args = ["--hidden_size", "16", "--global_batch_size", "24", "--micro_batch_size", "4", "--lr", "0.3",
                "--steps", str(a.steps), "--log_every", "1", "--step_time", "50ms"]
    rows, pauses = [], {}
    for r in range(a.rounds):
        for side in a.sides.split(","):
            port = free_port()
            ckpt = tempfile.mkdtemp(prefix="elastic-ckpt-")
            if side == "goddp":
                def cmd(i):
                    return [bindir + "/ddprun", "--nnodes", "2:3", "--rdzv_endpoint", f"127.0.0.1:{port}",
                            bindir + "/mlp", "--"] + mlp_args
            else:
                def cmd(i):
                    return ["torchrun", "--nnodes", "2:3", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                            "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"sbs{port}", "--max_restarts", "3",
                            "--monitor_interval", "0.1", "--redirects", "1", "--tee", "1", HERE + "/torch_elastic_mlp.py", "--checkpoint_dir", ckpt,
                            "--steps", str(a.steps), "--global_batch_size", "24", "--hidden", "16", "--lr", "0.3"]
            pause, codes, st, nodes = one_round(side, cmd, a.kill_at, a.timeout)
            last = max((s for _, s, _ in st), default=-1)
            ok = all(c == 0 for c in codes) and last == a.steps - 1
            print(f"round {r} {side}: pause {pause if pause is None else round(pause, 3)} s; exits {codes}; last step {last}; {'ok' if ok else 'FAILED'}", flush=True)
            if not ok:
                for n in nodes:
                    print("\n".join(l for _, l in n.lines[-15:]), file=sys.stderr)
            if pause is not None and ok:
                pauses.setdefault(side, []).append(pause)
            t0 = st[0][0] if st else 0
            rows += [(side, r, s, f"{t - t0:.3f}", l) for t, s, l in st]
    for side, ps in pauses.items():
        print(f"{side}: median pause {statistics.median(ps):.2f} s over {len(ps)} rounds (min {min(ps):.2f}, max {max(ps):.2f})")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["side", "round", "step", "t_s", "loss"])
            w.writerows(rows)


if __name__ == "__main__":
    main()
