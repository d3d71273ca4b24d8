"""Benchmark of ``balancer.partition``: quality, speed, GIL contention, locality.

One command::

    .venv/bin/python benchmarks/bench_partition.py [--quick] [--seeds 3] [--json-out out.jsonl]

Prints four tables and writes one JSON line per measurement (plus one header
line with hardware and versions) to ``--json-out``:

1. quality (``max load / lower_bound - 1``, median and worst over seeds) and
   time per call for: no balancing (contiguous chunks), greedy LPT with a
   cardinality cap (textbook heap), textbook heap Karmarkar-Karp, our
   ``karmarkar_karp`` and our ``balanced_partition``;
2. partition time against N (``--plot`` writes docs/img/partition_time.png);
3. the thread experiment: the partition runs in a 1-worker ThreadPoolExecutor
   while the main thread does a fixed amount of Python-bound or torch-op-bound
   work per step; main-thread slowdown and partition latency alone vs under
   contention;
4. locality: fraction of samples (and bytes) that move between ranks with a
   placement-blind assignment vs ``localize``.

Workloads are ``L^2 + 1024 L`` for lengths ``L`` drawn from uniform[1, 4096],
lognormal(6, 1) clipped to 8192, zipf(1.2) clipped at 4096, and lognormal with
10 % of the samples set to 0 (padding).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from balancer.partition import (  # noqa: E402
    PartitionWorker,
    balanced_partition,
    karmarkar_karp,
    localize,
    lower_bound,
)

DISTS = ("uniform", "lognormal", "zipf", "padded")
Method = Callable[[np.ndarray, int], list[list[int]]]


# ----------------------------------------------------------------- inputs
def lengths(dist: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if dist == "uniform":
        return rng.integers(1, 4097, n)
    if dist == "zipf":
        return np.minimum(rng.zipf(1.2, n), 4096).astype(np.int64)
    out = np.clip(np.rint(rng.lognormal(6.0, 1.0, n)), 1, 8192).astype(np.int64)
    if dist == "padded":
        out[rng.random(n) < 0.1] = 0
    return out


def make_workloads(dist: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Workloads ``L^2 + 1024 L`` (int64) and lengths ``L``."""
    lens = lengths(dist, n, np.random.default_rng(seed))
    return lens * lens + 1024 * lens, lens


# ----------------------------------------------------------------- reference methods
def contiguous(x: np.ndarray, w: int) -> list[list[int]]:
    """No balancing: rank r keeps samples [rB, (r+1)B)."""
    return np.arange(x.size).reshape(w, -1).tolist()


def ref_lpt(x: np.ndarray, w: int) -> list[list[int]]:
    """Textbook greedy LPT with a cardinality cap (binary heap of part loads)."""
    cap = x.size // w
    items = sorted(range(x.size), key=lambda i: (-int(x[i]), i))
    heap = [(0, j) for j in range(w)]
    parts: list[list[int]] = [[] for _ in range(w)]
    for i in items:
        load, j = heapq.heappop(heap)
        parts[j].append(i)
        if len(parts[j]) < cap:
            heapq.heappush(heap, (load + int(x[i]), j))
    return parts


def ref_kk(x: np.ndarray, w: int) -> list[list[int]]:
    """Textbook equal-size Karmarkar-Karp: heap of states, item lists per part."""
    items = sorted(range(x.size), key=lambda i: (int(x[i]), i))
    heap: list[tuple[int, int, list[int], list[list[int]]]] = []
    for r in range(0, len(items), w):
        row = items[r : r + w][::-1]  # descending
        sums = [int(x[i]) for i in row]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), r, sums, [[i] for i in row]))
    tick = x.size
    while len(heap) > 1:
        _, _, sa, pa = heapq.heappop(heap)
        _, _, sb, pb = heapq.heappop(heap)
        merged = sorted(((sa[k] + sb[w - 1 - k], pa[k] + pb[w - 1 - k]) for k in range(w)),
                        key=lambda t: -t[0])
        sums = [m[0] for m in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tick, sums, [m[1] for m in merged]))
        tick += 1
    return heap[0][3] if heap else [[] for _ in range(w)]


# ----------------------------------------------------------------- helpers
def max_load(x: np.ndarray, parts: list[list[int]]) -> int:
    return max(int(x[np.asarray(p, dtype=np.int64)].sum()) for p in parts)


