"""Single-GPU data-parallel emulation with real kernels: balancer off vs on vs equal-size KK.

Emulation (W virtual ranks on one device): every step draws a global batch of
W * B Zipf(alpha) lengths <= max_len (``_e2e_common.sample_lengths``) and deals
it to W ranks in four ways, side by side on the same batch, in an order that
rotates every step so noise hits all alike:

* ``off``: contiguous slices (what a data loader does);
* ``on:flops``: ``balanced_partition`` of ``SelfAttentionCost`` FLOPs;
* ``on:calib``: ``balanced_partition`` of a calibrated ``PolynomialCost``
  (forward + backward timed at a set of lengths, fitted by ``fit_polynomial``);
* ``kk``: ``karmarkar_karp`` (equal-size) of the calibrated cost (``--kk-cost``);
* ``on:online``: ``balanced_partition`` of the model the library's online
  calibration (``balancer._calibrate.OnlineFit``, what ``calibrate=True`` runs
  in the shuffler) fits to the per-rank times this mode measured in earlier
  steps, starting from the FLOPs model; its straggler step by step shows the
  convergence.

``--noise-floor`` adds a control: every rank runs the same ``B`` samples (the
first part of the balanced partition), so its measured max/mean is what
timing noise and the device alone give a perfectly balanced step; a residual
straggler at that floor is not the cost model's.

Some steps cannot be balanced: one long sample plus the ``B - 1`` shortest
outweighs the mean rank. ``bound`` is that step's best possible max/mean under
the calibrated cost (``lower_bound``; FLOPs without calibration), and ``over
bound`` the measured straggler divided by it: what balancing left on the table.

Each rank's forward + backward of a small transformer stack (bf16 on CUDA with
packed varlen FlashAttention; float32 per-sample SDPA on CPU) is timed
separately: CUDA events on a GPU, synchronising only between timed regions;
``perf_counter`` on CPU. Step time = max over ranks. Per configuration:
step time, speedup over ``off``, the ideal speedup the straggler ratios imply
(measured max/mean per-rank compute off / mode), the residual straggler
(measured max/mean), and the cost model's predicted straggler.

Shuffle cost (``_gpu_shuffle.py``): a real 2-rank gloo group on the same
device runs ``BatchShuffler`` around the forward on a side stream, against
compute alone.

Run: ``.venv/bin/python benchmarks/bench_gpu.py`` (``--quick``: toy size on CPU, < 1 min).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
# Benchmark the checkout this file is in, even where an editable install of
# balancer points at another one.
sys.path[:0] = [str(HERE), str(HERE.parent)]
import _gpu_shuffle  # noqa: E402
from _e2e_common import sample_lengths  # noqa: E402
from _gpu_common import (  # noqa: E402
    VOCAB,
    Dims,
    Packed,
    RegionTimer,
    Transformer,
    build,
    count_syncs,
    dtype_for,
    fwd_bwd_times,
    pack,
)

from balancer import SelfAttentionCost, fit_polynomial  # noqa: E402
from balancer._calibrate import CostModel, OnlineFit, features  # noqa: E402
from balancer.partition import balanced_partition, karmarkar_karp, lower_bound  # noqa: E402
from balancer.testing import run_workers  # noqa: E402

MAX_COST = 2**62  # as balancer.workloads: int64 costs with headroom


def cost_values(coeffs: tuple[float, float, float], lengths: np.ndarray) -> np.ndarray:
    """``a L^2 + b L + c`` as int64, as ``PolynomialCost`` / ``SelfAttentionCost`` compute it."""
    a, b, c = coeffs
    x = lengths.astype(np.float64)
    return np.clip(np.rint((a * x + b) * x + c), 0, MAX_COST).astype(np.int64)


def calibrate(model: Transformer, backend: str, device: torch.device, max_len: int, tokens: int,
              seed: int) -> dict[str, Any]:
    """Per-sample forward + backward time at 8 lengths, fitted by ``fit_polynomial``.

    Each point packs ``k = max(1, tokens // L)`` samples of length ``L`` and
    divides by ``k``: on a GPU a lone short sample measures only the launch
    floor, which a packed rank pays once, not per sample.
    """
    rng = np.random.default_rng([seed, 99])
    timer = RegionTimer(device)
    lengths = np.unique(np.geomspace(8, max_len, 8).astype(np.int64))
    times = []
    for n in lengths:
        k = max(1, tokens // int(n))
        p = pack(np.full(k, n), rng.integers(0, VOCAB, k * n), np.zeros(k), device, backend == "loop")
        fwd_bwd_times(model, [p], backend, timer)  # warm-up
        times.append(statistics.median(fwd_bwd_times(model, [p] * 5, backend, timer)) / k)
    fit = fit_polynomial(lengths, times)
    return {"lengths": lengths.tolist(), "times_s": times, "a": fit.a, "b": fit.b, "c": fit.c,
            "r2": fit.r2, "unit": "ns"}


def base_cost(names: Any) -> str:
    """The cost that ``off``'s prediction, the noise floor and each step's bound use:
    the calibrated one when there is one, else FLOPs."""
    return "calib" if "calib" in names else "flops"


def assign(mode: str, costs: dict[str, np.ndarray], world: int, kk_cost: str) -> list[np.ndarray]:
    """Global sample indices of every rank under ``mode``."""
    if mode == "off":
        return list(np.arange(next(iter(costs.values())).size).reshape(world, -1))
    if mode == "kk":
        return [np.asarray(p) for p in karmarkar_karp(costs[kk_cost], world)]
    if mode == "same":  # the noise-floor control: one balanced part on every rank
        return [np.asarray(balanced_partition(costs[base_cost(costs)], world)[0])] * world
    return [np.asarray(p) for p in balanced_partition(costs[mode.split(":")[1]], world)]


def max_over_mean(x: Sequence[float]) -> float:
    return float(max(x) / (sum(x) / len(x))) if sum(x) > 0 else 1.0


class Online:
    """``on:online``: the library's online fit, fed with this mode's measured per-rank times.

    Its first partitions use the FLOPs model (``SelfAttentionCost``, also the
    fit's ``w`` feature), as the shuffler with ``calibrate=True`` starts from
    its ``workload_fn``; once the fit has ``min(16, 2 W)`` (rank, step)
    observations, the fitted per-sample model ``alpha w + beta L^2 + gamma L
    + delta`` replaces it, refitted after every step.
    """

    def __init__(self, flops: tuple[float, float, float], world: int) -> None:
        self.flops, self.world = flops, world
        self.fit = OnlineFit(min_observations=min(16, 2 * world))
        self.model: CostModel | None = None
        self.fitted_at: int | None = None  # the first step partitioned with a fitted model

    def costs(self, lengths: np.ndarray, step: int) -> np.ndarray:
        w = cost_values(self.flops, lengths).astype(np.float64)
        if self.model is None:
            return w
        if self.fitted_at is None:
            self.fitted_at = step
        return self.model.costs(w, lengths)

    def observe(self, step: int, lengths: np.ndarray, parts: list[np.ndarray], seconds: list[float]) -> None:
        dest = np.empty(lengths.size, np.int64)
        for r, p in enumerate(parts):
            dest[p] = r
        w = cost_values(self.flops, lengths).astype(np.float64)
        self.fit.record(step, features(w, lengths, dest, np.ones(lengths.size, bool), self.world))
        self.fit.observe(np.full(self.world, step), np.asarray(seconds, np.float64))
        self.model = self.fit.fit()


def run_config(model: Transformer, backend: str, device: torch.device, world: int, b: int,
               a: argparse.Namespace, coeffs: dict[str, tuple[float, float, float]],
               modes: list[str]) -> dict[str, Any]:
    """Measured per-rank times and predicted loads of every mode, every step."""
    timer = RegionTimer(device)
    steps: list[dict[str, Any]] = []
    online = Online(flops_coefficients(a), world) if "on:online" in modes else None
    for s in range(-1, a.steps):  # step -1 warms up and is dropped
        rng = np.random.default_rng([a.seed, world, b, max(s, 0)])
        lengths = sample_lengths("zipf", world * b, a.max_len, rng, a.alpha)
        ids, labels = rng.integers(0, VOCAB, int(lengths.sum())), rng.integers(0, 2, world * b)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        costs: dict[str, np.ndarray] = {c: cost_values(co, lengths) for c, co in coeffs.items()}
        if online is not None:
            costs["online"] = online.costs(lengths, s)
        base = costs[base_cost(costs)]
        rec: dict[str, Any] = {"bound": lower_bound(base, world) / (float(base.sum()) / world)}
        order = modes + (["same"] if a.noise_floor else [])
        k = s % len(order)
        for m in order[k:] + order[:k]:
            parts = assign(m, costs, world, a.kk_cost)
            packs = [pack(lengths[p], np.concatenate([ids[offsets[i]:offsets[i + 1]] for i in p]),
                          labels[p], device, backend == "loop") for p in parts]
            times, spread = timed_ranks(model, packs, backend, timer, a.repeats)
            rec[m] = {"times": times, "spread": spread,
                      "pred": {c: max_over_mean([float(v[p].sum()) for p in parts]) for c, v in costs.items()}}
            if m == "on:online" and online is not None and s >= 0:  # the warm-up step's times are not kept
                online.observe(s, lengths, parts, rec[m]["times"])
        if s >= 0:
            steps.append(rec)
    res = summarize(steps, modes, a.kk_cost, base_cost(coeffs))
    if online is not None:
        on = res["on:online"]
        by_step = [max_over_mean(st["on:online"]["times"]) for st in steps]
        on["straggler_by_step"] = by_step
        on["fitted_from_step"] = online.fitted_at
        on["observations"] = online.fit.observations
        after = by_step[online.fitted_at:] if online.fitted_at is not None else []
        on["straggler_fitted"] = statistics.median(after) if after else None
        over = [x / st["bound"] for x, st in zip(by_step, steps, strict=True)][online.fitted_at or 0:]
        on["over_bound_fitted"] = statistics.median(over) if online.fitted_at is not None else None
        on["model"] = None if online.model is None else dataclasses.asdict(online.model)
    res["bound_by_step"] = [st["bound"] for st in steps]
    if a.noise_floor:
        by_step = [max_over_mean(st["same"]["times"]) for st in steps]
        res["noise_floor"] = {"straggler": statistics.median(by_step), "straggler_by_step": by_step,
                              "rank_ms": 1e3 * statistics.median(sum(st["same"]["times"]) / world for st in steps)}
    return res


def timed_ranks(model: Transformer, packs: list[Packed], backend: str, timer: RegionTimer,
                repeats: int) -> tuple[list[float], list[float]]:
    """Each rank's forward + backward seconds, the median of ``repeats`` timings
    (all ranks once per round, so drifts hit every rank alike), and each rank's
    spread (max - min) / median over the rounds (0 with one round).

    One timing per rank makes the step's max over W ranks biased upward by
    timing noise alone; the spread says how much of a residual straggler
    that can be."""
    per_rank = list(zip(*(fwd_bwd_times(model, packs, backend, timer) for _ in range(repeats)), strict=True))
    times = [statistics.median(col) for col in per_rank]
    spread = [(max(col) - min(col)) / t if t > 0 else 0.0 for col, t in zip(per_rank, times, strict=True)]
    return times, spread


def flops_coefficients(a: argparse.Namespace) -> tuple[float, float, float]:
    """``SelfAttentionCost``'s ``(a, b, c)`` for the benchmark's model."""
    return SelfAttentionCost(["seq"], a.hidden, a.heads, num_layers=a.layers).coefficients()


def summarize(steps: list[dict[str, Any]], modes: list[str], kk_cost: str, base_cost: str) -> dict[str, Any]:
    """Medians over steps, per mode (see the module docstring)."""
    med = statistics.median
    res: dict[str, Any] = {}
    for m in modes:
        t = [st[m]["times"] for st in steps]
        own = {"off": base_cost, "kk": kk_cost}.get(m, m.split(":")[-1])
        res[m] = {
            "step_ms": 1e3 * med(max(x) for x in t),
            "mean_rank_ms": 1e3 * med(sum(x) / len(x) for x in t),
            "straggler": med(max_over_mean(x) for x in t),
            "over_bound": med(max_over_mean(st[m]["times"]) / st["bound"] for st in steps),
            "ideal_speedup": med(max_over_mean(o["off"]["times"]) / max_over_mean(o[m]["times"]) for o in steps),
            "predicted_straggler": med(st[m]["pred"][own] for st in steps),
            "predicted_by": own,
            "predicted_straggler_by_cost": {c: med(st[m]["pred"][c] for st in steps) for c in steps[0][m]["pred"]},
            "rank_ms_first_step": [1e3 * x for x in t[0]],
            "timing_spread": med(x for st in steps for x in st[m]["spread"]),
        }
    for m in modes:
        res[m]["speedup"] = res["off"]["step_ms"] / res[m]["step_ms"]
    return res


def format_rows(world: int, b: int, res: dict[str, Any], costs: list[str]) -> list[str]:
    """One table row per mode; ``pred <cost>``: max/mean of the cost model's per-rank loads."""
    out = []
    for m, r in res.items():
        pred = " ".join(f"{r['predicted_straggler_by_cost'][c]:>10.3f}" for c in costs)
        out.append(f"{world:>3} {b:>4} {m:>9} | {r['step_ms']:>8.2f} {r['speedup']:>7.3f} "
                   f"{r['ideal_speedup']:>6.3f} | {r['mean_rank_ms']:>8.2f} {r['straggler']:>9.3f} "
                   f"{r['over_bound']:>8.3f} | {pred}")
    return out


def online_line(on: dict[str, Any]) -> str:
    """The online fit's convergence: straggler per step, from which step the fit partitioned, the model."""
    steps = " ".join(f"{x:.3f}" for x in on["straggler_by_step"])
    if on["fitted_from_step"] is None:
        return f"    on:online straggler by step: {steps} (too few observations to fit)"
    m = on["model"]
    if m is None:  # the last fit found no per-sample term: the FLOPs model partitions, as in the shuffler
        return (f"    on:online straggler by step: {steps}; fitted from step {on['fitted_from_step']}, median since "
                f"{on['straggler_fitted']:.3f}; last fit: per-rank constant only (back to the FLOPs model)")
    return (f"    on:online straggler by step: {steps}; fitted from step {on['fitted_from_step']}, median since "
            f"{on['straggler_fitted']:.3f} ({on['over_bound_fitted']:.3f} over the bound); model {m['alpha']:.3g} w + {m['beta']:.3g} L^2 + {m['gamma']:.3g} L "
            f"+ {m['delta']:.3g} s (rel. error {m['rel_error']:.3f})")


def header(costs: list[str]) -> str:
    pred = " ".join(f"{'pred ' + c:>10}" for c in costs)
    return (f"{'W':>3} {'B':>4} {'mode':>9} | {'step ms':>8} {'speedup':>7} {'ideal':>6} | "
            f"{'rank ms':>8} {'straggler':>9} {'over bd':>8} | {pred}")


def plot(rows: list[dict[str, Any]], modes: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(rows), 3.6))
    width = 0.8 / len(modes)
    for j, m in enumerate(modes):
        ax.bar([i + (j - (len(modes) - 1) / 2) * width for i in range(len(rows))],
               [r["modes"][m]["speedup"] for r in rows], width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [f"W={r['world']}\nB={r['batch_size']}" for r in rows])
    ax.set_ylabel("step-time speedup over off")
    ax.set_title(f"bench_gpu on {rows[0].get('gpu', rows[0]['device'])} ({rows[0]['attention']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16], help="virtual ranks W")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64], help="samples per rank B")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of the lengths")
    p.add_argument("--steps", type=int, default=8, help="measured global batches per configuration")
    p.add_argument("--repeats", type=int, default=1,
                   help="timings of each rank per step (median kept; >1 also reports the timing spread)")
    p.add_argument("--noise-floor", action="store_true",
                   help="also time every rank on the same samples (the straggler timing noise alone gives)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: cuda if available (cpu with --quick)")
    p.add_argument("--attn", default="auto", choices=["auto", "varlen", "loop"],
                   help="auto: varlen_attn on CUDA if it works, per-sample SDPA otherwise")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--costs", nargs="+", default=["flops", "calib", "online"], choices=["flops", "calib", "online"],
                   help="cost models to balance with (one on:<cost> mode each)")
    p.add_argument("--kk-cost", default="calib", choices=["flops", "calib"])
    p.add_argument("--calib-tokens", type=int, default=16384, help="tokens per calibration point")
    p.add_argument("--shuffle-batch-size", type=int, default=64, help="B of the 2-rank shuffle section")
    p.add_argument("--shuffle-steps", type=int, default=10)
    p.add_argument("--shuffle-reps", type=int, default=3)
    p.add_argument("--no-shuffle", action="store_true", help="skip the 2-rank shuffle section")
    p.add_argument("--json-out", default="bench_out/gpu.jsonl")
    p.add_argument("--plot", default="", metavar="PATH", help="write a speedup bar plot (matplotlib)")
    p.add_argument("--quick", action="store_true", help="toy size (CPU unless --device cuda), < 1 min")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: expected >= 1")
    if a.quick:
        a.world_sizes, a.batch_sizes, a.max_len, a.steps = [2, 4], [4, 8], 256, 3
        a.hidden, a.heads, a.layers, a.calib_tokens = 32, 2, 1, 512
        a.shuffle_batch_size, a.shuffle_steps, a.shuffle_reps = 8, 4, 2
        a.device = "cpu" if a.device == "auto" else a.device
    if a.kk_cost not in a.costs or a.kk_cost == "online":
        a.kk_cost = next((c for c in a.costs if c != "online"), "flops")
    dims = Dims(a.hidden, a.heads, a.layers)
    device, backend, why, env, model = build(a.device, a.attn, dims, p.error)
    print(f"device {device} ({env.get('gpu', env['platform'])}), torch {env['torch']}, CUDA {env['torch_cuda']}, "
          f"{dtype_for(device)}; attention: {why}")
    coeffs: dict[str, tuple[float, float, float]] = {}
    meta: dict[str, Any] = {"attention": backend, "attention_note": why, "dtype": str(dtype_for(device)), "hidden": a.hidden,
                            "heads": a.heads, "layers": a.layers, "max_len": a.max_len, "alpha": a.alpha}
    if device.type == "cuda":
        # The timed regions must not block the host: count what one fwd+bwd syncs.
        rng, syncs = np.random.default_rng(0), [0]
        lengths = sample_lengths("zipf", 32, a.max_len, rng, a.alpha)
        probe = pack(lengths, rng.integers(0, VOCAB, int(lengths.sum())), np.zeros(32), device, backend == "loop")
        fwd_bwd_times(model, [probe], backend, RegionTimer(device))
        with count_syncs(syncs, 0, True):
            model(probe, backend).backward()
        # Again with the embedding table frozen: where the syncs come from.
        model.emb.weight.requires_grad_(False)
        frozen = [0]
        with count_syncs(frozen, 0, True):
            model(probe, backend).backward()
        model.emb.weight.requires_grad_(True)
        model.zero_grad(set_to_none=True)
        meta["compute_syncs_per_fwd_bwd"] = syncs[0]
        meta["compute_syncs_without_embedding_grad"] = frozen[0]
        print(f"synchronising calls in one forward+backward: {syncs[0]}, {frozen[0]} with the embedding "
              "table frozen")
    if "flops" in a.costs or a.kk_cost == "flops":
        coeffs["flops"] = flops_coefficients(a)
    if "calib" in a.costs:
        cal = calibrate(model, backend, device, a.max_len, a.calib_tokens, a.seed)
        coeffs["calib"] = (cal["a"], cal["b"], cal["c"])
        meta["calibration"] = cal
        print(f"calibrated per-sample fwd+bwd: {cal['a']:.3g} ns*L^2 + {cal['b']:.3g} ns*L + {cal['c']:.3g} ns "
              f"(R^2={cal['r2']:.4f})")
    modes = ["off", "kk", *(f"on:{c}" for c in a.costs)]
    out_path = Path(a.json_out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    print("\n" + header(list(coeffs)))
    with out_path.open("a") as f:
        for world in a.world_sizes:
            for b in a.batch_sizes:
                res = run_config(model, backend, device, world, b, a, coeffs, modes)
                floor = res.pop("noise_floor", None)
                bounds = res.pop("bound_by_step")
                row = {"bench": "gpu_emulation", **env, **meta, "world": world, "batch_size": b,
                       "steps": a.steps, "kk_cost": a.kk_cost, "repeats": a.repeats, "modes": res,
                       "bound_by_step": bounds, "noise_floor": floor}
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                print("\n".join(format_rows(world, b, res, list(coeffs))), flush=True)
                print("    bound (best possible max/mean) by step: " + " ".join(f"{x:.3f}" for x in bounds))
                if a.repeats > 1:
                    spreads = " ".join(f"{m} {100 * r['timing_spread']:.1f}%" for m, r in res.items())
                    print(f"    timing spread (max-min)/median over {a.repeats} repeats, median: {spreads}")
                if "on:online" in res:
                    print(online_line(res["on:online"]), flush=True)
                if floor is not None:
                    print(f"    noise floor, every rank on the same {b} samples ({floor['rank_ms']:.2f} ms): "
                          f"straggler median {floor['straggler']:.3f}, by step "
                          + " ".join(f"{x:.3f}" for x in floor["straggler_by_step"]), flush=True)
        if not a.no_shuffle:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            cfg = {"device": str(device), "backend": backend, "dims": dataclasses.asdict(dims),
                   "cost": coeffs[a.kk_cost], "cost_model": a.kk_cost, "batch_size": a.shuffle_batch_size,
                   "steps": a.shuffle_steps, "reps": a.shuffle_reps, "max_len": a.max_len, "alpha": a.alpha,
                   "seed": a.seed}
            sh = _gpu_shuffle.summarize(cfg, run_workers(_gpu_shuffle.worker, 2, cfg, timeout=300))
            f.write(json.dumps({"bench": "gpu_shuffle", **env, **meta, **sh}) + "\n")
            print("\n" + _gpu_shuffle.format_table(sh))
    if a.plot:
        plot(rows, modes, a.plot)
        print(f"wrote {a.plot}")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
