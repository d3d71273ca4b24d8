"""LLM-style data parallelism with gradient accumulation, emulated on one device with real kernels.

One command (a GPU machine; ``--quick``: toy size on CPU, seconds)::

    .venv/bin/python benchmarks/bench_gpu_llm.py [--quick] [--json-out bench_out/gpu_llm.jsonl]

W virtual ranks share one device and take turns, as in ``bench_gpu.py``
(same model, packing and timer: ``_gpu_common``). Every step draws a global
batch of ``W x B`` Zipf(alpha) sequence lengths <= ``--max-len`` and splits it
the ways an RL / LLM trainer does, on the same batch and token ids:

* ``off``: contiguous shares of ``B`` (a data loader), each cut into
  micro-batches by verl's ``rearrange_micro_batches`` (KK into
  ``ceil(tokens / max_tokens)`` parts, one more until all fit);
* ``verl``: verl's DP split (equal-size KK on ``L^2 + 24576 L``), then the
  same micro-batches;
* ``kk:flops``: the same two KK steps on this model's own FLOPs cost
  (``TransformerCost``): verl's algorithm with the cost model balancer uses,
  which separates the algorithm's share of the difference from the cost's;
* ``balancer``: ``plan_dispatch(lengths, W, cost=TransformerCost(...),
  max_tokens=...)``: equal counts, the same micro-batch count on every rank;
* ``balancer:free``: the same with ``equal_count=False`` (token-budget
  dispatch: any number of samples per rank).

verl's micro-batches use each rank's own count (no agreement across ranks,
the cheapest for it); balancer's plan agrees on one count for all ranks.
Every micro-batch holds at most ``--max-tokens`` tokens (checked).

Each rank runs forward + backward of every one of its micro-batches,
accumulating gradients (one ``zero_grad`` per rank step), timed as one region
per rank: CUDA events on a GPU (a device sync only between regions), the
monotonic clock on CPU. Packing and host-to-device copies happen before the
region. Reported per configuration and mode, medians over the measured steps
(a warm-up step is dropped; the mode order rotates every step):

* **step ms**: the slowest rank's time (what everyone waits for at the
  gradient all-reduce); **speedup**: ``off``'s step time over this mode's;
  **vs verl**: ``verl``'s over this mode's;
* **straggler**: measured max/mean rank time; **predicted**: max/mean of
  the FLOPs cost per rank (what the cost model expects);
* **mb**: micro-batches on the busiest rank (largest count).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this checkout, also beside an editable install
from _e2e_common import sample_lengths  # noqa: E402
from _gpu_common import (  # noqa: E402
    VOCAB,
    Dims,
    RegionTimer,
    Transformer,
    build,
    dtype_for,
    pack,
)

from balancer import TransformerCost, plan_dispatch  # noqa: E402
from tests.llm_reference import kk_equal, verl_dispatch, verl_micro_batches  # noqa: E402

MODES = ("off", "verl", "kk:flops", "balancer", "balancer:free")


def split(mode: str, lengths: np.ndarray, world: int, max_tokens: int, flops: np.ndarray,
          cost: TransformerCost) -> list[list[list[int]]]:
    """Per rank, its micro-batches (lists of global sample indices)."""
    n = lengths.size
    if mode.startswith("balancer"):
        plan = plan_dispatch(lengths, world, cost=cost, max_tokens=max_tokens, equal_count=mode == "balancer")
        assert plan.micro_batches is not None
        return plan.micro_batches
    if mode == "off":
        shares = [list(range(r * n // world, (r + 1) * n // world)) for r in range(world)]
    elif mode == "verl":
        shares = verl_dispatch(lengths.tolist(), world)
    else:  # kk:flops
        shares = kk_equal(flops.tolist(), world)
    out = []
    for share in shares:
        local = verl_micro_batches(lengths[share].tolist(), max_tokens,
                                   workloads=flops[share].tolist() if mode == "kk:flops" else None)
        out.append([[share[i] for i in mb] for mb in local])
    return out


def run_config(model: Transformer, backend: str, device: torch.device, world: int, b: int,
               a: argparse.Namespace, cost: TransformerCost) -> dict[str, Any]:
    rng = np.random.default_rng(a.seed + 1000 * world + b)
    timer = RegionTimer(device)
    steps: list[dict[str, Any]] = []
    for step in range(a.steps + 1):  # step 0: warm-up, dropped
        lengths = sample_lengths("zipf", world * b, a.max_len, rng, a.alpha)
        ids = rng.integers(0, VOCAB, int(lengths.sum()))
        starts = np.concatenate([[0], np.cumsum(lengths)])
        labels = rng.integers(0, 2, lengths.size).astype(np.float32)
        flops = np.asarray(cost.of_lengths(lengths), np.float64)
        row: dict[str, Any] = {"step": step, "tokens": int(lengths.sum())}
        order = MODES[step % len(MODES):] + MODES[: step % len(MODES)]
        for mode in order:
            ranks = split(mode, lengths, world, a.max_tokens, flops, cost)
            assert sorted(i for r in ranks for mb in r for i in mb) == list(range(lengths.size)), mode
            packs = []
            for mbs in ranks:
                rank_packs = []
                for mb in mbs:
                    if not mb:
                        continue
                    idx = np.asarray(mb)
                    assert lengths[idx].sum() <= a.max_tokens, (mode, lengths[idx].sum())
                    tok = np.concatenate([ids[starts[i]:starts[i + 1]] for i in idx])
                    rank_packs.append(pack(lengths[idx], tok, labels[idx], device, backend == "loop"))
                packs.append(rank_packs)
            for rank_packs in packs:
                model.zero_grad(set_to_none=True)
                with timer.region(), torch.profiler.record_function("## bench_gpu_llm.rank ##"):
                    for p in rank_packs:
                        model(p, backend).backward()
            times = timer.read()
            loads = [float(flops[[i for mb in r for i in mb]].sum()) for r in ranks]
            row[mode] = {"rank_s": times, "step_s": max(times), "mean_s": statistics.fmean(times),
                         "predicted": max(loads) / statistics.fmean(loads),
                         "micro_batches": max(len([mb for mb in r if mb]) for r in ranks)}
        if step:
            steps.append(row)
    return summarize(steps)


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": steps}
    off = [s["off"]["step_s"] for s in steps]
    verl = [s["verl"]["step_s"] for s in steps]
    for mode in MODES:
        mine = [s[mode]["step_s"] for s in steps]
        out[mode] = {
            "step_ms": 1e3 * statistics.median(mine),
            "rank_ms": 1e3 * statistics.median(s[mode]["mean_s"] for s in steps),
            "speedup": statistics.median(o / m for o, m in zip(off, mine, strict=True)),
            "vs_verl": statistics.median(v / m for v, m in zip(verl, mine, strict=True)),
            "straggler": statistics.median(s[mode]["step_s"] / s[mode]["mean_s"] for s in steps),
            "predicted": statistics.median(s[mode]["predicted"] for s in steps),
            "micro_batches": max(s[mode]["micro_batches"] for s in steps),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16], help="virtual ranks W")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32], help="samples per rank B")
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=16384, help="token budget per micro-batch")
    p.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of the lengths")
    p.add_argument("--steps", type=int, default=8, help="measured global batches per configuration")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--attn", default="auto", choices=["auto", "varlen", "loop"])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default="bench_out/gpu_llm.jsonl")
    p.add_argument("--quick", action="store_true", help="toy size (CPU unless --device cuda)")
    a = p.parse_args(argv)
    if a.quick:
        a.world_sizes, a.batch_sizes, a.max_len, a.max_tokens, a.steps = [2, 4], [4], 128, 256, 2
        a.hidden, a.heads, a.layers = 32, 2, 1
        a.device = "cpu" if a.device == "auto" else a.device
    if a.max_tokens < a.max_len:
        p.error(f"--max-tokens {a.max_tokens}: expected >= --max-len {a.max_len} (every sample must fit)")
    device, backend, why, env, model = build(a.device, a.attn, Dims(a.hidden, a.heads, a.layers), p.error)
    # The model's own matmul FLOPs (forward + backward, causal; a 4x GELU MLP, one logit).
    cost = TransformerCost(hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_layers=a.layers,
                           num_heads=a.heads, gated_mlp=False)
    print(f"device {device} ({env.get('gpu', env['platform'])}), torch {env['torch']}, {dtype_for(device)}; "
          f"attention: {why}; model d={a.hidden} layers={a.layers} heads={a.heads}; Zipf({a.alpha}) <= {a.max_len}, "
          f"max_tokens={a.max_tokens}")
    print("| W x B | mode | step ms | speedup | vs verl | rank ms | straggler | predicted | mb |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = Path(a.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for w in a.world_sizes:
            for b in a.batch_sizes:
                res = run_config(model, backend, device, w, b, a, cost)
                for mode in MODES:
                    r = res[mode]
                    print(f"| {w}x{b} | {mode} | {r['step_ms']:.1f} | {r['speedup']:.3f} | {r['vs_verl']:.3f} | "
                          f"{r['rank_ms']:.1f} | {r['straggler']:.3f} | {r['predicted']:.3f} | {r['micro_batches']} |")
                f.write(json.dumps({"bench": "gpu_llm", "world": w, "batch": b, "max_len": a.max_len,
                                    "max_tokens": a.max_tokens, "alpha": a.alpha, "hidden": a.hidden,
                                    "layers": a.layers, "heads": a.heads, "attention": backend,
                                    "env": env, **res}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
