#!/usr/bin/python3
"""torch_zero.py -- PyTorch's ZeroRedundancyOptimizer(AdamW) under DDP against plain AdamW.

The peer of examples/transformer --zero on PyTorch 1.13 over gloo on the CPU: the same
shape (Linear(h,h) -> TransformerEncoder(L layers, d_model h, 8 heads, feed-forward 4h,
dropout 0.1, batch_first) -> Linear(h,h), MSE against a random target, per-rank batch 8 of
64 tokens, AdamW lr 1e-4), wrapped in DDP(bucket_cap_mb=25). --optim adamw steps
torch.optim.AdamW on every rank; --optim zero wraps it in
torch.distributed.optim.ZeroRedundancyOptimizer, which keeps each rank's share of the
parameters' state and broadcasts the stepped parameters.

Each rank prints one line: the mean ms/step over the timed steps, its peak RSS
(getrusage ru_maxrss) and the bytes of AdamW's moments it holds (exp_avg and exp_avg_sq,
the tensors goddp's optimizer_state_bytes counts). Rank 0 then prints the max over ranks
of the mean ms/step.

  /usr/bin/python3 scripts/torch_zero.py --world_size 4 --num_layers 4 --hidden 512 --optim zero

Under torchrun (RANK and WORLD_SIZE set) it joins that group instead of spawning.
"""
import argparse
import datetime
import os
import resource
import socket
import time

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def model_of(args):
    torch.manual_seed(args.seed)
    h = args.hidden
    layer = nn.TransformerEncoderLayer(d_model=h, nhead=8, dim_feedforward=4 * h,
                                       dropout=0.1, batch_first=True)
    return nn.Sequential(nn.Linear(h, h), nn.TransformerEncoder(layer, num_layers=args.num_layers),
                         nn.Linear(h, h))


def moment_bytes(opt):
    """Bytes of AdamW's exp_avg and exp_avg_sq that this rank holds."""
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    n = 0
    for st in inner.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                n += st[k].numel() * st[k].element_size()
    return n


def blas():
    """The BLAS libraries this process has mapped."""
    with open("/proc/self/maps") as fh:
        return ",".join(sorted({l.split()[-1] for l in fh if "blas" in l})) or "none"


def train(rank, world, args):
    torch.set_num_threads(args.threads)
    model = DistributedDataParallel(model_of(args), bucket_cap_mb=25)
    if args.optim == "zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=g)
    y = torch.randn(args.batch, args.seq, args.hidden, generator=g)

    def step():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    ms = (time.perf_counter() - t0) / max(args.steps, 1) * 1e3
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    state = moment_bytes(opt)
    print(f"rank {rank} optim={args.optim} world={world} ms/step={ms:.2f} peak_rss_mb={rss:.1f} "
          f"optimizer_state_bytes={state}" + (f" blas={blas()}" if rank == 0 else ""), flush=True)
    worst = torch.tensor([ms], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"optim={args.optim} world={world} L={args.num_layers} h={args.hidden} "
              f"ms/step(max over ranks)={worst.item():.2f}", flush=True)


def worker(rank, world, port, args):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        train(rank, world, args)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optim", choices=["adamw", "zero"], default="zero")
    ap.add_argument("--world_size", type=int, default=2)
    ap.add_argument("--num_layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=600, help="the process group's timeout, seconds")
    args = ap.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo", init_method="env://",
                                timeout=datetime.timedelta(seconds=args.timeout))
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.barrier()
            dist.destroy_process_group()
        return
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(worker, args=(args.world_size, port, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
