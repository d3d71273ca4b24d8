"""LLM / RL dispatch and micro-batching: balancer against verl's and torchspec's schemes.

One command::

    .venv/bin/python benchmarks/bench_llm.py [--quick] [--json-out bench_out/llm.jsonl] \\
        [--plot docs/img/llm_dispatch.png]

Prints six tables side by side and writes one JSON line per measurement
(first line: hardware and versions):

1. dispatch across ranks, summed cost (packed sequences): verl (equal-size KK
   on ``L^2 + 24576 L``), torchspec round-robin, greedy longest-first, and
   balancer's ``plan_dispatch`` with equal counts and in token-budget mode.
   Every split is scored on the true cost, ``TransformerCost`` of Llama-2-7B
   (causal, forward + backward): ``max / LB - 1`` with ``LB`` the free-size
   bound (largest sample, mean, pigeonhole: a bound for every method), and
   time per call;
2. micro-batches within a rank under a token budget: verl's rearrangement
   (KK into ``ceil(tokens / budget)``, as first published and with the +1
   retry) against ``plan_micro_batches``: count, worst overflow, slowest
   micro-batch over its bound, time;
   2b. the same with budgets of one to three samples (hundreds of
   micro-batches): planning time;
   2c. planning time at N = 10,000 on the shapes that once took seconds;
3. padded micro-batches (torchspec: ``mbs`` rows padded to the longest):
   round-robin and greedy dispatch against ``plan_dispatch(padded=True)``:
   slowest rank over the ideal (no padding, perfect balance) and padding waste;
4. ``BufferedDispatcher``: balance and padding against window size;
5. end to end: ``examples/train_llm.py --mode compare`` on 2 CPU ranks
   (step time, imbalance, tokens/s, speedup).

The references live in ``tests/llm_reference.py``, written from the published
behaviour of verl and torchspec (not their code).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from balancer import (  # noqa: E402
    BufferedDispatcher,
    TransformerCost,
    plan_dispatch,
    plan_micro_batches,
)
from balancer.partition._bound import bound_sorted  # noqa: E402
from balancer.testing import free_port  # noqa: E402
from tests.llm_reference import (  # noqa: E402
    greedy_longest_first,
    padded_cost,
    round_robin,
    verl_dispatch,
    verl_micro_batches,
    verl_workload,
)

LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "vocab_size": 32000, "hidden_act": "silu"}
COST = TransformerCost.from_hf_config(LLAMA2_7B)
DISTS = ("zipf", "lognormal")


def lengths(dist: str, n: int, seed: int, top: int) -> np.ndarray:
    """Sequence lengths in [1, top]: Zipf(1.2) or lognormal(mu = ln(top / 8), 1)."""
    rng = np.random.default_rng(seed)
    if dist == "zipf":
        return np.minimum(rng.zipf(1.2, n), top).astype(np.int64)
    return np.clip(np.rint(rng.lognormal(np.log(top / 8), 1.0, n)), 1, top).astype(np.int64)


def time_call(fn: Callable[[], Any], budget_s: float = 0.2, max_reps: int = 20) -> float:
    """Median seconds per call over the repeats that fit in ``budget_s``."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def header() -> dict[str, Any]:
    import torch

    return {"kind": "header", "platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "torch": torch.__version__,
            "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


# ----------------------------------------------------------------- 1. dispatch
def dispatch(configs: list[tuple[int, int]], seeds: int, top: int, emit: Callable[..., None]) -> None:
    methods: dict[str, Callable[[np.ndarray, int], list[list[int]]]] = {
        "verl KK(L^2+24576L)": lambda L, w: verl_dispatch(L.tolist(), w),
        "round-robin": lambda L, w: round_robin(L.size, w),
        "greedy longest-first": lambda L, w: greedy_longest_first(COST.of_lengths(L).tolist(), w),
        "balancer equal-count": lambda L, w: plan_dispatch(L, w, cost=COST).ranks,
        "balancer token-budget": lambda L, w: plan_dispatch(L, w, cost=COST, equal_count=False).ranks,
    }
    print("\n## 1. Dispatch, summed cost (Llama-2-7B FLOPs): slowest rank / LB - 1, median | worst "
          "(ms per call)\n")
    print("| W x B | dist | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for w, b in configs:
        for dist in DISTS:
            cells = []
            for name, fn in methods.items():
                gaps = []
                for seed in range(seeds):
                    lens = lengths(dist, w * b, seed, top)
                    x = COST.of_lengths(lens)
                    lb = bound_sorted(np.sort(x), w, equal_size=False)  # no split into w parts does better
                    gaps.append(max(x[p].sum() for p in fn(lens, w)) / lb - 1)
                lens = lengths(dist, w * b, 0, top)
                ms = 1e3 * time_call(lambda fn=fn, lens=lens, w=w: fn(lens, w))
                med, worst = statistics.median(gaps), max(gaps)
                emit(kind="dispatch", W=w, B=b, dist=dist, method=name, gap_median=med,
                     gap_worst=worst, time_ms=ms)
                cells.append(f"{med:.1e} \\| {worst:.1e} ({ms:.1f})")
            print(f"| {w}x{b} | {dist} | " + " | ".join(cells) + " |", flush=True)


# ----------------------------------------------------------------- 2. micro-batches
def micro(sizes: list[int], seeds: int, top: int, emit: Callable[..., None]) -> None:
    print("\n## 2. Micro-batches in one rank, budget 2x and 4x the longest sample\n")
    print("| N | dist | budget | method | micro-batches (mean) | worst tokens/budget | "
          "slowest/LB - 1 (median) | ms |")
    print("|---|---|---|---|---|---|---|---|")
    for n in sizes:
        for dist in DISTS:
            for mult in (2, 4):
                cap = mult * top
                rows: dict[str, list[tuple[int, float, float, float]]] = {}
                for seed in range(seeds):
                    lens = lengths(dist, n, 100 + seed, top)
                    x = COST.of_lengths(lens)
                    for name, retry in (("verl (no retry)", False), ("verl (+1 retry)", True)):
                        t = time.perf_counter()
                        parts = verl_micro_batches(lens, cap, workloads=verl_workload(lens), retry=retry)
                        dt = time.perf_counter() - t
                        k = len(parts)
                        lb = bound_sorted(np.sort(x), k, equal_size=False, min_size=1)
                        top_tok = max(lens[p].sum() for p in parts) / cap
                        rows.setdefault(name, []).append((k, top_tok, max(x[p].sum() for p in parts) / lb - 1, dt))
                    t = time.perf_counter()
                    plan = plan_micro_batches(lens, max_tokens=cap, cost=COST)
                    dt = time.perf_counter() - t
                    lb = bound_sorted(np.sort(x), plan.num_micro_batches, equal_size=False, min_size=1)
                    rows.setdefault("balancer", []).append(
                        (plan.num_micro_batches, plan.tokens.max() / cap, plan.objective / lb - 1, dt))
                for name, vals in rows.items():
                    k = statistics.mean(v[0] for v in vals)
                    over = max(v[1] for v in vals)
                    gap = statistics.median(v[2] for v in vals)
                    ms = 1e3 * statistics.median(v[3] for v in vals)
                    emit(kind="micro", N=n, dist=dist, budget=cap, method=name, micro_batches=k,
                         worst_fill=over, gap_median=gap, time_ms=ms)
                    print(f"| {n} | {dist} | {cap} | {name} | {k:.2f} | {over:.3f} | {gap:.1e} | {ms:.1f} |",
                          flush=True)


def many(sizes: list[int], emit: Callable[..., None]) -> None:
    """Budgets of one to three samples: hundreds of micro-batches in one rank.

    verl's one KK call (textbook heap of ``k``-lists, no retry) is timed beside
    ``plan_micro_batches`` (which searches the fewest count that fits, each
    probe a Karmarkar-Karp start among others)."""
    print("\n## 2b. Many micro-batches in one rank (budget of one to three samples)\n")
    print("| N | lengths | budget | method | micro-batches | worst tokens/budget | ms |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        rng = np.random.default_rng(7)
        for name, lens, cap in (("uniform [2000, 6000)", rng.integers(2000, 6000, n), 11992),
                                ("all 2276", np.full(n, 2276, np.int64), 2276),
                                ("uniform [2000, 6000)", rng.integers(2000, 6000, n), 6000)):
            t = time.perf_counter()
            parts = verl_micro_batches(lens, cap, workloads=verl_workload(lens), retry=False)
            dt_verl = time.perf_counter() - t
            t = time.perf_counter()
            plan = plan_micro_batches(lens, max_tokens=cap, cost=COST)
            dt = time.perf_counter() - t
            for method, k, fill, sec in (
                    ("verl (one KK call)", len(parts), max(int(lens[p].sum()) for p in parts) / cap, dt_verl),
                    ("balancer", plan.num_micro_batches, float(plan.tokens.max()) / cap, dt)):
                emit(kind="many", N=n, lengths=name, budget=cap, method=method, micro_batches=k,
                     worst_fill=fill, time_ms=1e3 * sec)
                print(f"| {n} | {name} | {cap} | {method} | {k} | {fill:.3f} | {1e3 * sec:.0f} |", flush=True)


def scale(n: int, emit: Callable[..., None]) -> None:
    """Shapes that took seconds per call at N = 10,000 (budgets at the longest sample,
    a count equal to N, padded pairs cut into thousands of micro-batches): CPU time of
    one call, on Qwen2-0.5B's cost (a user may plan every training step)."""
    qwen = TransformerCost.from_hf_config({
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936})
    uniform = np.random.default_rng(1).integers(1, 8192, n)
    zipf = np.minimum(np.random.default_rng(2).zipf(1.2, n) + 100, 8192)
    short = np.random.default_rng(0).integers(1, 4096, n)
    pairs = np.repeat(np.arange(n // 2), 2)
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("uniform [1, 8192), budget 8191", lambda: plan_micro_batches(uniform, max_tokens=8191, cost=qwen)),
        ("zipf + 100, budget 8192", lambda: plan_micro_batches(zipf, max_tokens=8192, cost=qwen)),
        ("zeros, N micro-batches", lambda: plan_micro_batches(np.zeros(n, np.int64), num_micro_batches=n)),
        ("all 4096, budget 4096", lambda: plan_micro_batches(np.full(n, 4096), max_tokens=4096, cost=qwen)),
        ("padded pairs, N/2 micro-batches", lambda: plan_micro_batches(
            short, padded=True, groups=pairs, num_micro_batches=n // 2, cost=qwen)),
        ("padded pairs, N/4 micro-batches", lambda: plan_micro_batches(
            short, padded=True, groups=pairs, num_micro_batches=n // 4, cost=qwen)),
        ("dispatch W=4, padded pairs, N/8 a rank", lambda: plan_dispatch(
            short, 4, padded=True, groups=pairs, num_micro_batches=n // 8)),
    ]
    print(f"\n## 2c. Planning time at N = {n} (CPU seconds per call)\n")
    print("| shape | micro-batches | s |")
    print("|---|---|---|")
    for name, fn in cases:
        t = time.process_time()
        plan = fn()
        sec = time.process_time() - t
        emit(kind="scale", N=n, shape=name, micro_batches=plan.num_micro_batches, time_s=sec)
        print(f"| {name} | {plan.num_micro_batches} | {sec:.2f} |", flush=True)


# ----------------------------------------------------------------- 3. padded
def padded(configs: list[tuple[int, int, int]], seeds: int, top: int, emit: Callable[..., None]) -> None:
    print("\n## 3. Padded micro-batches (mbs rows, padded to the longest): slowest rank / ideal - 1 "
          "and padding waste (padded / real tokens), median\n")
    print("| W x B, mbs | dist | lower bound | round-robin | greedy longest-first | balancer padded |")
    print("|---|---|---|---|---|---|")
    f = lambda n: float(COST.of_lengths(np.array([n]))[0])  # noqa: E731
    for w, b, mbs in configs:
        for dist in DISTS:
            res: dict[str, list[tuple[float, float]]] = {}
            for seed in range(seeds):
                lens = lengths(dist, w * b, 200 + seed, top)
                ideal = COST.of_lengths(lens).sum() / w
                # Every rank has b / mbs micro-batches of exactly mbs rows. The
                # least total padded cost is the sorted cut (contiguous runs are
                # optimal), so some rank pays at least its mean.
                # Pigeonhole: the t longest samples fill >= ceil(t / mbs) micro-batches
                # costing >= mbs cost(t-th longest) each, j of them on one rank.
                desc = np.sort(lens)[::-1]
                cd = COST.of_lengths(desc)
                best_total = float(mbs * cd[::mbs].sum())
                t = np.arange(1, desc.size + 1)
                batches = (t + mbs - 1) // mbs
                j = (batches + w - 1) // w
                pig = (j * mbs * cd + (b // mbs - j) * mbs * cd[-1]).max()
                bound = max(ideal, best_total / w, float(pig))
                res.setdefault("bound", []).append((bound / ideal - 1, 1.0))
                real = lens.sum()
                lst = lens.tolist()
                rr = round_robin(lens.size, w)
                gl = [sorted(p, key=lambda i: -lst[i]) for p in
                      greedy_longest_first(COST.of_lengths(lens).tolist(), w)]
                for name, parts in (("round-robin", rr), ("greedy longest-first", gl)):
                    top_cost = max(padded_cost(lst, p, mbs, f) for p in parts)
                    ptok = sum(padded_cost(lst, p, mbs) for p in parts)
                    res.setdefault(name, []).append((top_cost / ideal - 1, ptok / real))
                plan = plan_dispatch(lens, w, cost=COST, padded=True, micro_batch_size=mbs)
                res.setdefault("balancer padded", []).append(
                    (plan.loads.max() / ideal - 1, plan.padded_tokens.sum() / real))
            cells = []
            for name, vals in res.items():
                gap = statistics.median(v[0] for v in vals)
                waste = statistics.median(v[1] for v in vals)
                emit(kind="padded", W=w, B=b, mbs=mbs, dist=dist, method=name, over_ideal=gap,
                     padding_ratio=waste)
                cells.append(f"{gap:.3f}" if name == "bound" else f"{gap:.3f}, {waste:.2f}x")
            print(f"| {w}x{b}, {mbs} | {dist} | " + " | ".join(cells) + " |", flush=True)


# ----------------------------------------------------------------- 4. buffered
def buffered(rounds: int, emit: Callable[..., None], top: int) -> None:
    print("\n## 4. BufferedDispatcher: mean per-round imbalance (max/mean) and padding, by window\n")
    print("| mode | dist | window | imbalance | padding ratio | max lag (rounds) | ms/round |")
    print("|---|---|---|---|---|---|---|")
    w, b = 8, 16
    for mode in ("padded", "summed"):
        for dist in DISTS:
            for window in (1, 2, 4, 8):
                kw: dict[str, Any] = {"padded": True, "micro_batch_size": 4} if mode == "padded" else {}
                disp = BufferedDispatcher(w, b, window=window, cost=COST, **kw)
                imb, pad, lag, secs = [], [], 0, []
                for r in range(rounds + window - 1):
                    disp.put(lengths(dist, w * b, 300 + r, top))
                    if disp.ready():
                        t = time.perf_counter()
                        rnd = disp.next()
                        secs.append(time.perf_counter() - t)
                        m = rnd.plan.metrics()
                        imb.append(m["dispatch/imbalance"])
                        pad.append(m["dispatch/padding_ratio"])
                        lag = max(lag, rnd.max_lag)
                row = {"imbalance": statistics.mean(imb), "padding_ratio": statistics.mean(pad),
                       "max_lag": lag, "ms_per_round": 1e3 * statistics.median(secs)}
                emit(kind="buffered", mode=mode, dist=dist, window=window, rounds=len(imb), **row)
                print(f"| {mode} | {dist} | {window} | {row['imbalance']:.4f} | "
                      f"{row['padding_ratio']:.3f} | {lag} | {row['ms_per_round']:.1f} |", flush=True)


# ----------------------------------------------------------------- 5. end to end
def e2e(quick: bool, emit: Callable[..., None]) -> dict[str, float] | None:
    print("\n## 5. End to end: examples/train_llm.py --mode compare, 2 CPU ranks (gloo)\n")
    args = (["--steps", "4", "--global-batch", "32", "--max-len", "512", "--max-tokens", "1024"]
            if quick else ["--steps", "10", "--global-batch", "64", "--max-len", "2048",
                           "--max-tokens", "4096"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           os.path.join(ROOT, "examples", "train_llm.py"), "--mode", "compare", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-2000:])
        return None
    out: dict[str, float] = {}
    print("| mode | mean step ms | slowest rank compute ms | imbalance (cost model) | "
          "imbalance (measured) | tokens/s |")
    print("|---|---|---|---|---|---|")
    for m in re.finditer(r"summary: mode=(\S+) steps=\d+ mean_step_ms=([\d.]+) mean_slowest_rank_ms=([\d.]+) "
                         r"imbalance_model=([\d.]+) imbalance_measured=([\d.]+) tokens_per_s=(\d+)",
                         proc.stdout):
        print(f"| {m[1]} | {m[2]} | {m[3]} | {m[4]} | {m[5]} | {m[6]} |")
        emit(kind="e2e", mode=m[1], step_ms=float(m[2]), slowest_rank_ms=float(m[3]),
             imbalance_model=float(m[4]), imbalance_measured=float(m[5]), tokens_per_s=float(m[6]),
             args=args)
        out[m[1]] = float(m[2])
    speed = re.search(r"speedup: ([\d.]+)x step time, ([\d.]+)x slowest-rank compute", proc.stdout)
    diff = re.search(r"loss_max_abs_diff: (\S+)", proc.stdout)
    if speed and diff:
        print(f"\nspeedup {speed[1]}x step time, {speed[2]}x slowest-rank compute; "
              f"loss max abs diff {diff[1]}")
        emit(kind="e2e_speedup", speedup=float(speed[1]), speedup_slowest_rank=float(speed[2]),
             loss_max_abs_diff=float(diff[1]), args=args)
    return out


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    disp = [r for r in rows if r["kind"] == "dispatch"]
    methods = list(dict.fromkeys(r["method"] for r in disp))
    labels = list(dict.fromkeys(f"{r['W']}x{r['B']}\n{r['dist']}" for r in disp))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = [max(r["gap_median"], 1e-7) for r in disp if r["method"] == m]
        axes[0].bar(np.arange(len(vals)) + i * width, vals, width, label=m)
    axes[0].set_yscale("log")
    axes[0].set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, fontsize=7)
    axes[0].set_ylabel("slowest rank / lower bound - 1 (median)")
    axes[0].set_title("Dispatch, Llama-2-7B FLOPs per sample")
    axes[0].legend(fontsize=7)
    buf = [r for r in rows if r["kind"] == "buffered" and r["mode"] == "padded"]
    for dist in DISTS:
        pts = [r for r in buf if r["dist"] == dist]
        axes[1].plot([r["window"] for r in pts], [r["padding_ratio"] for r in pts], "o-",
                     label=f"padding ratio, {dist}")
        axes[1].plot([r["window"] for r in pts], [r["imbalance"] for r in pts], "s--",
                     label=f"rank imbalance, {dist}")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("window (rounds buffered)")
    axes[1].set_title("BufferedDispatcher, padded micro-batches (mbs 4)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot written to {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, one seed, short E2E run")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot", default=None, help="PNG path, e.g. docs/img/llm_dispatch.png")
    p.add_argument("--no-e2e", action="store_true")
    args = p.parse_args()
    rows: list[dict[str, Any]] = [header()]
    out = open(args.json_out, "a") if args.json_out else None  # noqa: SIM115

    def emit(**row: Any) -> None:
        rows.append(row)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    if out:
        out.write(json.dumps(rows[0]) + "\n")
    seeds = 1 if args.quick else 5
    top = 8192
    dispatch([(8, 16), (8, 64)] if args.quick else [(8, 16), (8, 64), (32, 32), (128, 16)],
             seeds, top, emit)
    micro([64] if args.quick else [64, 256], seeds, top, emit)
    many([500] if args.quick else [500, 2000], emit)
    scale(2000 if args.quick else 10_000, emit)
    padded([(8, 16, 4)] if args.quick else [(8, 16, 4), (8, 64, 8), (32, 32, 4)], seeds, top, emit)
    buffered(6 if args.quick else 30, emit, top)
    if not args.no_e2e:
        e2e(args.quick, emit)
    if args.plot:
        plot(rows, args.plot)
    if out:
        out.close()


if __name__ == "__main__":
    main()
