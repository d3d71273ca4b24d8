"""Benchmark of ``balancer.partition``: quality, speed, scale, GIL contention, locality, memory.

One command::

    .venv/bin/python benchmarks/bench_partition.py [--quick] [--seeds 3] [--json-out out.jsonl]
        [--plot docs/img/partition_time.png] [--before 07a7679] [--only scale,curves]
        [--shapes 1024x16,2048x16] [--dists zipf]

Prints up to seven tables and writes one JSON line per measurement (plus one
header line with hardware, versions and load) to ``--json-out``:

1. quality (``max load / lower_bound - 1``, median and worst over seeds) and
   time per call for: no balancing (contiguous chunks), greedy LPT with a
   cardinality cap (textbook heap), textbook heap Karmarkar-Karp, our
   ``karmarkar_karp``, our ``balanced_partition`` and the same function as of
   the ``--before`` commit;
2. before / after at scale: N up to 262,144 (8192x32 ... 256x1024), quality
   over seeds and time per call, the two versions taking turns (machine noise
   hits both alike); "array" times the partition without building lists;
   2b. small inputs: every shape with N <= 1,024 (the 1 ms target), the
   shuffler's array call (``partition_rows``) next to ``--before``'s;
   2c. under load (``--only load``): ``partition_rows`` at N = 262,144, wall
   and CPU time with the machine quiet and next to ``--load-procs`` busy
   processes, taking turns;
3. time against N (W x 32) and against W at N = 131,072, 2x65536 to 65536x2
   (``--plot`` draws it);
4. the thread experiment: the partition runs in a 1-worker ThreadPoolExecutor
   (or the ``PartitionWorker`` child) while the main thread does a fixed
   amount of Python-bound or torch-op-bound work per step; main-thread
   slowdown and partition latency alone vs under contention;
5. locality: fraction of samples (and bytes) that move between ranks with a
   placement-blind assignment vs ``localize``;
6. compute and memory: compute balanced with a cap on tokens per rank (W = 8-16,
   20 seeds; W = 32-128, 5 seeds; ``--only tokens-scale``: W = 256-1024, 2 seeds);
7. crowded parts (``--only crowded``): Zipf lengths clipped at 4096 at B = 16,
   the shipped partition next to a class split with long refinement (seconds
   per instance), which shows how much of the gap to the bound is the
   partition's.

The ``--before`` reference is loaded from git (``git show``) into a temporary
package, so both versions run in one process.

Workloads are ``L^2 + 1024 L`` for lengths ``L`` drawn from uniform[1, 4096],
lognormal(6, 1) clipped to 8192, zipf(1.2) clipped at 4096, and lognormal with
10 % of the samples set to 0 (padding).
"""

from __future__ import annotations

