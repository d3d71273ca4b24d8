"""Benchmark BalancedLoader in the HSTU example's plain training loop (CPU, torchrun).

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/bench_loader.py [--quick] [--json-out FILE] \\
        [--aheads 0 1 2] [train_hstu.py flags, e.g. --steps 30]

Every mode has its own copy of the model (same initial weights) and trains the
same batches; the modes take turns step by step, in rotating order, so noise on
a shared machine hits all of them alike:

* ``loop``: the example's plain loop (``next``, ``.to(device)``, forward,
  backward, step) over the raw batches -- no balancing;
* ``loader/aN``: the same loop over :class:`balancer.BalancedLoader` with
  ``ahead=N``;
* ``shuffler``: TorchRec's pipeline with the in-pipeline shuffler
  (:func:`balancer.create_train_pipeline`), the reference for the balance.

Per mode (steps after the first, which warms up): mean step time on rank 0,
the main thread's wait inside ``next()`` (the slower rank's, per step) as ms
and as a share of the step, the slowest rank's compute (CPU time of its
training thread) and the imbalance (max/mean per-rank cost) before and after.
``same balance``: in how many steps the loader's imbalance after balancing
equals the in-pipeline shuffler's on the same batches (bit for bit). Rank 0
prints a table and appends JSON lines (environment first) to ``--json-out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _env, also when loaded by path

import train_hstu  # noqa: E402
from _env import library_versions  # noqa: E402


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aheads", type=int, nargs="+", default=[0, 1, 2], help="BalancedLoader ahead values")
    p.add_argument("--no-shuffler", action="store_true", help="leave out the in-pipeline shuffler")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 small steps")
    p.add_argument("--json-out", default=None, help="append JSON lines here (rank 0)")
    bench, rest = p.parse_known_args(argv)
    if bench.quick:
        rest = ["--steps", "4", "--batch-size", "8", "--max-seqlen", "64", "--dim", "16", *rest]
    args = train_hstu.parse_args(["--balanced-loader", *rest])
    if args.embedding_kernel == "torch" and not bench.no_shuffler:
        # The in-pipeline shuffler runs inside TorchRec's pipeline, which needs sharded tables.
        p.error("--embedding-kernel torch shards nothing, so the in-pipeline shuffler (TorchRec's pipeline) "
                "cannot run: add --no-shuffler")
    return bench, args


def environment() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False, cwd=ROOT).stdout.strip()
    versions = library_versions()
    return dict(kind="environment", machine=platform.machine(), platform=platform.platform(),
                cpu_count=os.cpu_count(), world=dist.get_world_size(), backend="gloo (CPU)",
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"), versions=versions, commit=commit)


def run(bench: argparse.Namespace, args: argparse.Namespace) -> list[dict[str, Any]]:
    pg = dist.group.WORLD
    assert pg is not None, "init_process_group first"
    device = torch.device("cpu")
    runners: dict[str, train_hstu.Runner] = {"loop": train_hstu.Runner("loop", args, device, pg)}
    for a in bench.aheads:
        runners[f"loader/a{a}"] = train_hstu.Runner("loader", argparse.Namespace(**{**vars(args), "ahead": a}),
                                                    device, pg)
    if not bench.no_shuffler:
        runners["shuffler"] = train_hstu.Runner("shuffler", args, device, pg)
    names, live, step = list(runners), list(runners), 0
    while live:
        k = step % len(live)
        for name in live[k:] + live[:k]:  # rotate who goes first
            if not runners[name].step():
                live.remove(name)
        step += 1
    for r in runners.values():
        r.close()
    ref = runners["shuffler"].log["after"] if "shuffler" in runners else None
    rows = []
    for name in names:
        log = runners[name].log
        timed = slice(1, None) if len(log["step_s"]) > 1 else slice(None)
        step_ms = 1e3 * statistics.fmean(log["step_s"][timed])
        wait_ms = 1e3 * statistics.fmean(log["wait_s"][timed])
        row: dict[str, Any] = dict(
            kind="bench_loader", mode=name, steps=len(log["step_s"]), step_ms=step_ms,
            wait_ms=None if name == "shuffler" else wait_ms,
            wait_pct=None if name == "shuffler" else 100 * wait_ms / step_ms,
            slowest_compute_ms=1e3 * statistics.fmean(log["slowest_s"][timed]),
            imbalance_before=statistics.fmean(log["before"]), imbalance_after=statistics.fmean(log["after"]),
            loss=log["loss"], after=log["after"], wait_s=log["wait_s"], step_s=log["step_s"],
            args={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})
        if ref is not None and name.startswith("loader"):
            row["same_balance_steps"] = sum(a == b for a, b in zip(log["after"], ref, strict=True))
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    base = next(r for r in rows if r["mode"] == "loop")
    print(f"{'mode':<11} {'step ms':>8} {'wait ms':>8} {'wait %':>7} {'slowest compute ms':>18} "
          f"{'speedup':>7} {'imb before':>10} {'after':>6} {'same balance':>12}")
    for r in rows:
        wait = f"{r['wait_ms']:8.2f} {r['wait_pct']:6.2f}%" if r["wait_ms"] is not None else f"{'-':>8} {'-':>7}"
        same = f"{r['same_balance_steps']}/{r['steps']}" if "same_balance_steps" in r else "-"
        print(f"{r['mode']:<11} {r['step_ms']:8.1f} {wait} {r['slowest_compute_ms']:18.1f} "
              f"{base['step_ms'] / r['step_ms']:6.3f}x {r['imbalance_before']:10.3f} {r['imbalance_after']:6.3f} "
              f"{same:>12}", flush=True)


def main(argv: list[str] | None = None) -> int:
    bench, args = parse_args(argv)
    train_hstu.quiet_known_warnings()
    dist.init_process_group("gloo")
    try:
        rows = run(bench, args)
        if dist.get_rank() == 0:
            print_table(rows)
            if bench.json_out:
                os.makedirs(os.path.dirname(os.path.abspath(bench.json_out)), exist_ok=True)
                with open(bench.json_out, "a") as f:
                    for rec in [environment(), *rows]:
                        f.write(json.dumps(rec) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