def time_call(fn: Callable[[], Any], budget_s: float = 0.2, max_reps: int = 50) -> float:
    """Median seconds per call over repeats that fit in ``budget_s``."""
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def header() -> dict[str, Any]:
    import torch

    return {
        "kind": "header", "platform": platform.platform(), "machine": platform.machine(),
        "processor": platform.processor(), "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0], "numpy": np.__version__, "torch": torch.__version__,
        "switch_interval_s": sys.getswitchinterval(),
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


# ----------------------------------------------------------------- 1. quality and time
def quality(configs: list[tuple[int, int]], seeds: int, emit: Callable[[dict[str, Any]], None],
            methods: dict[str, Method]) -> None:
    print("\n## Quality (max/lower_bound - 1: median | worst) and time per call (median ms)\n")
    names = list(methods)
    print(f"| W x B | dist | {' | '.join(names)} |")
    print("|---|---|" + "---|" * len(names))
    for w, b in configs:
        for dist in DISTS:
            cells = []
            for name, fn in methods.items():
                gaps, secs = [], []
                for seed in range(seeds):
                    x, _ = make_workloads(dist, w * b, seed)
                    lb = lower_bound(x, w)
                    parts = fn(x, w)
                    gaps.append(max_load(x, parts) / lb - 1)
                    if seed == 0:
                        secs.append(time_call(lambda fn=fn, x=x, w=w: fn(x, w)))
                med, worst = statistics.median(gaps), max(gaps)
                emit({"kind": "quality", "W": w, "B": b, "N": w * b, "dist": dist,
                      "method": name, "gap_median": med, "gap_worst": worst,
                      "gaps": gaps, "time_ms": 1e3 * secs[0]})
                cells.append(f"{med:.1e} \\| {worst:.1e} ({1e3 * secs[0]:.2f} ms)")
            print(f"| {w}x{b} | {dist} | {' | '.join(cells)} |", flush=True)


# ----------------------------------------------------------------- 3. GIL contention
def _py_work(n: int) -> int:
    s = 0
    for i in range(n):
        s += i * i % 7
    return s


def _torch_work(n: int) -> None:
    import torch

    t = torch.ones(16)
    for _ in range(n):
        t.add_(1.0)  # dispatch releases the GIL, like a kernel launch


def _calibrate(work: Callable[[int], Any], ms: float) -> int:
    n = 256
    while True:
        t = time.perf_counter()
        work(n)
        dt = time.perf_counter() - t
        if dt > 0.02:
            return max(1, int(n * ms / 1e3 / dt))
        n *= 2


def contention(fn: Method, x: np.ndarray, w: int, kind: str, step_ms: float,
               steps: int) -> dict[str, float]:
    """Main thread: ``step_ms`` of work per step; partition submitted at step start.

    Baseline and loaded steps alternate so machine noise hits both alike.
    """
    work = _py_work if kind == "python" else _torch_work
    n = _calibrate(work, step_ms)
    lat: list[float] = []

    def task() -> None:
        t = time.perf_counter()
        fn(x, w)
        lat.append(time.perf_counter() - t)

    with ThreadPoolExecutor(1) as pool:
        for _ in range(5):
            pool.submit(task).result()  # alone: the main thread waits idle
        alone = statistics.median(lat)
        lat.clear()
        base, loaded = [], []
        for _ in range(steps):
            t = time.perf_counter()
            work(n)
            base.append(time.perf_counter() - t)
            t = time.perf_counter()
            fut = pool.submit(task)
            work(n)
            loaded.append(time.perf_counter() - t)
            fut.result()
    return {"alone_ms": 1e3 * alone, "contended_ms": 1e3 * statistics.median(lat),
            "contended_p90_ms": 1e3 * float(np.percentile(lat, 90)),
            "main_slowdown": statistics.median(loaded) / statistics.median(base) - 1}


def contention_submit(worker: PartitionWorker, x: np.ndarray, w: int, kind: str,
                      step_ms: float, steps: int) -> dict[str, float]:
    """No thread: the main thread submits to the child, works, then collects.

    The work is split in 50 chunks and readiness is polled after each, so the
    latency resolution is ``step_ms / 50``; baseline steps poll a dummy.
    """
    work = _py_work if kind == "python" else _torch_work
    n = max(1, _calibrate(work, step_ms) // 50)
    alone = []
    for _ in range(5):
        t = time.perf_counter()
        worker.submit(x, w).wait()
        alone.append(time.perf_counter() - t)
    base, loaded, lat = [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        for _ in range(50):
            work(n)
            _ = worker is None
        base.append(time.perf_counter() - t)
        t = time.perf_counter()
        handle = worker.submit(x, w)
        seen = None
        for _ in range(50):
            work(n)
            if seen is None and handle.ready():
                seen = time.perf_counter() - t
        loaded.append(time.perf_counter() - t)
        handle.wait()
        lat.append(seen if seen is not None else time.perf_counter() - t)
    return {"alone_ms": 1e3 * statistics.median(alone), "contended_ms": 1e3 * statistics.median(lat),
            "contended_p90_ms": 1e3 * float(np.percentile(lat, 90)),
            "main_slowdown": statistics.median(loaded) / statistics.median(base) - 1}


def thread_experiment(cases: list[tuple[int, int, float]], steps: int,
                      emit: Callable[[dict[str, Any]], None]) -> None:
    """``cases``: (W, B, main-thread work per step in ms)."""
    print("\n## Thread contention (main thread: fixed work per step, partition submitted at its start)\n")
    print("| W x B | step | method | main thread | main slowdown | latency alone (ms) "
          "| latency contended (ms, median / p90) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    worker = PartitionWorker()
    methods: dict[str, Method] = {
        "textbook KK (pure Python)": ref_kk,
        "karmarkar_karp": karmarkar_karp,
        "balanced_partition": balanced_partition,
        "PartitionWorker (in the thread)": worker,
    }
    try:
        for w, b, step_ms in cases:
            x, _ = make_workloads("lognormal", w * b, 0)
            for name, fn in methods.items():
                if fn is ref_kk and w * b > 16384:
                    continue  # ~1 s per call: would dominate the run
                for kind in ("python", "torch"):
                    r = contention(fn, x, w, kind, step_ms, steps)
                    emit({"kind": "contention", "W": w, "B": b, "method": name,
                          "main": kind, "step_ms": step_ms, **r})
                    _contention_row(w, b, step_ms, name, kind, r)
            for kind in ("python", "torch"):
                r = contention_submit(worker, x, w, kind, step_ms, steps)
                name = "PartitionWorker.submit, no thread"
                emit({"kind": "contention", "W": w, "B": b, "method": name,
                      "main": kind, "step_ms": step_ms, **r})
                _contention_row(w, b, step_ms, name, kind, r)
    finally:
        worker.close()


def _contention_row(w: int, b: int, step_ms: float, name: str, kind: str,
                    r: dict[str, float]) -> None:
    print(f"| {w}x{b} | {step_ms:.0f} ms | {name} | {kind} | {100 * r['main_slowdown']:+.1f} % | "
          f"{r['alone_ms']:.2f} | {r['contended_ms']:.2f} / {r['contended_p90_ms']:.2f} | "
          f"{r['contended_ms'] / r['alone_ms']:.1f}x |", flush=True)


# ----------------------------------------------------------------- 4. locality
def locality(cases: list[tuple[int, int]], seeds: int, emit: Callable[[dict[str, Any]], None]) -> None:
    print("\n## Locality: fraction that moves rank (count | bytes), same max load\n")
    print("| W x B | dist | placement-blind | localize | localize / blind (bytes) | max/bound - 1 |")
    print("|---|---|---|---|---|---|")
    for w, b in cases:
        for dist in DISTS:
            blind_c, blind_b, loc_c, loc_b, gaps = [], [], [], [], []
            for seed in range(seeds):
                x, lens = make_workloads(dist, w * b, seed)
                sizes = (64 + 8 * lens).astype(np.float64)  # bytes: header + 8 per token
                home = np.arange(w * b) // b
                parts = balanced_partition(x, w)
                local = localize(parts, x, home, sizes)
                assert max_load(x, local) <= max_load(x, parts), "localize raised the max"
                for res, cnt, byt in ((parts, blind_c, blind_b), (local, loc_c, loc_b)):
                    dest = np.empty(w * b, np.int64)
                    for r, p in enumerate(res):
                        dest[p] = r
                    moved = dest != home
                    cnt.append(moved.mean())
                    byt.append(sizes[moved].sum() / sizes.sum())
                gaps.append(max_load(x, local) / lower_bound(x, w) - 1)
            row = {"blind_count": float(np.mean(blind_c)), "blind_bytes": float(np.mean(blind_b)),
                   "local_count": float(np.mean(loc_c)), "local_bytes": float(np.mean(loc_b)),
                   "gap_worst": max(gaps)}
            emit({"kind": "locality", "W": w, "B": b, "dist": dist, **row})
            print(f"| {w}x{b} | {dist} | {row['blind_count']:.3f} \\| {row['blind_bytes']:.3f} | "
                  f"{row['local_count']:.3f} \\| {row['local_bytes']:.3f} | "
                  f"{row['local_bytes'] / row['blind_bytes']:.3f} | {row['gap_worst']:.1e} |",
                  flush=True)


# ----------------------------------------------------------------- 2. time vs N
def scaling(sizes: list[tuple[int, int]], methods: dict[str, Method],
            emit: Callable[[dict[str, Any]], None], plot: str | None) -> None:
    print("\n## Time per call vs N (lognormal, median ms)\n")
    print(f"| W x B | N | {' | '.join(methods)} |")
    print("|---|---|" + "---|" * len(methods))
    curves: dict[str, list[tuple[int, float]]] = {m: [] for m in methods}
    for w, b in sizes:
        x, _ = make_workloads("lognormal", w * b, 0)
        cells = []
        for name, fn in methods.items():
            s = time_call(lambda fn=fn, x=x, w=w: fn(x, w), budget_s=0.3)
            curves[name].append((w * b, s))
            emit({"kind": "scaling", "W": w, "B": b, "N": w * b, "method": name, "time_ms": 1e3 * s})
            cells.append(f"{1e3 * s:.2f}")
        print(f"| {w}x{b} | {w * b} | {' | '.join(cells)} |", flush=True)
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for (name, pts), marker in zip(curves.items(), "os^v", strict=False):
            ax.scatter([p[0] for p in pts], [1e3 * p[1] for p in pts], marker=marker, label=name)
        for (w, b), (n, sec) in zip(sizes, curves["balanced_partition"], strict=True):
            ax.annotate(f"{w}x{b}", (n, 1e3 * sec), fontsize=7, xytext=(4, -10),
                        textcoords="offset points")
        ax.plot([1024, 8192, 131072], [1, 3, 25], "k--", lw=1, label="target")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N = W x B (lognormal lengths)")
        ax.set_ylabel("ms per call")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        os.makedirs(os.path.dirname(plot), exist_ok=True)
        fig.savefig(plot, dpi=120)
        print(f"\nplot written to {plot}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small subset (~30 s)")
    ap.add_argument("--seeds", type=int, default=None, help="instances per config (default 3, quick 1)")
    ap.add_argument("--json-out", default=None, help="write JSON lines here")
    ap.add_argument("--plot", default=None, help="write the time-vs-N plot here (PNG)")
    ap.add_argument("--step-ms", type=float, default=50.0,
                    help="main-thread work per step (x10 for the N=131072 case)")
    args = ap.parse_args()
    seeds = args.seeds or (1 if args.quick else 3)
    out = open(args.json_out, "w") if args.json_out else None  # noqa: SIM115

    def emit(row: dict[str, Any]) -> None:
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    emit(header())
    print(json.dumps(header()))
    methods: dict[str, Method] = {
        "none": contiguous, "LPT (heap)": ref_lpt, "KK (heap)": ref_kk,
        "karmarkar_karp": karmarkar_karp, "balanced_partition": balanced_partition,
    }
    if args.quick:
        configs = [(8, 32), (8, 128), (64, 32), (64, 128)]
        quality(configs, seeds, emit, methods)
        thread_experiment([(64, 128, args.step_ms)], 10, emit)
        locality([(4, 128), (8, 128)], seeds, emit)
    else:
        configs = [(w, b) for w in (8, 32, 64, 256) for b in (32, 128, 512)]
        quality(configs, seeds, emit, methods)
        fast = {k: methods[k] for k in ("karmarkar_karp", "balanced_partition")}
        scaling([(8, 128), (32, 32), (64, 128), (256, 32), (256, 128), (256, 512), (1024, 128)],
                fast, emit, args.plot)
        thread_experiment([(8, 128, args.step_ms), (64, 128, args.step_ms),
                           (256, 512, 10 * args.step_ms)], 20, emit)
        locality([(4, 128), (4, 512), (8, 128), (8, 512)], seeds, emit)
    if out:
        out.close()


if __name__ == "__main__":
    main()
