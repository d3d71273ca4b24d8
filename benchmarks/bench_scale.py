"""Phase 1 at scale: bytes each rank gathers per step against W, and what balancing
within groups of ranks gives up.

Part 1 (bytes). Every rank all-gathers one message per rank per step:
``8 * (19 + B + ceil(K * B / 2))`` bytes (header, float64 costs, int32 lengths
of K keys). The table gives the bytes one rank receives per step for W up to
8192; the formula is checked against the message a real capture produces.

With ``BatchShuffler(group_size=G)`` a rank receives every other rank's
header and load (160 bytes each) and the full messages of its group only
(``gathered_bytes``; the test suite checks the formula against the words a
real 4-rank run receives).

Part 2 (grouping). Balancing within groups of G ranks: bytes and the
partition's input shrink by about W / G. Simulated on the same Zipf(1.2) <=
4096 batches (cost L**2 + 256 L): the straggler (max/mean rank load) with no
balancing, global balancing, static groups (consecutive ranks; what
a subgroup passed to ``BatchShuffler.shuffle`` does), and the groups ``group_size=G`` forms
every step (``balancer._groups.form_groups``: ranks sorted by load dealt
round-robin, so heavy and light ranks share a group), each group partitioned
with the library's partitioner.

Part 3 (partition time). What every rank's planner spends per step on the
global partition (``partition_rows``, the shuffler's call) as W x B grows past
the partitioner benchmark's N = 262,144, next to one group's partition (G x B
samples) of the hierarchical scheme, on the same workloads.

Run: ``.venv/bin/python benchmarks/bench_scale.py`` (~5 min; ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _e2e_common import sample_lengths  # noqa: E402

from balancer._groups import form_groups, group_message_words  # noqa: E402
from balancer._header import HEADER_LEN  # noqa: E402
from balancer._protocol import NO_PREV, capture, message  # noqa: E402
from balancer.batch import BaseBatch  # noqa: E402
from balancer.partition import balanced_partition, lower_bound  # noqa: E402
from balancer.partition._balanced import partition_rows  # noqa: E402


def message_bytes(b: int, k: int) -> int:
    return 8 * (HEADER_LEN + b + (k * b + 1) // 2)


def gathered_bytes(w: int, b: int, k: int, g: int | None) -> int:
    """Bytes one rank holds after phase 1, its own included: every rank's message
    (global), or every rank's header and load plus its group's messages
    (``group_size=g``; ``group_message_words`` counts the peers' part)."""
    if g is None or w <= g:
        return w * message_bytes(b, k)
    peers = group_message_words(w, g, HEADER_LEN, message_bytes(b, k) // 8 - HEADER_LEN)
    return 8 * (peers + HEADER_LEN + 1) + message_bytes(b, k)


def _check_formula() -> None:
    from tests.test_shuffler import make_batch, token_count

    batch = make_batch(0, 32, 32, seed=0)
    meta = capture(batch, token_count, seq=0, rank=0, config=0, base_type=BaseBatch)
    msg, _ = message(meta, meta.agreement(), NO_PREV)
    assert msg.nbytes == message_bytes(32, meta.num_lengths), (msg.nbytes, meta.num_lengths)


def _straggler(loads: np.ndarray) -> float:
    return float(loads.max() / loads.mean())


def _balanced_loads(cost: np.ndarray, parts_of: int) -> np.ndarray:
    q = np.rint(cost / cost.max() * 2**26).astype(np.int64)
    return np.array([cost[p].sum() for p in balanced_partition(q, parts_of)])


def grouping(w: int, b: int, g: int, steps: int, rng: np.random.Generator, with_global: bool) -> dict[str, float]:
    res: dict[str, list[float]] = {"none": [], "global": [], "static": [], "mixed": []}
    for _ in range(steps):
        lengths = sample_lengths("zipf", w * b, 4096, rng).astype(np.float64)
        cost = (lengths**2 + 256 * lengths).reshape(w, b)
        loads = cost.sum(1)
        res["none"].append(_straggler(loads))
        if with_global:
            res["global"].append(_straggler(_balanced_loads(cost.reshape(-1), w)))
        # "mixed": the groups BatchShuffler(group_size=g) forms (ranks by load, dealt round-robin)
        gid = form_groups(loads, g)
        layouts = {"static": [np.arange(i * g, (i + 1) * g) for i in range(w // g)],
                   "mixed": [np.flatnonzero(gid == i) for i in range(int(gid.max()) + 1)]}
        for name, groups in layouts.items():
            out = [_balanced_loads(cost[members].reshape(-1), members.size) for members in groups]
            res[name].append(_straggler(np.concatenate(out)))
    return {k: float(np.mean(v)) for k, v in res.items() if v}


def partition_time(w: int, b: int, groups: tuple[int, ...], rng: np.random.Generator,
                   reps: int) -> dict[str, float]:
    """Seconds (min over ``reps``) of the global partition of W x B samples and of one
    group's (G x B), and the global result's max/bound - 1."""
    lengths = sample_lengths("zipf", w * b, 4096, rng)
    x = lengths * lengths + 256 * lengths
    out: dict[str, float] = {}
    for name, n_parts in [("global", w)] + [(f"G={g}", g) for g in groups if g < w]:
        sub = x[: n_parts * b]
        secs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            rows = partition_rows(sub, n_parts)
            secs.append(time.perf_counter() - t0)
        out[f"{name}_s"] = min(secs)
        if name == "global":
            out["global_gap"] = float(sub[rows].sum(axis=1).max()) / lower_bound(sub, n_parts) - 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json-out", default="bench_out/scale.jsonl")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    _check_formula()
    out = Path(a.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        print("bytes one rank gathers in phase 1 per step (K = 3 keys): global, and with group_size G")
        print(f"{'W':>6} | " + " ".join(f"{'B=' + str(b):>10}" for b in (32, 128, 512)) + " | "
              + " | ".join(" ".join(f"{f'G={g},B={b}':>13}" for b in (32, 512)) for g in (64, 256)))
        for w in (8, 64, 256, 1024, 4096, 8192):
            row = [w * message_bytes(b, 3) for b in (32, 128, 512)]
            grouped = {g: {b: gathered_bytes(w, b, 3, g) for b in (32, 128, 512)} for g in (64, 256)}
            print(f"{w:>6} | " + " ".join(f"{x / 2**20:>7.2f}MiB" for x in row) + " | "
                  + " | ".join(" ".join(f"{grouped[g][b] / 2**20:>10.2f}MiB" for b in (32, 512)) for g in (64, 256)))
            f.write(json.dumps({"bench": "scale_bytes", "world": w, "bytes": dict(zip((32, 128, 512), row,
                                                                                    strict=True)),
                                "grouped": {str(g): v for g, v in grouped.items()}}) + "\n")
        configs = [(1024, 32, 64), (1024, 128, 64), (1024, 128, 256)] if a.quick else [
            (1024, 32, 16), (1024, 32, 64), (1024, 128, 16), (1024, 128, 64), (1024, 128, 256),
            (256, 512, 16), (256, 512, 64), (4096, 32, 64)]
        print("\nstraggler (max/mean rank load), Zipf(1.2) <= 4096, cost L^2 + 256 L, mean of 2 steps")
        print(f"{'W':>5} {'B':>4} {'G':>4} | {'none':>6} {'global':>7} {'static':>7} {'mixed':>7} | {'s':>5}")
        rng = np.random.default_rng(0)
        for w, b, g in configs:
            t0 = time.perf_counter()
            r = grouping(w, b, g, 1 if a.quick else 2, rng, with_global=w * b <= 131072)
            glob = f"{r['global']:>7.4f}" if "global" in r else f"{'-':>7}"
            print(f"{w:>5} {b:>4} {g:>4} | {r['none']:>6.3f} {glob} {r['static']:>7.4f} {r['mixed']:>7.4f} | "
                  f"{time.perf_counter() - t0:>5.1f}", flush=True)
            f.write(json.dumps({"bench": "scale_grouping", "world": w, "batch_size": b, "group": g, **r}) + "\n")
        shapes = [(1024, 128), (2048, 128)] if a.quick else [
            (1024, 128), (8192, 32), (2048, 512), (8192, 128), (4096, 512), (8192, 512)]
        groups = (64, 256)
        print("\npartition time per step (ms, min of reps), Zipf(1.2) <= 4096, cost L^2 + 256 L: the global "
              "partition (W x B) and one group's (G x B)")
        print(f"{'W':>5} {'B':>4} {'N':>9} | {'global':>7} {'gap':>8} | " + " ".join(f"{'G=' + str(g):>7}"
                                                                                for g in groups))
        for w, b in shapes:
            r = partition_time(w, b, groups, rng, 1 if a.quick or w * b > 2**21 else 3)
            cells = " ".join(f"{1e3 * r[f'G={g}_s']:>7.1f}" if f"G={g}_s" in r else f"{'-':>7}" for g in groups)
            print(f"{w:>5} {b:>4} {w * b:>9,} | {1e3 * r['global_s']:>7.1f} {r['global_gap']:>8.1e} | {cells}",
                  flush=True)
            f.write(json.dumps({"bench": "scale_partition", "world": w, "batch_size": b, **r}) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
