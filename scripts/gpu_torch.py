#!/usr/bin/env python3
"""gpu_torch.py: the PyTorch side of scripts/gpu_check.sh, on NCCL at world size 1.

  gpu_torch.py mlp [--in 64 --hidden 256 --out 16 --batch 64 --steps 20 --bench_steps 50 --lr 0.01]
      examples/gpumlp's model (Linear-ReLU-Linear, ½·mean ‖y − t‖², plain SGD) wrapped in
      DistributedDataParallel on NCCL; prints ms/step over --bench_steps after --steps of
      warm-up, timed like gpumlp (a synchronize before and after).
  gpu_torch.py allreduce [--max_bytes 268435456]
      torch.distributed.all_reduce (float32 sum) on device tensors, 4 KiB to --max_bytes by
      4x, 5 warm-up and 20 timed iterations: the columns of goddp's device table.

Runs as a single process (it sets RANK/WORLD_SIZE/MASTER_* itself when they are unset).
"""
import argparse
import os
import sys
import time


def init():
    import torch
    import torch.distributed as dist

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not torch.cuda.is_available():
        sys.exit("gpu_torch.py: no CUDA device visible to PyTorch")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    return torch, dist


def mlp(a):
    torch, dist = init()
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda")
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(a.inp, a.hidden), torch.nn.ReLU(), torch.nn.Linear(a.hidden, a.out)
    ).to(dev)
    ddp = DDP(model, device_ids=[dev.index], bucket_cap_mb=25)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    world = dist.get_world_size()
    bl = a.batch // world
    x = torch.randn(a.samples, a.inp, device=dev)
    t = torch.randn(a.samples, a.out, device=dev)
    batches = a.samples // a.batch

    def step(s):
        row = (s % batches) * a.batch + dist.get_rank() * bl
        y = ddp(x[row : row + bl])
        loss = 0.5 * ((y - t[row : row + bl]) ** 2).sum(dim=1).mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return loss

    for s in range(a.steps):
        step(s)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(a.bench_steps):
        step(a.steps + s)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / max(a.bench_steps, 1)
    print(
        f"torch {torch.__version__} DDP nccl {'.'.join(map(str, torch.cuda.nccl.version()))}: "
        f"{ms:.3f} ms/step over {a.bench_steps} steps (world size {world}, batch {a.batch}, {a.inp}-{a.hidden}-{a.out})"
    )
    dist.destroy_process_group()


def allreduce(a):
    torch, dist = init()
    n = dist.get_world_size()
    print(f"# torch.distributed.all_reduce: torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {n} rank(s), float32 sum")
    print(f"{'size(B)':>12} {'count':>12} {'type':>8} {'time(us)':>10} {'algbw(GB/s)':>10} {'busbw(GB/s)':>10}")
    size = 4096
    while size <= a.max_bytes:
        buf = torch.ones(size // 4, dtype=torch.float32, device="cuda")
        for _ in range(5):
            dist.all_reduce(buf)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(buf)
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) * 1e6 / 20
        alg = size / us / 1e3
        bus = alg * (2 * (n - 1) / n if n > 1 else 1)
        print(f"{size:>12} {size // 4:>12} {'float':>8} {us:>10.2f} {alg:>10.3f} {bus:>10.3f}")
        size *= 4
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mlp")
    m.add_argument("--in", dest="inp", type=int, default=64)
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--out", type=int, default=16)
    m.add_argument("--batch", type=int, default=64)
    m.add_argument("--samples", type=int, default=1024)
    m.add_argument("--steps", type=int, default=20)
    m.add_argument("--bench_steps", type=int, default=50)
    m.add_argument("--lr", type=float, default=0.01)
    r = sub.add_parser("allreduce")
    r.add_argument("--max_bytes", type=int, default=256 << 20)
    a = p.parse_args()
    {"mlp": mlp, "allreduce": allreduce}[a.cmd](a)


if __name__ == "__main__":
    main()