import argparse
import heapq
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
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
from balancer.partition._balanced import partition_rows, solve_rows  # noqa: E402
from balancer.partition._crowded import crowding  # noqa: E402
from balancer.partition._lpt import lpt  # noqa: E402
from balancer.partition._refine import polish, swap_rounds  # noqa: E402

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
            methods: dict[str, Method], budget_s: float = 0.2) -> None:
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
                        secs.append(time_call(lambda fn=fn, x=x, w=w: fn(x, w), budget_s))
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
                      emit: Callable[[dict[str, Any]], None], before: Any = None, textbook: bool = True) -> None:
    """``cases``: (W, B, main-thread work per step in ms); ``before``: an older
    ``balancer.partition`` (its in-thread call and its child process are measured too);
    ``textbook``: the pure-Python KK too (the quality section runs it as well)."""
    print("\n## Thread contention (main thread: fixed work per step, partition submitted at its start)\n")
    print("| W x B | step | method | main thread | main slowdown | latency alone (ms) "
          "| latency contended (ms, median / p90) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    worker = PartitionWorker()
    workers = {"PartitionWorker.submit, no thread": worker}
    methods: dict[str, Method] = {
        **({"textbook KK (pure Python)": ref_kk} if textbook else {}),
        "karmarkar_karp": karmarkar_karp,
        "balanced_partition": balanced_partition,
        "PartitionWorker (in the thread)": worker,
    }
    if before is not None:
        methods["balanced_partition (before)"] = before.balanced_partition
        workers["PartitionWorker.submit, no thread (before)"] = before.PartitionWorker()
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
            for name, wk in workers.items():
                for kind in ("python", "torch"):
                    r = contention_submit(wk, x, w, kind, step_ms, steps)
                    emit({"kind": "contention", "W": w, "B": b, "method": name,
                          "main": kind, "step_ms": step_ms, **r})
                    _contention_row(w, b, step_ms, name, kind, r)
    finally:
        for wk in workers.values():
            wk.close()


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


# ----------------------------------------------------------------- before: an older commit
def load_before(commit: str) -> Any:
    """``balancer.partition`` as of ``commit``, importable next to the current one.

    The modules of that commit are written to a temp dir as package
    ``balancer_before`` (imports rewritten) for in-process calls; the dir goes
    on ``PYTHONPATH`` so that its ``PartitionWorker`` child runs the old code.
    """
    import importlib
    import re
    import subprocess

    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    names = subprocess.run(["git", "-C", repo, "ls-tree", "-r", "--name-only", commit, "balancer/"],
                           capture_output=True, text=True, check=True).stdout.split()
    tmp = tempfile.mkdtemp(prefix="balancer_before_")
    pkg = os.path.join(tmp, "balancer_before")
    # Every module of the commit (the flat `partition.py` + `_partition_*.py`
    # layout and the later `partition/` subpackage alike), with an empty
    # top-level `__init__` so that importing the partitioner pulls in no torch.
    for name in names:
        if not name.endswith(".py"):
            continue
        rel = os.path.relpath(name, "balancer")
        dst = os.path.join(pkg, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        src = "" if rel == "__init__.py" else subprocess.run(
            ["git", "-C", repo, "show", f"{commit}:{name}"], capture_output=True, text=True, check=True).stdout
        with open(dst, "w") as f:
            f.write(re.sub(r"\bbalancer\.", "balancer_before.", src))
    sys.path.insert(0, tmp)
    os.environ["PYTHONPATH"] = os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")])
    return importlib.import_module("balancer_before.partition")


def time_side_by_side(fns: dict[str, Callable[[], Any]], reps: int,
                      slow_s: float = 2.0) -> dict[str, float]:
    """Median seconds per call, the functions taking turns (machine noise hits all alike).

    A function whose first call takes over ``slow_s`` is timed by that call only.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for rep in range(reps):
        for name, fn in fns.items():
            if rep and times[name][0] > slow_s:
                continue
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


# ----------------------------------------------------------------- 2. before / after at scale
# Every N = 262,144 shape from 131072x2 to 2x131072 (the issue's "every shape with
# N <= 262,144"; the very many and the very few parts were added in the seventeenth
# pass), then smaller ones.
SCALE_SHAPES = [(131072, 2), (65536, 4), (32768, 8), (16384, 16), (8192, 32), (4096, 64), (2048, 128),
                (1024, 256), (512, 512), (256, 1024), (64, 4096), (16, 16384), (2, 131072),
                (8192, 8), (256, 512), (64, 128), (32, 32), (8, 128), (4, 256), (256, 4), (128, 8), (64, 16)]


def scale(shapes: list[tuple[int, int]], dists: tuple[str, ...], seeds: int, before: Any,
          emit: Callable[[dict[str, Any]], None], reps: int = 5) -> None:
    """Quality and time of the current ``balanced_partition`` next to ``before``'s.

    Times are medians over ``reps`` calls on seed 0, the versions taking
    turns; "array" is the same partition without building Python lists
    (``partition_rows``, what the partition child can return; for ``before``
    its own ``partition_rows``, or its lists as an array for commits before it).
    "per seed" times one ``partition_rows`` call per seed (the versions taking
    turns), median and slowest: seeds that miss the bound take extra tries.
    """
    rows_before = None if before is None else _rows_of(before)
    child_before = None if before is None else _child_of(before)
    print("\n## Before / after at scale (max/bound - 1: median | worst over seeds; ms per call)\n")
    print("| W x B | dist | before: quality | before ms | before ms (array) | after: quality "
          "| after ms (lists) | after ms (array) | speedup (lists) | speedup (array) "
          "| child ms: before / after | per seed ms (array), median \\| slowest: before / after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w, b in shapes:
        for dist in dists:
            gaps: dict[str, list[float]] = {"before": [], "after": []}
            secs: dict[str, float] = {}
            per_seed: dict[str, list[float]] = {"before_array": [], "array": []}
            for seed in range(seeds):
                x, _ = make_workloads(dist, w * b, seed)
                lb = lower_bound(x, w)
                xf = x.astype(np.float64)  # the shuffler's costs: floats, quantized by its child
                fns = {"after": lambda x=x, w=w: balanced_partition(x, w),
                       "array": lambda x=x, w=w: partition_rows(x, w),
                       "child": lambda xf=xf, w=w: solve_rows(xf, w, quantized=True)}
                if before is not None and rows_before is not None:
                    fns["before"] = lambda x=x, w=w: before.balanced_partition(x, w)
                    fns["before_array"] = lambda x=x, w=w: rows_before(x, w)
                if child_before is not None:
                    fns["before_child"] = lambda xf=xf, w=w: child_before(xf, w)
                gaps["after"].append(max_load(x, balanced_partition(x, w)) / lb - 1)
                if before is not None:
                    gaps["before"].append(max_load(x, before.balanced_partition(x, w)) / lb - 1)
                if seed == 0:
                    fns["after"]()  # warm-up
                    secs = time_side_by_side(fns, reps)
                for k, got in per_seed.items():
                    if k in fns:
                        t = time.perf_counter()
                        fns[k]()
                        got.append(time.perf_counter() - t)
            row = {"kind": "scale", "W": w, "B": b, "N": w * b, "dist": dist,
                   **{f"gaps_{k}": v for k, v in gaps.items()},
                   **{f"{k}_ms": 1e3 * v for k, v in secs.items()},
                   **{f"per_seed_{k}_ms": [1e3 * t for t in v] for k, v in per_seed.items()}}
            emit(row)
            cell = {k: (f"{statistics.median(v):.1e} \\| {max(v):.1e}" if v else "-")
                    for k, v in gaps.items()}
            had = "before" in secs
            bms = f"{1e3 * secs['before']:.1f} | {1e3 * secs['before_array']:.1f}" if had else "- | -"
            speed = (f"{secs['before'] / secs['after']:.2f}x | {secs['before_array'] / secs['array']:.2f}x"
                     if had else "- | -")
            child = (f"{1e3 * secs['before_child']:.1f} / " if "before_child" in secs else "- / ") + \
                f"{1e3 * secs['child']:.1f}"
            slow = " / ".join(f"{1e3 * statistics.median(v):.1f} \\| {1e3 * max(v):.1f}" if v else "-"
                              for v in per_seed.values())
            print(f"| {w}x{b} | {dist} | {cell['before']} | {bms} | {cell['after']} | "
                  f"{1e3 * secs['after']:.1f} | {1e3 * secs['array']:.1f} | {speed} | {child} | {slow} |",
                  flush=True)


# ----------------------------------------------------------------- 2c. under load
LOAD_SHAPES = [(w, b) for w, b in SCALE_SHAPES if w * b == 262_144]  # 131072x2 ... 2x131072


# A busy process (pure Python, no memory traffic) while the file argv[1] exists, until
# argv[2] does: a bare interpreter (a spawned multiprocessing child re-imports this
# script, and with it torch and torchrec: ~8 s per spinner on the 2-core box).
_SPIN = """
import os, sys, time
run, stop = sys.argv[1], sys.argv[2]
print("ready", flush=True)
while not os.path.exists(stop):
    if not os.path.exists(run):
        time.sleep(0.005)
        continue
    x = 0
    for i in range(20_000):
        x += i * i
"""


def under_load(shapes: list[tuple[int, int]], dists: tuple[str, ...], procs: int,
               emit: Callable[[dict[str, Any]], None], reps: int = 7) -> None:
    """Wall and CPU time of ``partition_rows`` with the machine quiet and with ``procs``
    busy processes, the two taking turns call by call.

    The partition is single-threaded numpy: its wall time on a shared box
    grows with whatever else runs, its CPU time (``time.thread_time``) much
    less. CPU time is what the partition costs on a core of its own, as in
    the shuffler's partition child on a host with a core to spare.
    """

    flags = tempfile.mkdtemp(prefix="bench_load_")
    run, stop = os.path.join(flags, "run"), os.path.join(flags, "stop")
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN, run, stop], stdout=subprocess.PIPE, text=True)
                for _ in range(procs)]
    for sp in spinners:
        said = sp.stdout.readline().strip() if sp.stdout is not None else ""
        if said != "ready":
            raise RuntimeError(f"a busy process did not start: it said {said!r}")
    print(f"\n## Under load: partition_rows quiet vs next to {procs} busy processes on "
          f"{os.cpu_count()} cores (median ms over {reps} calls each, taking turns)\n")
    print("| W x B | dist | quiet wall | quiet CPU | loaded wall | loaded CPU |")
    print("|---|---|---:|---:|---:|---:|")
    try:
        for w, b in shapes:
            for dist in dists:
                x, _ = make_workloads(dist, w * b, 0)
                partition_rows(x, w)  # warm-up
                t: dict[str, list[float]] = {k: [] for k in ("quiet_wall", "quiet_cpu", "loaded_wall", "loaded_cpu")}
                for _ in range(reps):
                    for mode in ("quiet", "loaded"):
                        if mode == "loaded":
                            open(run, "w").close()
                            time.sleep(0.05)  # the spinners are running
                        c0, t0 = time.thread_time(), time.perf_counter()
                        partition_rows(x, w)
                        t[f"{mode}_wall"].append(time.perf_counter() - t0)
                        t[f"{mode}_cpu"].append(time.thread_time() - c0)
                        if mode == "loaded":
                            os.remove(run)
                            time.sleep(0.02)  # the spinners finish their last loop
                ms = {k: 1e3 * statistics.median(v) for k, v in t.items()}
                emit({"kind": "under_load", "W": w, "B": b, "N": w * b, "dist": dist, "procs": procs,
                      **{f"{k}_ms": v for k, v in ms.items()}})
                print(f"| {w}x{b} | {dist} | {ms['quiet_wall']:.1f} | {ms['quiet_cpu']:.1f} | "
                      f"{ms['loaded_wall']:.1f} | {ms['loaded_cpu']:.1f} |", flush=True)
    finally:
        open(stop, "w").close()
        for sp in spinners:
            try:
                sp.wait(5)
            except subprocess.TimeoutExpired:
                sp.kill()
                sp.wait()
        shutil.rmtree(flags, ignore_errors=True)


# ----------------------------------------------------------------- 2b. small inputs
SMALL_SHAPES = [(2, 512), (4, 256), (8, 128), (16, 64), (32, 32), (64, 16), (128, 8), (256, 4),
                (512, 2), (4, 64), (8, 32), (16, 16), (32, 8)]


def small(shapes: list[tuple[int, int]], dists: tuple[str, ...], seeds: int, before: Any,
          emit: Callable[[dict[str, Any]], None], reps: int = 21) -> None:
    """The 1 ms target: every shape with N <= 1,024, ``partition_rows`` next to ``before``'s.

    Quality over ``seeds``; times are medians of ``reps`` alternating calls on
    seed 0 (``reps // 3`` on the other seeds), and over the seeds their median
    and slowest: a seed that misses 1e-3 takes the crowded second try.
    """
    print("\n## Small inputs, N <= 1,024 (max/bound - 1: median | worst over seeds; partition_rows ms per call "
          "on seed 0, and per seed: median | slowest)\n")
    print("| W x B | dist | before: quality | before ms | after: quality | after ms | "
          "per seed ms, median \\| slowest: before / after |")
    print("|---|---|---|---|---|---|---|")
    before_rows = _rows_of(before)
    after_ms: list[float] = []
    slowest_ms: list[float] = []
    for w, b in shapes:
        for dist in dists:
            gaps: dict[str, list[float]] = {"before": [], "after": []}
            per_seed: dict[str, list[float]] = {"before": [], "after": []}
            secs: dict[str, float] = {}
            for seed in range(seeds):
                x, _ = make_workloads(dist, w * b, seed)
                lb = lower_bound(x, w)
                now = {"after": lambda x=x, w=w: partition_rows(x, w)}
                if before_rows is not None:
                    now["before"] = lambda x=x, w=w: before_rows(x, w)
                for name, fn in now.items():
                    rows = fn()
                    gaps[name].append(float(x[rows].sum(axis=1).max()) / lb - 1)
                got = time_side_by_side(now, reps if seed == 0 else max(3, reps // 3))
                for name, sec in got.items():
                    per_seed[name].append(1e3 * sec)
                if seed == 0:
                    secs = got
            after_ms.append(1e3 * secs["after"])
            slowest_ms.append(max(per_seed["after"]))
            emit({"kind": "small", "W": w, "B": b, "N": w * b, "dist": dist,
                  **{f"gaps_{k}": v for k, v in gaps.items()},
                  **{f"{k}_ms": 1e3 * v for k, v in secs.items()},
                  **{f"{k}_seed_ms": v for k, v in per_seed.items() if v}})
            cell = {k: (f"{statistics.median(v):.1e} \\| {max(v):.1e}" if v else "-")
                    for k, v in gaps.items()}
            spread = {k: (f"{statistics.median(v):.2f} \\| {max(v):.2f}" if v else "-")
                      for k, v in per_seed.items()}
            bms = f"{1e3 * secs['before']:.2f}" if "before" in secs else "-"
            print(f"| {w}x{b} | {dist} | {cell['before']} | {bms} | {cell['after']} | "
                  f"{1e3 * secs['after']:.2f} | {spread['before']} / {spread['after']} |", flush=True)
    print(f"\nafter: slowest {max(after_ms):.2f} ms on seed 0; {sum(t > 1 for t in after_ms)} of "
          f"{len(after_ms)} configurations above 1 ms on seed 0, {sum(t > 1 for t in slowest_ms)} on their "
          f"slowest seed (slowest {max(slowest_ms):.2f} ms)")


def _balanced_of(before: Any, name: str) -> Any:
    """``before``'s ``_balanced.<name>``, or ``None`` for commits without it."""
    import importlib

    try:
        return getattr(importlib.import_module(before.__name__ + "._balanced"), name)
    except (ImportError, AttributeError):
        return None


def _child_of(before: Any) -> Callable[[np.ndarray, int], Any] | None:
    """``before``'s per-step call of the shuffler's partition child (``solve_rows`` on
    quantized workloads), or ``None`` for commits without it."""
    fn = _balanced_of(before, "solve_rows")
    return None if fn is None else lambda x, w: fn(x, w, quantized=True)


def _rows_of(before: Any) -> Callable[[np.ndarray, int], np.ndarray] | None:
    """``before``'s array-returning partition (``_balanced.partition_rows``), or its lists
    as an array for commits that predate it (those times include building the lists)."""
    if before is None:
        return None
    fn: Callable[[np.ndarray, int], np.ndarray] | None = _balanced_of(before, "partition_rows")
    return fn if fn is not None else lambda x, w: np.asarray(before.balanced_partition(x, w))


def scaling_curves(before: Any, emit: Callable[[dict[str, Any]], None], plot: str | None,
                   dist: str = "lognormal", reps: int = 5) -> None:
    """Time against N (B = 32) and against W at N = 131,072; seed 0, side by side."""
    print(f"\n## Time per call against N and against W ({dist}, median ms)\n")
    print("| curve | W x B | N | before | after (lists) | after (array) |")
    print("|---|---|---|---|---|---|")
    curves = {"N": [(w, 32) for w in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)],
              "W": [(w, 131072 // w) for w in (2, 16, 64, 256, 1024, 4096, 8192, 16384, 32768, 65536)]}
    pts: dict[str, list[tuple[int, int, dict[str, float]]]] = {k: [] for k in curves}
    for curve, shapes in curves.items():
        for w, b in shapes:
            x, _ = make_workloads(dist, w * b, 0)
            fns = {"after": lambda x=x, w=w: balanced_partition(x, w),
                   "array": lambda x=x, w=w: partition_rows(x, w)}
            if before is not None:
                fns["before"] = lambda x=x, w=w: before.balanced_partition(x, w)
            fns["after"]()
            secs = time_side_by_side(fns, reps)
            pts[curve].append((w, b, secs))
            emit({"kind": "scaling", "curve": curve, "W": w, "B": b, "N": w * b, "dist": dist,
                  **{f"{k}_ms": 1e3 * v for k, v in secs.items()}})
            bms = f"{1e3 * secs['before']:.1f}" if "before" in secs else "-"
            print(f"| {curve} | {w}x{b} | {w * b} | {bms} | {1e3 * secs['after']:.1f} | "
                  f"{1e3 * secs['array']:.1f} |", flush=True)
    if plot:
        _plot_scaling(pts, plot)


def _plot_scaling(pts: dict[str, list[tuple[int, int, dict[str, float]]]], plot: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"before": ("C3", "s", "before"), "after": ("C0", "o", "after (lists)"),
              "array": ("C2", "^", "after (array)")}
    for ax, curve, xlabel in ((axes[0], "N", "N = W x 32"), (axes[1], "W", "W (N = 131,072)")):
        for key, (color, marker, label) in styles.items():
            xs = [w * b if curve == "N" else w for w, b, s in pts[curve] if key in s]
            ys = [1e3 * s[key] for w, b, s in pts[curve] if key in s]
            ax.plot(xs, ys, marker=marker, color=color, label=label)
        ax.axhline(25, color="k", ls="--", lw=1, label="25 ms target")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel + " (lognormal lengths)")
        ax.set_ylabel("ms per call")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(plot) or ".", exist_ok=True)
    fig.savefig(plot, dpi=120)
    print(f"\nplot written to {plot}")


# ----------------------------------------------------------------- 6. compute and memory
TOKEN_B = 32  # samples per part in the compute-and-memory instances


def token_instance(w: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Compute ``L^2 + 256 L`` (int64) and tokens ``L`` of Zipf(1.2) lengths <= 4096, ``w * TOKEN_B``
    samples (also ``tokens_mip.py``'s instances)."""
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.zipf(1.2, w * TOKEN_B), 4096).astype(np.int64)
    return lens * lens + 256 * lens, lens


def _gap_cells(gaps: list[float]) -> str:
    """``median \\| worst | count within 1e-4`` table cells of compute gaps."""
    return f"{statistics.median(gaps):.1e} \\| {max(gaps):.1e} | {sum(g <= 1e-4 for g in gaps)}/{len(gaps)}"


def tokens(ws: tuple[int, ...], seeds: int, caps: tuple[float | None, ...],
           emit: Callable[[dict[str, Any]], None], before: Any = None, title: str = "") -> None:
    """Compute (``L^2 + 256 L``) balanced, tokens (``L``) per part capped at ``cap * mean``;
    with ``before`` (a package from :func:`load_before` with the token cap) its
    partition of every instance runs beside ours."""
    print(f"\n## Compute and memory{title}: Zipf(1.2) <= 4096 lengths, B = 32, compute L^2 + 256 L, "
          f"tokens L, {seeds} seeds\n")
    if before is not None and "tokens" not in inspect.signature(before.balanced_partition).parameters:
        before = None  # a commit before the token cap
    runs: dict[str, Callable[..., Any]] = {"now": balanced_partition}
    if before is not None:
        runs["before"] = before.balanced_partition
    head = ("| W | token cap | compute max/bound - 1 (median \\| worst) | within 1e-4 | tokens max/mean "
            "(median \\| worst) | ms (median) |")
    rule = "|---|---|---|---|---|---|"
    if before is not None:
        head += " before: compute (median \\| worst) | before: within 1e-4 | before: ms | better / worse |"
        rule += "---|---|---|---|"
    print(head)
    print(rule)
    for w in ws:
        for cap in caps:
            gaps: dict[str, list[float]] = {k: [] for k in runs}
            secs: dict[str, list[float]] = {k: [] for k in runs}
            ratios = []
            for seed in range(seeds):
                x, lens = token_instance(w, seed)
                kw = {} if cap is None else {"tokens": lens, "max_tokens": cap * lens.sum() / w}
                for name, run in runs.items():  # side by side, instance by instance
                    t = time.perf_counter()
                    parts = run(x, w, **kw)
                    secs[name].append(time.perf_counter() - t)
                    gaps[name].append(max_load(x, parts) / lower_bound(x, w) - 1)
                    if name == "now":
                        tok = np.array([lens[p].sum() for p in parts])
                        ratios.append(float(tok.max() / tok.mean()))

            emit({"kind": "tokens", "W": w, "B": TOKEN_B, "cap": cap, "gaps": gaps["now"], "ratios": ratios,
                  "time_ms": 1e3 * statistics.median(secs["now"])}
                 | ({} if before is None else {"before_gaps": gaps["before"],
                                                "before_time_ms": 1e3 * statistics.median(secs["before"])}))
            row = (f"| {w} | {'none' if cap is None else f'{cap:.2f} x mean'} | {_gap_cells(gaps['now'])} | "
                   f"{statistics.median(ratios):.4f} \\| {max(ratios):.4f} | "
                   f"{1e3 * statistics.median(secs['now']):.1f} |")
            if before is not None:
                # Instance by instance; gaps within balanced_partition's default
                # rtol count as equal: the search stops there.
                rtol = inspect.signature(balanced_partition).parameters["rtol"].default
                now_g, old_g = ([max(g, rtol) for g in gaps[k]] for k in ("now", "before"))
                better = sum(a < b - 1e-12 for a, b in zip(now_g, old_g, strict=True))
                worse = sum(a > b + 1e-12 for a, b in zip(now_g, old_g, strict=True))
                row += (f" {_gap_cells(gaps['before'])} | {1e3 * statistics.median(secs['before']):.1f} |"
                        f" {better} / {worse} |")
            print(row, flush=True)



# ----------------------------------------------------------------- crowded parts (a study)
def crowded_split(v: np.ndarray, w: int, target: int, rounds: int, steps: int) -> np.ndarray | None:
    """A partition of ascending int64 ``v`` built around its largest tie block, or ``None``
    where that block does not crowd the parts.

    With ``K`` items in the top block (clipped lengths) and ``c = ceil(K / W)``, a
    partition below ``target`` gives ``a = K - (c - 1) W`` parts ``c`` of them and
    the rest ``c - 1`` (no part can hold ``c + 1``). Given that, the other items
    form two independent problems: ``a`` parts of ``B - c`` items and ``W - a``
    parts of ``B - c + 1``, each with a fixed offset. The split gives the second
    class the largest items and tops it up with the smallest, as many of the
    largest as fit under ``target`` in sum; the first class takes the middle. Each
    class starts from capped LPT and gets up to ``rounds`` parallel swap rounds
    and ``steps`` single swaps, far past the library's budgets: a yardstick for
    what a partition of these inputs can reach, not a candidate for the
    shuffler's per-step path.

    Returns:
        [W, B] sorted positions per part (a permutation of ``range(N)``).
    """
    n = v.size
    b = n // w
    k = n - int(np.searchsorted(v, v[-1], side="left"))
    crowd = crowding(v, w, k, target, lambda j: int(v[:j].sum()))
    if crowd is None or k % w == 0:
        return None
    c, a, _ = crowd
    low = int(v[-1])
    m = n - k
    n2 = (w - a) * (b - c + 1)
    prefix = np.concatenate([[0], np.cumsum(v[:m])])
    j = np.arange(n2 + 1)
    fits = (prefix[m] - prefix[m - j]) + prefix[n2 - j] <= (w - a) * (target - (c - 1) * low)
    top = int(np.flatnonzero(fits).max()) if fits.any() else 0
    classes = [(np.arange(n2 - top, m - top), a, c),
               (np.concatenate([np.arange(n2 - top), np.arange(m - top, m)]), w - a, c - 1)]
    rows, big = [], m
    for idx, parts, bigs in classes:
        vals = v[idx]
        r = lpt(vals, parts)
        loads = vals[r].sum(axis=1)
        goal = target - bigs * low
        swap_rounds(vals, r, loads, goal, rounds, 8)  # stops after two rounds without a swap
        polish(vals, r, loads, goal, steps)
        rows.append(np.concatenate([idx[r], big + np.arange(parts * bigs).reshape(parts, bigs)], axis=1))
        big += parts * bigs
    out = np.sort(np.concatenate(rows), axis=1)
    assert (np.sort(out, axis=None) == np.arange(n)).all()
    return out


def crowded(shapes: list[tuple[int, int]], seeds: int, rounds: int, steps: int,
            emit: Callable[[dict[str, Any]], None]) -> None:
    """Zipf lengths clipped at 4096: the shipped partition against :func:`crowded_split`.

    Where ``crowded_split`` ends far below the shipped partition, the gap to
    ``lower_bound`` is (that much) the partition's, not the bound's.
    """
    print(f"\n## Crowded parts: Zipf, max/bound - 1 of the shipped partition and of a class split "
          f"with long refinement ({rounds} rounds, {steps} swaps), {seeds} seeds\n")
    print("| W x B | seed | clipped / W | partition_rows | ms | class split | s |")
    print("|---|---|---|---|---|---|---|")
    for w, b in shapes:
        for seed in range(seeds):
            x, lens = make_workloads("zipf", w * b, seed)
            v = np.sort(x)
            bound = lower_bound(x, w)
            t = time.perf_counter()
            shipped = x[partition_rows(x, w)].sum(axis=1).max() / bound - 1
            ms = 1e3 * (time.perf_counter() - t)
            t = time.perf_counter()
            rows = crowded_split(v, w, int(bound), rounds, steps)
            secs = time.perf_counter() - t
            split = None if rows is None else float(v[rows].sum(axis=1).max() / bound - 1)
            emit({"kind": "crowded", "W": w, "B": b, "seed": seed, "gap": float(shipped), "ms": ms,
                  "split_gap": split, "split_s": secs, "clipped": int((lens == 4096).sum())})
            cell = "-" if split is None else f"{split:.1e}"
            print(f"| {w}x{b} | {seed} | {(lens == 4096).sum() / w:.2f} | {shipped:.1e} | {ms:.1f} | "
                  f"{cell} | {secs:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: small subset, few repeats (~25 s)")
    ap.add_argument("--seeds", type=int, default=None, help="instances per config (default 3, quick 1)")
    ap.add_argument("--json-out", default=None, help="write JSON lines here")
    ap.add_argument("--plot", default=None, help="write the scaling plot (time vs N and vs W) here")
    ap.add_argument("--before", default="07a7679",
                    help="git commit whose balanced_partition is the 'before' reference ('none': skip)")
    ap.add_argument("--only", default=None,
                    help="comma-separated sections: quality,scale,small,load,curves,threads,locality,tokens,"
                         "tokens-scale,crowded")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated WxB: run the scale and load sections on these shapes only")
    ap.add_argument("--dists", default=",".join(DISTS),
                    help="comma-separated workload distributions for the scale, small and load sections")
    ap.add_argument("--reps", type=int, default=5,
                    help="alternating calls timed per version in the scale section (median)")
    ap.add_argument("--load-procs", type=int, default=os.cpu_count() or 2,
                    help="busy processes in the 'load' section (default: one per core)")
    ap.add_argument("--step-ms", type=float, default=50.0,
                    help="main-thread work per step (x10 for the N=131072 case)")
    args = ap.parse_args()
    seeds = args.seeds or (1 if args.quick else 3)
    only = set(args.only.split(",")) if args.only else None
    sections = ("quality", "scale", "small", "load", "curves", "threads", "locality", "tokens", "tokens-scale",
                "crowded")
    if only is not None and not only <= set(sections):
        ap.error(f"--only: {args.only!r}; expected a comma-separated subset of {','.join(sections)}")
    if args.plot and (args.quick or not (only is None or "curves" in only)):
        ap.error("--plot draws the 'curves' section, which --quick (or an --only without curves) leaves out")
    dists = tuple(args.dists.split(","))
    if not set(dists) <= set(DISTS):
        ap.error(f"--dists: {args.dists!r}; expected a comma-separated subset of {','.join(DISTS)}")
    try:
        chosen = None if args.shapes is None else [
            (int(w), int(b)) for w, b in (s.lower().split("x") for s in args.shapes.split(","))]
    except ValueError:
        ap.error(f"--shapes: {args.shapes!r}; expected comma-separated WxB, e.g. 1024x16,2048x16")
    if args.before != "none":
        repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        try:
            known = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "--quiet",
                                    f"{args.before}^{{commit}}"], capture_output=True, check=False).returncode == 0
        except FileNotFoundError:
            ap.error(f"--before {args.before}: needs git (not found); '--before none' skips the reference")
        if not known:
            ap.error(f"--before: {args.before!r} is not a commit of this repository ('none' skips the reference)")

    def emit(row: dict[str, Any]) -> None:
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    def want(section: str) -> bool:
        return only is None or section in only

    def pick(shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return shapes if chosen is None else chosen

    # Opened after the checks: a refused command line keeps the previous results.
    out = open(args.json_out, "w") if args.json_out else None  # noqa: SIM115
    emit(header())
    print(json.dumps(header()))
    before = None if args.before == "none" else load_before(args.before)
    methods: dict[str, Method] = {
        "none": contiguous, "LPT (heap)": ref_lpt, "KK (heap)": ref_kk,
        "karmarkar_karp": karmarkar_karp, "balanced_partition": balanced_partition,
    }
    if before is not None:
        methods["before"] = before.balanced_partition
    if args.quick:
        # A smoke run of every section (the suite runs it): few repeats, times indicative only.
        if want("quality"):
            quality([(8, 32), (8, 128), (64, 32), (64, 128)], seeds, emit, methods, budget_s=0.0)
        if want("scale"):
            scale([(8192, 32), (1024, 256), (32, 32)], ("zipf", "lognormal"), seeds, before, emit, 2)
        if want("small"):
            small([(64, 16), (16, 64)], ("uniform", "zipf"), seeds, before, emit, 3)
        if want("load"):
            under_load([(8192, 32)], ("zipf",), args.load_procs, emit, 2)
        if want("threads"):
            thread_experiment([(64, 128, args.step_ms)], 3, emit, before, textbook=False)
        if want("locality"):
            locality([(4, 128), (8, 128)], seeds, emit)
        if want("tokens"):
            tokens((8, 16), 2, (None, 1.05, 1.01), emit, before)
        if want("crowded"):
            crowded([(64, 16), (1024, 16)], seeds, 8, 50, emit)
    else:
        if want("quality"):
            configs = [(w, b) for w in (8, 32, 64, 256) for b in (32, 128, 512)]
            quality(configs, seeds, emit, methods)
        if want("scale"):
            scale(pick(SCALE_SHAPES), dists, max(2, seeds), before, emit, args.reps)
        if want("small"):
            small(SMALL_SHAPES, dists, seeds, before, emit)
        if want("load"):
            under_load(pick(LOAD_SHAPES), dists, args.load_procs, emit)
        if want("curves"):
            scaling_curves(before, emit, args.plot)
        if want("threads"):
            thread_experiment([(8, 128, args.step_ms), (64, 128, args.step_ms),
                               (256, 512, 10 * args.step_ms)], 20, emit, before)
        if want("locality"):
            locality([(4, 128), (4, 512), (8, 128), (8, 512)], seeds, emit)
        if want("tokens"):
            tokens((8, 12, 16), 20, (None, 1.10, 1.05, 1.03, 1.02, 1.01), emit, before)
            tokens((32, 64, 128), 5, (None, 1.05, 1.03, 1.02, 1.01), emit, before, ", more ranks")
        if want("tokens-scale"):
            # Where the capped search stops scaling: ~4W repair and polish steps of ~0.1 ms each.
            tokens((256, 512, 1024), 2, (None, 1.05, 1.02, 1.01), emit, before, ", at scale")
        if want("crowded"):
            crowded(pick([(64, 16), (128, 16), (1024, 16), (4096, 16), (16384, 16)]), seeds, 320, 5000, emit)
    if out:
        out.close()


if __name__ == "__main__":
    main()
