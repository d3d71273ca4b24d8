"""Smoke test: ``benchmarks/bench_gpu.py --quick`` runs on CPU and writes a well-formed
table, JSON lines and plot. Checks shapes and invariants, never timings."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODES = {"off", "kk", "on:flops", "on:calib", "on:online"}
ROW = re.compile(r"^ *(\d+) +(\d+) +(off|kk|on:flops|on:calib|on:online) \|(.*)$", re.M)


def test_bench_gpu_quick(tmp_path: Path) -> None:
    out, png = tmp_path / "gpu.jsonl", tmp_path / "gpu.png"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--quick", "--repeats", "2", "--noise-floor", "--json-out", str(out)]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if has_mpl:
        cmd += ["--plot", str(png)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    tail = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, tail

    # Table: one row per (W, B, mode), every configuration of --quick.
    rows = ROW.findall(proc.stdout)
    assert {(int(w), int(b), m) for w, b, m, _ in rows} == {
        (w, b, m) for w in (2, 4) for b in (4, 8) for m in MODES}, tail
    assert "pred flops" in proc.stdout and "pred calib" in proc.stdout
    assert len(re.findall(r"timing spread \(max-min\)/median over 2 repeats", proc.stdout)) == 4, tail
    assert len(re.findall(r"noise floor, every rank on the same \d+ samples", proc.stdout)) == 4, tail
    for mode in ("none", "fenced", "side"):
        assert re.search(rf"^ *{mode} \| +[\d.]+", proc.stdout, re.M), tail

    records = [json.loads(line) for line in out.read_text().splitlines()]
    emu = [r for r in records if r["bench"] == "gpu_emulation"]
    shuffle = [r for r in records if r["bench"] == "gpu_shuffle"]
    assert len(emu) == 4 and len(shuffle) == 1
    for r in records:
        for key in ("torch", "torch_cuda", "torchrec", "numpy", "python", "platform", "device", "attention"):
            assert key in r, key
        assert r["device"] == "cpu" and r["attention"] == "loop"
    for r in emu:
        assert set(r["modes"]) == MODES
        assert r["repeats"] == 2
        assert len(r["bound_by_step"]) == r["steps"] and min(r["bound_by_step"]) >= 1.0
        floor = r["noise_floor"]
        assert len(floor["straggler_by_step"]) == r["steps"] and min(floor["straggler_by_step"]) >= 1.0
        assert floor["straggler"] == sorted(floor["straggler_by_step"])[1] and floor["rank_ms"] > 0
        cal = r["calibration"]
        assert min(cal["a"], cal["b"], cal["c"]) >= 0 and len(cal["lengths"]) == len(cal["times_s"])
        for m, v in r["modes"].items():
            for key in ("step_ms", "mean_rank_ms", "speedup", "ideal_speedup"):
                assert math.isfinite(v[key]) and v[key] > 0, (m, key)
            assert v["straggler"] >= 1.0 and v["predicted_straggler"] >= 1.0
            assert len(v["rank_ms_first_step"]) == r["world"]
            assert math.isfinite(v["timing_spread"]) and v["timing_spread"] >= 0, (m, v["timing_spread"])
            assert math.isfinite(v["over_bound"]) and v["over_bound"] > 0, (m, v["over_bound"])
        off = r["modes"]["off"]
        assert off["speedup"] == 1.0 and off["ideal_speedup"] == 1.0
        # Balancing never raises the straggler its own cost model predicts.
        for cost in ("flops", "calib"):
            on = r["modes"][f"on:{cost}"]
            assert on["predicted_by"] == cost
            assert on["predicted_straggler_by_cost"][cost] <= off["predicted_straggler_by_cost"][cost] + 1e-9
        # The online fit: W observations a step, min(16, 2 W) after 2 steps (3 steps in
        # --quick), so the third step partitions with the fitted model -- unless the
        # times (noisy on a loaded box) fit no per-sample term, when the fit declines.
        online = r["modes"]["on:online"]
        assert len(online["straggler_by_step"]) == r["steps"] == 3
        assert min(online["straggler_by_step"]) >= 1.0
        assert online["observations"] == 3 * r["world"]
        model = online["model"]
        if online["fitted_from_step"] is None:
            assert online["straggler_fitted"] is None and online["over_bound_fitted"] is None
        else:
            assert online["fitted_from_step"] == 2
            assert online["straggler_fitted"] == online["straggler_by_step"][2]
            assert online["over_bound_fitted"] == online["straggler_by_step"][2] / r["bound_by_step"][2]
        if model is not None:
            assert min(model["alpha"], model["beta"], model["gamma"], model["delta"]) >= 0
            assert model["alpha"] + model["beta"] + model["gamma"] + model["delta"] > 0
            assert model["observations"] <= 3 * r["world"]

    sh = shuffle[0]
    assert sh["shuffle_matches"] is True
    assert 1.0 <= sh["imbalance_after"] <= sh["imbalance_before"]
    for mode in ("none", "fenced", "side"):
        assert sh[f"{mode}_step_ms"] > 0 and sh[f"{mode}_blocked_ms"] >= 0
        assert sh[f"{mode}_syncs_per_step"] is None  # counted on CUDA only
        assert sh[f"{mode}_other_thread_syncs_per_step"] is None
    if has_mpl:
        assert png.stat().st_size > 0


def test_noise_floor_control_gives_every_rank_the_same_balanced_part() -> None:
    sys.path[:0] = [str(ROOT / "benchmarks")]
    try:
        import bench_gpu
    finally:
        del sys.path[0]
    from balancer.partition import balanced_partition

    rng = np.random.default_rng(0)
    costs = {"flops": rng.integers(1, 1000, 24), "calib": rng.integers(1, 1000, 24)}
    parts = bench_gpu.assign("same", costs, 4, "calib")
    want = np.asarray(balanced_partition(costs["calib"], 4)[0])
    assert len(parts) == 4 and all(np.array_equal(p, want) for p in parts)
    assert len(bench_gpu.assign("same", {"flops": costs["flops"]}, 4, "flops")[0]) == 6


LLM_MODES = ("off", "verl", "kk:flops", "balancer", "balancer:free")
LLM_ROW = re.compile(r"^\| (\d+)x(\d+) \| (off|verl|kk:flops|balancer|balancer:free) \|(.*)\|$", re.M)


def test_bench_gpu_llm_quick(tmp_path: Path) -> None:
    out = tmp_path / "gpu_llm.jsonl"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_gpu_llm.py"), "--quick", "--json-out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    tail = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, tail
    rows = LLM_ROW.findall(proc.stdout)
    assert sorted((int(w), m) for w, _, m, _ in rows) == sorted((w, m) for w in (2, 4) for m in LLM_MODES), tail
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["world"] for r in records] == [2, 4] and all(r["bench"] == "gpu_llm" for r in records)
    for r in records:
        assert r["env"]["device"] == "cpu" and r["attention"] == "loop"
        assert len(r["steps"]) == 2
        for s in r["steps"]:
            for m in LLM_MODES:
                assert len(s[m]["rank_s"]) == r["world"] and s[m]["step_s"] == max(s[m]["rank_s"]) > 0
                assert s[m]["predicted"] >= 1.0 and s[m]["micro_batches"] >= 1
            # verl's split and KK on the FLOPs cost are one algorithm: balancer's equal-count
            # plan never predicts a worse straggler under the cost it balances
            assert s["balancer"]["predicted"] <= s["kk:flops"]["predicted"] * (1 + 1e-9), s
        for m in LLM_MODES:
            assert r[m]["step_ms"] > 0 and r[m]["speedup"] > 0 and r[m]["vs_verl"] > 0
        assert r["off"]["speedup"] == 1.0 and r["verl"]["vs_verl"] == 1.0
