"""Smoke test: ``benchmarks/bench_loader.py --quick`` on 2 gloo ranks. Checks the
invariants the report rests on (every loader mode reaches the in-pipeline
shuffler's balance in every step, the same loss curve), never timings."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

from balancer.testing import run_workers
from tests.tbe import skip_without_tbe

ROOT = Path(__file__).resolve().parents[1]


def _worker(rank: int, world_size: int) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("bench_loader", ROOT / "benchmarks" / "bench_loader.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bench, args = mod.parse_args(["--quick"])
    return mod.run(bench, args)  # type: ignore[no-any-return]


def test_bench_loader_quick() -> None:
    skip_without_tbe("bench_loader's sharded model")
    rows, _ = run_workers(_worker, 2, timeout=180)
    assert [r["mode"] for r in rows] == ["loop", "loader/a0", "loader/a1", "loader/a2", "shuffler"]
    for r in rows:
        assert r["steps"] == 4 and math.isfinite(r["step_ms"]) and r["step_ms"] > 0
        assert max(abs(a - b) for a, b in zip(r["loss"], rows[0]["loss"], strict=True)) < 1e-5
        if r["mode"].startswith("loader"):
            assert r["same_balance_steps"] == 4 and 0 <= r["wait_pct"] < 100
            assert r["imbalance_after"] < r["imbalance_before"]
