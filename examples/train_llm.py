"""Train a small causal LM with DDP, with and without balancer's dispatch and micro-batching.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 examples/train_llm.py             # both, compared
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 examples/train_llm.py --mode balance

Single-controller pattern: every rank builds the same global batch per step
from a shared seed (Zipf or lognormal sequence lengths) and takes its share.

* ``--mode no-balance``: contiguous shares (what a loader deals), each cut in
  input order into micro-batches of at most ``--max-tokens`` tokens.
* ``--mode balance``: :func:`balancer.plan_dispatch` splits the global batch by
  :class:`balancer.TransformerCost` FLOPs of this model, then every rank cuts
  its share with :func:`balancer.plan_micro_batches` (same micro-batch count on
  every rank, one all-reduce).
* ``--mode compare`` (default): both, on the same batches from the same
  initial weights, step by step in alternating order (so noise on a shared
  machine hits both alike); the last line is the speedup.

Gradient accumulation over micro-batches with DDP ``no_sync`` on all but the
last. The loss is the global token mean: each micro-batch contributes
``W * sum(token losses) / global target tokens`` (DDP averages gradients over
``W``), exactly what :func:`balancer.global_weighted_mean_loss` computes, with
the global count known to every rank, so both modes follow the same loss
trajectory up to float32 summation order. Rank 0 prints per-step lines, one
``summary:`` line per mode, and (compare) ``speedup: ...``: of the step time
and of the slowest rank's compute (CPU time of its training thread, which
leaves out the wait in DDP's all-reduce). Where ranks share cores with each
other or with other work (a 2-core machine), the step time measures that
contention as much as the straggler; the slowest rank's compute is what one
device per rank would see.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llm_model import TinyCausalLM, token_losses  # noqa: E402

from balancer import TransformerCost, plan_dispatch, plan_micro_batches  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["compare", "balance", "no-balance"], default="compare")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per mode")
    p.add_argument("--global-batch", type=int, default=64, help="sequences per step, all ranks")
    p.add_argument("--dist", choices=["zipf", "lognormal"], default="zipf", help="sequence lengths")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget per micro-batch")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag, low in (("steps", 1), ("global_batch", 1), ("max_len", 2), ("vocab", 1), ("dim", 1), ("layers", 1),
                      ("heads", 1), ("kv_heads", 1)):
        if getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}, expected an int >= {low}")
    return args


def global_batch(args: argparse.Namespace, step: int) -> tuple[np.ndarray, list[torch.Tensor]]:
    """Lengths [G] and token sequences, identical on every rank (seeded by step)."""
    rng = np.random.default_rng([args.seed, step])
    g, top = args.global_batch, args.max_len
    if args.dist == "zipf":
        support = np.arange(2, top + 1, dtype=np.float64)
        p = support**-1.2
        lens = rng.choice(np.arange(2, top + 1), size=g, p=p / p.sum())
    else:
        lens = np.clip(np.rint(rng.lognormal(np.log(top / 8), 1.0, g)), 2, top).astype(np.int64)
    seqs = []
    for n in lens.tolist():
        # Learnable structure: each token is the previous one times 3 plus 1
        # (mod vocab), with 10 % noise.
        t = np.empty(n, np.int64)
        t[0] = rng.integers(args.vocab)
        noise = rng.random(n) < 0.1
        rand = rng.integers(args.vocab, size=n)
        for i in range(1, n):
            t[i] = rand[i] if noise[i] else (3 * t[i - 1] + 1) % args.vocab
        seqs.append(torch.from_numpy(t))
    return lens, seqs


def input_order_cut(lens: np.ndarray, share: list[int], max_tokens: int) -> list[list[int]]:
    """No balancing: consecutive samples until the budget is full."""
    out: list[list[int]] = [[]]
    used = 0
    for i in share:
        if out[-1] and used + lens[i] > max_tokens:
            out.append([])
            used = 0
        out[-1].append(i)
        used += int(lens[i])
    return out


class Trainer:
    """One model, optimizer and log; :meth:`step` trains one global batch in one mode."""

    def __init__(self, args: argparse.Namespace, balance: bool, rank: int, world: int) -> None:
        torch.manual_seed(args.seed)  # both modes start from the same weights
        model = TinyCausalLM(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, 4 * args.dim)
        self.cost = TransformerCost.from_hf_config(model.hf_config())
        self.ddp = DDP(model)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=args.lr)
        self.args, self.balance, self.rank, self.world = args, balance, rank, world
        self.name = "balance" if balance else "no-balance"
        self.log: dict[str, list[float]] = {
            k: [] for k in ("loss", "step_s", "slowest_s", "compute_imb", "model_imb", "tok_s")}

    def step(self, step: int, lens: np.ndarray, seqs: list[torch.Tensor]) -> None:
        args, rank, world, cost = self.args, self.rank, self.world, self.cost
        targets = float((lens - 1).sum())  # next-token targets in the global batch
        dist.barrier()
        t0 = time.perf_counter()
        g = len(lens)
        if self.balance:
            shares = plan_dispatch(lens, world, cost=cost).ranks
            share = shares[rank]
            plan = plan_micro_batches(lens[share], max_tokens=args.max_tokens, cost=cost)
            micro = [[share[i] for i in mb] for mb in plan.micro_batches]
        else:
            shares = [list(range(r * g // world, (r + 1) * g // world)) for r in range(world)]
            share = shares[rank]
            micro = input_order_cut(lens, share, args.max_tokens)
        local = torch.zeros(2, dtype=torch.float64)  # summed loss, compute seconds
        self.opt.zero_grad(set_to_none=True)
        # CPU time of this thread: the compute, without the wait for the slowest
        # rank inside DDP's gradient all-reduce (wall time would hide it).
        c0 = time.thread_time()
        for j, mb in enumerate(micro):
            tokens = torch.cat([seqs[i] for i in mb])
            ctx = self.ddp.no_sync() if j < len(micro) - 1 else nullcontext()
            with ctx:
                loss_sum = token_losses(self.ddp, tokens, [int(lens[i]) for i in mb])
                (loss_sum * (world / targets)).backward()  # global token mean under DDP's average
            local[0] += loss_sum.detach().double()
        local[1] = time.thread_time() - c0
        self.opt.step()
        loads = torch.zeros(world, dtype=torch.float64)
        loads[rank] = local[1]
        dist.all_reduce(local[:1])
        dist.all_reduce(loads)
        dt = time.perf_counter() - t0
        costs = cost.of_lengths(lens)
        model_loads = [float(costs[sh].sum()) for sh in shares]
        log = self.log
        log["loss"].append(float(local[0]) / targets)
        log["step_s"].append(dt)
        log["slowest_s"].append(float(loads.max()))
        log["compute_imb"].append(float(loads.max() / loads.mean()))
        log["model_imb"].append(max(model_loads) / (sum(model_loads) / len(model_loads)))
        log["tok_s"].append(float(lens.sum()) / dt)
        if rank == 0:
            print(f"[{self.name}] step {step + 1:3d}/{args.steps} loss {log['loss'][-1]:.8f} "
                  f"targets {int(targets)} step_ms {1e3 * dt:7.1f} micro_batches {len(micro)} "
                  f"imbalance(model) {log['model_imb'][-1]:.3f} imbalance(measured) "
                  f"{log['compute_imb'][-1]:.3f} slowest_rank_ms {1e3 * loads.max():7.1f} "
                  f"tokens/s {log['tok_s'][-1]:8.0f}", flush=True)

    def summary(self) -> str:
        log = self.log
        tail = slice(1, None) if len(log["step_s"]) > 1 else slice(None)  # step 1 warms up
        return (f"summary: mode={self.name} steps={self.args.steps} "
                f"mean_step_ms={1e3 * statistics.mean(log['step_s'][tail]):.1f} "
                f"mean_slowest_rank_ms={1e3 * statistics.mean(log['slowest_s'][tail]):.1f} "
                f"imbalance_model={statistics.mean(log['model_imb']):.3f} "
                f"imbalance_measured={statistics.mean(log['compute_imb'][tail]):.3f} "
                f"tokens_per_s={statistics.mean(log['tok_s'][tail]):.0f} "
                f"final_loss={log['loss'][-1]:.6f}")


def train(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Run the selected mode(s) on the initialised default process group; logs by mode."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise ValueError(f"--global-batch {args.global_batch} must be divisible by {world} ranks")
    modes = {"compare": [False, True], "balance": [True], "no-balance": [False]}[args.mode]
    trainers = [Trainer(args, balance, rank, world) for balance in modes]
    for step in range(args.steps):
        lens, seqs = global_batch(args, step)
        # Alternate which mode goes first, so machine noise hits both alike.
        for t in trainers[:: 1 if step % 2 == 0 else -1]:
            t.step(step, lens, seqs)
    if rank == 0:
        for t in trainers:
            print(t.summary(), flush=True)
    if rank == 0 and len(trainers) == 2:
        off, on = trainers[0].log, trainers[1].log
        tail = slice(1, None) if args.steps > 1 else slice(None)
        diff = max(abs(a - b) for a, b in zip(off["loss"], on["loss"], strict=True))
        print(f"loss_max_abs_diff: {diff:.3e}")
        speed = statistics.mean(off["step_s"][tail]) / statistics.mean(on["step_s"][tail])
        crit = statistics.mean(off["slowest_s"][tail]) / statistics.mean(on["slowest_s"][tail])
        print(f"speedup: {speed:.3f}x step time, {crit:.3f}x slowest-rank compute "
              "(no-balance / balance)", flush=True)
    return {t.name: t.log for t in trainers}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
