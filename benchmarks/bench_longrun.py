"""Long run: many shuffles with handles in flight leak nothing.

W gloo ranks (CPU) run ``--shuffles`` shuffles with two handles in flight at
every step (the next one starts before the previous one finishes, as in the
pipeline), cycling through batches with different real-sample counts, both
comm paths and the default planner process. Every ``--every`` shuffles each
rank records its resident memory, Python threads, open file descriptors and
child processes. The table shows the first checkpoint after warm-up, the last,
and the largest value seen; JSON lines carry every checkpoint.

Run: ``.venv/bin/python benchmarks/bench_longrun.py`` (10,000 shuffles, W=2,
a few minutes); ``--quick`` for 400.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from balancer.shuffler import BatchShuffler  # noqa: E402
from balancer.testing import run_workers  # noqa: E402
from tests.test_shuffler import make_batch, token_count  # noqa: E402


def resources() -> dict[str, float]:
    """This process's resident MiB, threads, open fds and live child processes."""
    pid = os.getpid()
    with open("/proc/self/statm") as f:
        rss_mib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    children = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children += 1
            except (OSError, ValueError, IndexError):
                continue
    return {"rss_mib": rss_mib, "threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "children": children}


def worker(rank: int, world: int, shuffles: int, every: int) -> list[dict[str, float]]:
    batches = [make_batch(rank, 16, 16 - (i % 5) * rank, seed=i) for i in range(16)]
    shufflers = [BatchShuffler(token_count, comm="all2all"), BatchShuffler(token_count, comm="allgather")]
    records = []
    pending: list[tuple[Any, Any, Any]] = []
    t0 = time.perf_counter()
    for i in range(shuffles):
        s = shufflers[(i // 100) % 2]  # switch paths every 100 shuffles
        if pending and pending[0][0] is not s:  # finish the other shuffler's handle first
            p, b, h = pending.pop(0)
            p.finish_shuffle(b, h)
        batch = batches[i % len(batches)]
        pending.append((s, batch, s.start_shuffle_async(batch)))
        if len(pending) == 2:  # two handles in flight
            p, b, h = pending.pop(0)
            p.finish_shuffle(b, h)
        if (i + 1) % every == 0:
            records.append({"shuffles": i + 1, "seconds": time.perf_counter() - t0, **resources()})
    for p, b, h in pending:
        p.finish_shuffle(b, h)
    for s in shufflers:
        s.close()
    records.append({"shuffles": shuffles, "seconds": time.perf_counter() - t0, "closed": 1, **resources()})
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shuffles", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json-out", default="bench_out/longrun.jsonl")
    ap.add_argument("--quick", action="store_true", help="400 shuffles, a checkpoint every 100")
    a = ap.parse_args()
    if a.quick:
        a.shuffles, a.every = 400, 100
    if not 1 <= a.every <= a.shuffles or a.world < 1:
        ap.error(f"--shuffles {a.shuffles} --every {a.every} --world {a.world}: expected 1 <= every <= shuffles "
                 "(a checkpoint at least once) and world >= 1")
    per_rank = run_workers(worker, a.world, a.shuffles, a.every, timeout=7200)
    out = Path(a.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()}
    print(f"{a.shuffles} shuffles on {a.world} gloo ranks, two handles in flight, all2all/allgather alternating")
    print(f"{'rank':>4} {'metric':>9} | {'first':>8} {'last':>8} {'max':>8} {'closed':>8}")
    with out.open("a") as f:
        for rank, recs in enumerate(per_rank):
            for r in recs:
                f.write(json.dumps({"bench": "longrun", "rank": rank, "world": a.world, **env, **r}) + "\n")
            run, closed = [r for r in recs if "closed" not in r], recs[-1]
            warm = run[1] if len(run) > 1 else run[0]  # the first checkpoint includes start-up
            for metric in ("rss_mib", "threads", "fds", "children"):
                print(f"{rank:>4} {metric:>9} | {warm[metric]:>8.1f} {run[-1][metric]:>8.1f} "
                      f"{max(r[metric] for r in run):>8.1f} {closed[metric]:>8.1f}")
            print(f"{rank:>4} {'ms/shuffle':>9} | {1e3 * run[-1]['seconds'] / run[-1]['shuffles']:>8.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
