#!/usr/bin/python3
"""torch_convergence.py -- PyTorch's side of scripts/convergence.sh.

One run of a convergence task under PyTorch DDP on gloo, 2 processes (torch.multiprocessing
on 127.0.0.1), with one of PyTorch 1.13's comm hooks; rank 0 prints "step N loss L" for
every step, L the mean of the ranks' losses (the global batch's), as goddp's trainers do.

Tasks (the shapes, optimizer, lr and initialisation of goddp's; the data in the same
spirit, not the same bits):
  copy     Embedding(32, 128) -> TransformerEncoder(2 post-norm layers, d_model 128, 8 heads,
           feed-forward 512, ReLU, no dropout) -> Linear(128, 32); cross-entropy against the
           input tokens, 32 uniform tokens per sample, 8 samples per rank; AdamW lr 1e-3
  teacher  x ~ N(0, 1)^32; y = V tanh(A x + c) (16 outputs), a fixed teacher of 16 hidden
           units (A, V from N(0, 1/fan-in), c from N(0, 0.01), the same for every seed);
           the student Linear(32, 64) -> tanh -> Linear(64, 16), W ~ N(0, 1/fan-in),
           biases 0; loss: half the squared error summed over the outputs, averaged over
           the samples; 32 samples per rank; SGD lr 0.05
Hooks: none; fp16 (default_hooks.fp16_compress_hook); powersgd-rR (powerSGD_hook with
matrix_approximation_rank R, start_powerSGD_iter 2, the least it takes with error feedback
and warm start, min_compression_rate 2); powersgd-rR-startK (start_powerSGD_iter K). DDP's
bucket_cap_mb is 25 (at 1, PowerSGD crashes gloo in 1.13). There is no bf16 hook on gloo.

--first_bucket_cap_mb sets dist._DEFAULT_FIRST_BUCKET_BYTES (PyTorch's 1 MiB by default),
which DDP 1.13 reads for its first bucket, at construction and at the rebuild: with two
buckets, powerSGD_hook on gloo aborts the copy task when compression starts
("op.preamble.length <= op.nbytes"); at 25 the model is one bucket and it runs.

  source /work/shared/bench/torch/env.sh   # optional here: BLAS and the loopback interface
  /usr/bin/python3 scripts/torch_convergence.py --task teacher --hook powersgd-r2 --seed 1
"""
import argparse
import os
import re
import socket
import sys

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, HIDDEN, LAYERS, SEQ, COPY_BATCH = 32, 128, 2, 32, 8
INPUTS, OUTPUTS, STUDENT, TEACHER, TEACHER_BATCH = 32, 16, 64, 16, 32
TEACHER_SEED = 0x7EAC4E2


def parse_hook(h):
    """(kind, rank, start) of a hook token."""
    if h in ("none", "fp16"):
        return h, 0, 0
    m = re.fullmatch(r"powersgd-r(\d+)(?:-start(\d+))?", h)
    if not m:
        raise ValueError(f"--hook {h!r}: want none, fp16, powersgd-rR or powersgd-rR-startK")
    rank, start = int(m.group(1)), int(m.group(2) or 2)
    if rank < 1 or start < 2:
        raise ValueError(f"--hook {h!r}: want a rank of 1 or more and start_powerSGD_iter 2 or more")
    return "powersgd", rank, start


def copy_model():
    layer = nn.TransformerEncoderLayer(HIDDEN, 8, 4 * HIDDEN, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.Embedding(VOCAB, HIDDEN), nn.TransformerEncoder(layer, LAYERS), nn.Linear(HIDDEN, VOCAB))


def teacher_model():
    m = nn.Sequential(nn.Linear(INPUTS, STUDENT), nn.Tanh(), nn.Linear(STUDENT, OUTPUTS))
    with torch.no_grad():
        for lin in (m[0], m[2]):
            lin.weight.normal_(0, lin.in_features ** -0.5)
            lin.bias.zero_()
    return m


def the_teacher():
    g = torch.Generator().manual_seed(TEACHER_SEED)
    a = torch.randn(TEACHER, INPUTS, generator=g, dtype=torch.float64) / INPUTS ** 0.5
    c = 0.1 * torch.randn(TEACHER, generator=g, dtype=torch.float64)
    v = torch.randn(OUTPUTS, TEACHER, generator=g, dtype=torch.float64) / TEACHER ** 0.5
    return a, c, v


def batch(task, seed, step, rank, teacher):
    """This rank's batch of a step: a function of (seed, step, rank) only."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 8 + rank)
    if task == "copy":
        x = torch.randint(0, VOCAB, (COPY_BATCH, SEQ), generator=g)
        return x, x
    a, c, v = teacher
    x = torch.randn(TEACHER_BATCH, INPUTS, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ a.T + c) @ v.T
    return x.float(), y.float()


def loss_of(task, model, x, y):
    out = model(x)
    if task == "copy":
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return 0.5 * F.mse_loss(out, y, reduction="sum") / y.shape[0]


def worker(rank, world, port, args):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(args.first_bucket_cap_mb * 1024 * 1024)
    torch.manual_seed(args.seed)  # the initial parameters; DDP copies rank 0's
    model = copy_model() if args.task == "copy" else teacher_model()
    ddp = DDP(model, bucket_cap_mb=25)
    kind, prank, start = parse_hook(args.hook)
    if kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=prank,
                                            start_powerSGD_iter=start, min_compression_rate=2,
                                            random_seed=args.seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    if args.task == "copy":
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    teacher = the_teacher()
    for step in range(args.steps):
        x, y = batch(args.task, args.seed, step, rank, teacher)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(args.task, ddp, x, y)
        loss.backward()
        opt.step()
        lb = loss.detach().clone()
        dist.all_reduce(lb)
        if rank == 0:
            print(f"step {step} loss {lb.item() / world:.6f}", flush=True)
    dist.barrier()
    # Leave without destroy_process_group or the interpreter's teardown: in one run of 30
    # (torch 1.13, Python 3.11) a rank hung there after its last step, at no CPU cost to
    # the steps, until killed.
    sys.stdout.flush()
    os._exit(0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["copy", "teacher"], required=True)
    p.add_argument("--hook", default="none")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--first_bucket_cap_mb", type=float, default=1.0)
    args = p.parse_args()
    try:
        parse_hook(args.hook)
    except ValueError as e:
        sys.exit(f"torch_convergence.py: {e}")
    if not args.first_bucket_cap_mb > 0:
        sys.exit(f"torch_convergence.py: --first_bucket_cap_mb {args.first_bucket_cap_mb}: want a positive size")
    if args.steps < 1:
        sys.exit(f"torch_convergence.py: --steps {args.steps}: want 1 or more")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
