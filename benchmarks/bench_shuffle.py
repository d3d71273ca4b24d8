"""Benchmark the batch shuffler: All2All vs AllGather, locality vs placement-blind.

Starts W gloo ranks on this machine (forkserver workers, see ``balancer.testing``) for each
W, and per (batch size, length distribution) times ``BatchShuffler.shuffle`` on
fresh batches: 4 KJT keys (3 sequence keys of length L, 1 contextual key of
length 1, int64 ids), a dense field [B, 16] float32 and dense labels [B]. The
workload is attention-like, ``L**2 + 64 * L``.

    .venv/bin/python benchmarks/bench_shuffle.py [--quick] [--json-out FILE]

Prints a table and writes JSON lines (first line: hardware and versions).
Columns: ``step ms`` -- median over steps of the slowest rank's synchronous
shuffle (start + finish back to back, so the partition is on the critical
path); ``p2 ovl ms`` -- the same for ``finish_shuffle`` alone once the
partition is done on every rank (what a pipeline that hides the partition
pays); ``sent KB/rank`` -- bytes each rank sends in phase 2 (mean over ranks
and steps); ``batch KB`` -- one rank's batch on the wire; ``moved`` -- share of
real samples that change rank; ``imb`` -- max/mean rank workload before and
after; ``max/LB`` -- max load over the partition lower bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _env import library_versions  # noqa: E402

from balancer._layout import wire_layout  # noqa: E402
from balancer._plan_layout import sample_bytes  # noqa: E402
from balancer._protocol import lengths_matrix  # noqa: E402
from balancer.batch import BaseBatch  # noqa: E402
from balancer.shuffler import BatchShuffler  # noqa: E402
from balancer.testing import run_workers  # noqa: E402

KEYS = ["item", "action", "time", "ctx"]
MAX_LEN = 2048
DISTS = ("uniform", "lognormal", "zipf")
VARIANTS = (("all2all", True), ("all2all", False), ("allgather", True))


@dataclasses.dataclass(kw_only=True)
class BenchBatch(BaseBatch):
    dense: torch.Tensor  # [B, 16]


def draw_lengths(rng: np.random.Generator, dist_name: str, n: int) -> np.ndarray:
    if dist_name == "uniform":
        x = rng.integers(1, 512, size=n)
    elif dist_name == "lognormal":
        x = rng.lognormal(mean=4.5, sigma=1.0, size=n)
    elif dist_name == "zipf":  # heavy tail, most histories short
        x = rng.zipf(1.6, size=n) * 8
    else:
        raise ValueError(f"dist {dist_name!r}, expected one of {DISTS}")
    return np.clip(x, 1, MAX_LEN).astype(np.int64)


def make_batch(rng: np.random.Generator, b: int, dist_name: str) -> BenchBatch:
    seq = draw_lengths(rng, dist_name, b)
    lengths = np.concatenate([seq, seq, seq, np.ones(b, np.int64)])
    values = torch.from_numpy(rng.integers(0, 1 << 40, size=int(lengths.sum())))
    features = KeyedJaggedTensor(keys=KEYS, values=values, lengths=torch.from_numpy(lengths))
    return BenchBatch(features=features, batch_size=b, feature_to_max_seqlen={"item": MAX_LEN},
                      labels=torch.from_numpy(rng.random(b, dtype=np.float32)),
                      dense=torch.from_numpy(rng.random((b, 16), dtype=np.float32)))


def attention_cost(batch: BaseBatch) -> torch.Tensor:
    seq = batch.features.lengths().view(len(KEYS), batch.batch_size)[0]
    return seq * seq + 64 * seq


def _run(shuffler: BatchShuffler, batches: list[BenchBatch], warmup: int, overlap: bool) -> tuple[list[float], list[Any]]:
    """Per step: the slowest-rank-relevant time and the stats.

    ``overlap=False``: ``start`` then ``finish`` back to back (the partition is
    waited for). ``overlap=True``: a pipeline that hides the partition: wait
    until it is done on every rank, then time ``finish`` alone.
    """
    times, stats = [], []
    for j, batch in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        handle = shuffler.start_shuffle_async(batch)
        if overlap:
            while not handle.partition_done():
                time.sleep(1e-4)
            dist.barrier()
            t0 = time.perf_counter()
        shuffler.finish_shuffle(batch, handle)
        if j >= warmup:
            times.append(time.perf_counter() - t0)
            stats.append(handle.stats)
    return times, stats


def _batch_bytes(batch: BaseBatch) -> int:
    """Phase 2 payload bytes of a whole batch (what an all-gather of it moves)."""
    layout = wire_layout(batch)
    lengths = lengths_matrix(batch, layout).numpy()[None]
    return int(sample_bytes(layout.plan_layout(), lengths).sum())


def worker(rank: int, w: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    # One shuffler per variant for every batch size and distribution: its first
    # shuffle sets up two gloo groups and the partition child (~1 s at W = 4 on
    # two cores), which the warm-up steps of each run leave out of the times anyway.
    shufflers = {v: BatchShuffler(attention_cost, comm=v[0], locality=v[1]) for v in VARIANTS}
    try:
        for b, dist_name in itertools.product(cfg["batch_sizes"], cfg["dists"]):
            rng = np.random.default_rng([cfg["seed"], b, rank])
            batches = [make_batch(rng, b, dist_name) for _ in range(cfg["warmup"] + cfg["steps"])]
            for (comm, locality), shuffler in shufflers.items():
                times, stats = _run(shuffler, batches, cfg["warmup"], overlap=False)
                p2_times, _ = _run(shuffler, batches, cfg["warmup"], overlap=True)
                out.append(dict(
                    world_size=w, batch_size=b, dist=dist_name, comm=comm, locality=locality, rank=rank,
                    times=times, p2_times=p2_times,
                    bytes_sent=[s.bytes_sent for s in stats],
                    batch_bytes=[_batch_bytes(x) for x in batches[cfg["warmup"]:]],
                    moved=[s.moved_fraction for s in stats],
                    imb_before=[s.imbalance_before for s in stats],
                    imb_after=[s.imbalance_after for s in stats],
                    over_lb=[s.max_after / s.lower_bound if s.lower_bound else 1.0 for s in stats],
                    phase1=[s.phase1_s for s in stats], partition=[s.partition_s for s in stats],
                ))
    finally:
        for shuffler in shufflers.values():
            shuffler.close()
    return out


def summarise(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for cells in zip(*per_rank, strict=True):
        c0 = cells[0]
        steps = len(c0["times"])
        slowest = [max(c["times"][j] for c in cells) for j in range(steps)]
        slowest_p2 = [max(c["p2_times"][j] for c in cells) for j in range(steps)]

        def med(key: str, cells: tuple[dict[str, Any], ...] = cells) -> float:
            return statistics.median(x for c in cells for x in c[key])

        rows.append(dict(
            world_size=c0["world_size"], batch_size=c0["batch_size"], dist=c0["dist"],
            comm=c0["comm"], locality=c0["locality"],
            step_ms=1e3 * statistics.median(slowest),
            phase2_overlapped_ms=1e3 * statistics.median(slowest_p2),
            bytes_per_rank=statistics.mean(x for c in cells for x in c["bytes_sent"]),
            batch_bytes_per_rank=statistics.mean(x for c in cells for x in c["batch_bytes"]),
            moved_fraction=statistics.mean(c0["moved"]),
            imbalance_before=statistics.mean(c0["imb_before"]),
            imbalance_after=statistics.mean(c0["imb_after"]),
            max_over_lower_bound=statistics.mean(c0["over_lb"]),
            phase1_ms=1e3 * med("phase1"), partition_ms=1e3 * med("partition"),

        ))
    return rows


def environment() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=False).stdout.strip()
        commit += "-dirty" if dirty else ""
    except OSError:
        commit = ""
    versions = library_versions()
    return dict(kind="environment", machine=platform.machine(), processor=platform.processor(),
                platform=platform.platform(), cpu_count=os.cpu_count(), backend="gloo (CPU)",
                versions=versions, commit=commit, partition="balancer.partition.balanced_partition + localize")


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'W':>2} {'B':>4} {'dist':<9} {'path':<9} {'loc':<3} {'step ms':>8} {'sent KB/rank':>12} "
            f"{'batch KB':>9} {'moved':>6} {'imb before':>10} {'after':>6} {'max/LB':>6} {'p1 ms':>6} {'part ms':>7} {'p2 ovl ms':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['world_size']:>2} {r['batch_size']:>4} {r['dist']:<9} {r['comm']:<9} "
              f"{'yes' if r['locality'] else 'no':<3} {r['step_ms']:>8.2f} {r['bytes_per_rank'] / 1e3:>12.1f} "
              f"{r['batch_bytes_per_rank'] / 1e3:>9.1f} {100 * r['moved_fraction']:>5.1f}% "
              f"{r['imbalance_before']:>10.3f} {r['imbalance_after']:>6.3f} {r['max_over_lower_bound']:>6.3f} "
              f"{r['phase1_ms']:>6.2f} {r['partition_ms']:>7.2f} {r['phase2_overlapped_ms']:>9.2f}")


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All2All/AllGather and locality/placement-blind byte ratios per config."""
    out = []
    key = lambda r: (r["world_size"], r["batch_size"], r["dist"])  # noqa: E731
    for k in sorted({key(r) for r in rows}):
        cell = {(r["comm"], r["locality"]): r for r in rows if key(r) == k}
        ag = cell.get(("allgather", True)) or cell.get(("allgather", False))
        loc, blind = cell.get(("all2all", True)), cell.get(("all2all", False))
        if ag is None or blind is None or ag["bytes_per_rank"] == 0:
            continue  # no ratio where nothing is sent (W = 1)
        d = dict(kind="ratio", world_size=k[0], batch_size=k[1], dist=k[2],
                 blind_over_allgather=blind["bytes_per_rank"] / ag["bytes_per_rank"])
        if loc is not None:
            d["local_over_allgather"] = loc["bytes_per_rank"] / ag["bytes_per_rank"]
            d["local_over_blind"] = loc["bytes_per_rank"] / max(blind["bytes_per_rank"], 1)
            d["max_after_local_vs_blind"] = loc["imbalance_after"] / blind["imbalance_after"]
        out.append(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="W=2,4; B=32,128; 3 steps")
    ap.add_argument("--json-out", default=None, help="write JSON lines here")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated, default 32,128,512")
    ap.add_argument("--dists", default="uniform,lognormal,zipf")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = args.batch_sizes or ("32,128" if args.quick else "32,128,512")
    if not set(args.dists.split(",")) <= set(DISTS):
        ap.error(f"--dists: {args.dists!r}; expected a comma-separated subset of {','.join(DISTS)}")
    try:
        batch_sizes, worlds = [int(x) for x in sizes.split(",")], [int(x) for x in args.world_sizes.split(",")]
    except ValueError:
        ap.error("--batch-sizes and --world-sizes take comma-separated ints")
    if min(batch_sizes + worlds) < 1:
        ap.error(f"--batch-sizes {sizes} --world-sizes {args.world_sizes}: expected ints >= 1")
    cfg = dict(batch_sizes=batch_sizes, dists=args.dists.split(","),
               steps=args.steps or (3 if args.quick else 20),
               warmup=1 if args.quick else 2, seed=args.seed)
    env = environment()
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for w in worlds:
        rows += summarise(run_workers(worker, w, cfg, timeout=900))
    print(f"# {env['platform']}, {env['cpu_count']} CPUs, gloo; partition: {env['partition']}; "
          f"{cfg['steps']} steps; {time.perf_counter() - t0:.0f} s")
    print_table(rows)
    rs = ratios(rows)
    print()
    for r in rs:
        extra = "".join(f"  {k}={r[k]:.3f}" for k in ("local_over_allgather", "local_over_blind",
                                                      "max_after_local_vs_blind") if k in r)
        print(f"W={r['world_size']} B={r['batch_size']:>3} {r['dist']:<9} "
              f"blind/allgather={r['blind_over_allgather']:.3f}{extra}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            for rec in [env, *({"kind": "result", **r} for r in rows), *rs]:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
