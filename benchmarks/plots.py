"""PNG plots for docs/benchmarks.md from the benchmarks' JSON lines.

Run after the benchmarks (needs the ``bench`` extra, matplotlib)::

    .venv/bin/python benchmarks/plots.py --e2e bench_out/e2e.jsonl \\
        --shuffle bench_out/shuffle.jsonl --partition bench_out/partition.jsonl --out docs/img

Writes ``e2e_loads.png`` (per-rank load before/after for one step),
``e2e_speedup_vs_skew.png`` (projected and measured speedup against the Zipf
exponent of the lengths) and ``shuffle_bytes.png`` (bytes each rank sends
per shuffle, both paths) and ``partition_methods.png`` (time and quality
against N for our partitioners and the reference implementations);
``bench_partition.py --plot`` draws ``partition_time.png`` itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def plot_loads(rows: list[dict[str, Any]], out: Path) -> None:
    cands = [r for r in rows if r.get("bench") == "e2e" and "sample_loads" in r]
    if not cands:
        return
    r = max(cands, key=lambda r: (r["world"], r["dist"] == "zipf", r["batch_size"]))
    before, after = r["sample_loads"]["before"], r["sample_loads"]["after"]
    scale = max(before)
    w = len(before)
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    xs = range(w)
    ax.bar([x - 0.2 for x in xs], [v / scale for v in before], 0.4, label="before (as loaded)")
    ax.bar([x + 0.2 for x in xs], [v / scale for v in after], 0.4, label="after balancer")
    ax.axhline(sum(before) / w / scale, color="k", lw=0.8, ls="--", label="mean")
    ax.set_xticks(list(xs), [f"rank {i}" for i in xs])
    ax.set_ylabel("estimated load / max before")
    ax.set_title(f"Per-rank workload, one step (W={w}, {r['dist']}, B={r['batch_size']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e_loads.png", dpi=120)
    plt.close(fig)


def plot_speedup_vs_skew(rows: list[dict[str, Any]], out: Path) -> None:
    sweep = [r for r in rows if r.get("bench") == "e2e_skew"]
    meas = [r for r in rows if r.get("bench") == "e2e" and r["dist"] == "zipf" and r["batch_size"] == 64]
    if not sweep:
        return
    fig, ax = plt.subplots(figsize=(8.2, 3.6))
    for i, world in enumerate(sorted({r["world"] for r in sweep})):
        sub = sorted((r for r in sweep if r["world"] == world), key=lambda r: -r["alpha"])
        color = f"C{i}"
        ax.plot([r["alpha"] for r in sub], [r["projected_speedup"] for r in sub], marker="o", ms=3,
                color=color, label=f"W={world}, shuffle hidden")
        if "projected_speedup_gloo" in sub[0]:
            ax.plot([r["alpha"] for r in sub], [r["projected_speedup_gloo"] for r in sub], ls="--",
                    color=color, lw=0.9, label=f"W={world}, + overhead measured on gloo")
    for r in meas:
        ax.scatter([1.2], [r["speedup"]], marker="x", s=50, zorder=3, color="k")
    if meas:
        ax.scatter([], [], marker="x", color="k", label="measured (W=2, 4), B=64")
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.invert_xaxis()
    ax.set_xlabel("Zipf exponent alpha of sequence lengths (heavier tail to the right)")
    ax.set_ylabel("step-time speedup")
    ax.set_title("Speedup against skew (zipf lengths, max 4096, B=64)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(out / "e2e_speedup_vs_skew.png", dpi=120)
    plt.close(fig)


def plot_shuffle_bytes(rows: list[dict[str, Any]], out: Path) -> None:
    res = [r for r in rows if r.get("kind") == "result" and r.get("dist") == "zipf"]
    if not res:
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, world in zip(axes, (2, 4), strict=False):
        sub = [r for r in res if r["world_size"] == world]
        for (comm, loc), label in (
            (("allgather", True), "AllGather"),
            (("all2all", False), "All2All, placement-blind"),
            (("all2all", True), "All2All + locality"),
        ):
            pts = sorted((r["batch_size"], r["bytes_per_rank"] / 1e3) for r in sub
                         if r["comm"] == comm and r["locality"] == loc)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size per rank")
        ax.set_title(f"W={world}, zipf lengths")
    axes[0].set_ylabel("KB sent per rank per shuffle")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "shuffle_bytes.png", dpi=120)
    plt.close(fig)


def plot_partition_methods(rows: list[dict[str, Any]], out: Path) -> None:
    """Time per call and quality against N, every method of the partition suite."""
    q = [r for r in rows if r.get("kind") == "quality"]
    if not q:
        return
    fig, (ax_t, ax_q) = plt.subplots(1, 2, figsize=(9, 3.4))
    methods = ["none", "LPT (heap)", "KK (heap)", "karmarkar_karp", "balanced_partition"]
    for i, m in enumerate(methods):
        by_n: dict[int, list[dict[str, Any]]] = {}
        for r in q:
            if r["method"] == m:
                by_n.setdefault(r["N"], []).append(r)
        ns = sorted(by_n)
        if not ns:
            continue
        t = [statistics.median(r["time_ms"] for r in by_n[n]) for n in ns]
        g = [max(max(r["gap_median"] for r in by_n[n]), 1e-10) for n in ns]
        style = dict(marker="o", ms=3, color=f"C{i}", lw=2 if m == "balanced_partition" else 1)
        if m != "none":
            ax_t.plot(ns, t, label=m, **style)
        ax_q.plot(ns, g, label=m, **style)
    for ax in (ax_t, ax_q):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N = W x B")
    ax_t.set_ylabel("ms per call")
    ax_t.set_title("Time per call (median over shapes, lengths)")
    ax_q.set_ylabel("max load / lower bound - 1")
    ax_q.set_title("Quality (worst shape/lengths at each N)")
    ax_q.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "partition_methods.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e", default="bench_out/e2e.jsonl")
    ap.add_argument("--shuffle", default="bench_out/shuffle.jsonl")
    ap.add_argument("--partition", default="bench_out/partition.jsonl")
    ap.add_argument("--out", default="docs/img")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    e2e = read(a.e2e)
    plot_loads(e2e, out)
    plot_speedup_vs_skew(e2e, out)
    plot_shuffle_bytes(read(a.shuffle), out)
    plot_partition_methods(read(a.partition), out)
    print(f"plots in {out}")


if __name__ == "__main__":
    main()
