#!/usr/bin/python3
"""torch_elastic_mlp.py -- PyTorch's peer of examples/mlp for the elastic comparison.

The same network (4 inputs, a tanh hidden layer, one output), plain SGD and a fixed global
batch, as a PyTorch DDP trainer (gloo, CPU) under torchrun's elastic agent:

  torchrun --nnodes 2:3 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:29400 \\
      --max_restarts 3 scripts/torch_elastic_mlp.py --checkpoint_dir ckpt --steps 40

torchrun restarts every worker when a node leaves or joins, so the trainer checkpoints after
every step (rank 0, atomically: a temporary file, then a rename) and resumes from the newest
checkpoint when it starts. The global batch (--global_batch_size) is split over the world
size, so each rank's share changes with it; the loss curve is comparable, the bits are not
(DDP averages per-rank means, in the order the ring gives).

Rank 0 prints "step N loss X" after each step, and "resumed from step S" after a restart;
scripts/elastic_side_by_side.py reads them.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def batch(seed, step, n):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.rand(n, 4, generator=g) * 2 - 1
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--global_batch_size", type=int, default=24)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--step_time", type=float, default=0.05, help="seconds a step takes at least")
    ap.add_argument("--checkpoint_dir", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.global_batch_size % world:
        raise SystemExit(f"--global_batch_size {a.global_batch_size} does not split over {world} ranks")
    torch.manual_seed(a.seed)
    model = nn.Sequential(nn.Linear(4, a.hidden), nn.Tanh(), nn.Linear(a.hidden, 1))
    start = 0
    path = os.path.join(a.checkpoint_dir, "latest.pt")
    if os.path.exists(path):
        ck = torch.load(path)
        model.load_state_dict(ck["model"])
        start = ck["step"]
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    per = a.global_batch_size // world
    for step in range(start, a.steps):
        t0 = time.time()
        x, y = batch(a.seed, step, a.global_batch_size)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        l = loss.detach().clone()
        dist.all_reduce(l)
        if rank == 0:
            print(f"step {step} loss {l.item() / world:.6f}", flush=True)
            os.makedirs(a.checkpoint_dir, exist_ok=True)
            tmp = path + ".tmp"
            torch.save({"model": model.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, path)
        dist.barrier()
        left = a.step_time - (time.time() - t0)
        if left > 0:
            time.sleep(left)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
