"""Smoke tests of examples/train_hstu.py on 2 CPU ranks: both ways of balancing
lower the imbalance and end with the speedup line; the README command runs
under torchrun without the known library warnings.

The example's default embedding kernel is FBGEMM's fused TBE; a CUDA host whose
FBGEMM lacks those kernels (e.g. a trimmed offline bundle) skips those tests
with the reason instead of failing. ``--embedding-kernel torch`` needs no FBGEMM
kernel and always runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from balancer.testing import free_port, run_workers
from tests.tbe import skip_without_tbe

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "4", "--batch-size", "8", "--max-seqlen", "64", "--dim", "16"]
SUMMARY = re.compile(r"^summary: mode=(\w+) .*?steps=(\d+) .*imbalance_before=([\d.]+) "
                     r"imbalance_after=([\d.]+) final_loss=([\d.]+)$", re.M)
SPEEDUP = re.compile(r"^speedup: [\d.]+x step time, [\d.]+x slowest-rank compute \((\w+) / (\w+)\); "
                     r"imbalance ([\d.]+) -> ([\d.]+)$", re.M)


def _example() -> Any:
    sys.path.insert(0, str(ROOT / "examples"))  # hstu_model, synthetic_data
    spec = importlib.util.spec_from_file_location("train_hstu", ROOT / "examples" / "train_hstu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _worker(rank: int, world_size: int, argv: list[str]) -> tuple[str, dict[str, Any]]:
    ex = _example()
    ex.quiet_known_warnings()
    args = ex.parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        logs = ex.train(args, ex.modes_from_args(args), torch.device("cpu"))
    return out.getvalue(), logs


@pytest.mark.parametrize("argv", [["--enable-balanced-shuffler"], ["--balanced-loader"],
                                  ["--balanced-loader", "--embedding-kernel", "torch", "--ahead", "0"]],
                         ids=["shuffler", "loader", "loader-torch-kernel"])
def test_both_modes_lower_the_imbalance_and_report_the_speedup(argv: list[str]) -> None:
    if "torch" not in argv:
        skip_without_tbe("the example's default --embedding-kernel fused")
    (text, logs), (text1, _) = run_workers(_worker, 2, argv + SMALL, timeout=180)
    assert text1 == "", "only rank 0 prints"
    base, balanced = ("loop", "loader") if "--balanced-loader" in argv else ("pipeline", "shuffler")
    summaries = {m[1]: m for m in SUMMARY.finditer(text)}
    assert set(summaries) == {base, balanced}, text
    for m in summaries.values():
        assert int(m[2]) == 4, text
    b, a = float(summaries[balanced][3]), float(summaries[balanced][4])
    assert a < b, text  # balancing lowered the imbalance
    assert summaries[base][3] == summaries[base][4] == summaries[balanced][3], text  # same batches
    speed = SPEEDUP.search(text)
    assert speed is not None and (speed[1], speed[2]) == (base, balanced), text
    assert text.rstrip().splitlines()[-1] == speed[0], "the speedup line comes last"
    # Same batches, same initial weights, global mean loss: the same curve.
    assert max(abs(x - y) for x, y in zip(logs[base]["loss"], logs[balanced]["loss"], strict=True)) < 1e-5
    assert all(x <= y + 1e-12 for x, y in zip(logs[balanced]["after"], logs[balanced]["before"], strict=True))


def test_group_size_on_four_ranks_balances_within_groups() -> None:
    skip_without_tbe("the example's default --embedding-kernel fused")
    outs = run_workers(_worker, 4, ["--enable-balanced-shuffler", "--group-size", "2"] + SMALL, timeout=180)
    text, logs = outs[0]
    summaries = {m[1]: m for m in SUMMARY.finditer(text)}
    assert set(summaries) == {"pipeline", "shuffler"}, text
    # The example gathers every rank's load itself (the stats cover a group): the
    # same batches as the baseline, balanced within groups of two.
    assert summaries["pipeline"][3] == summaries["shuffler"][3], text
    assert float(summaries["shuffler"][4]) < float(summaries["shuffler"][3]), text
    assert max(abs(x - y) for x, y in zip(logs["pipeline"]["loss"], logs["shuffler"]["loss"], strict=True)) < 1e-5


@pytest.mark.parametrize("mode", ["--enable-balanced-shuffler", "--balanced-loader"])
def test_uneven_loaders_run_every_rank_for_the_longest_one(mode: str) -> None:
    # Rank 1 draws one batch fewer (3 of 4): both ranks train 4 steps, balanced.
    skip_without_tbe("the example's default --embedding-kernel fused")
    argv = [mode, "--no-baseline", "--uneven-batches", "1"] + SMALL
    (text, logs), (_, logs1) = run_workers(_worker, 2, argv, timeout=180)
    (m,) = SUMMARY.finditer(text)
    assert int(m[2]) == 4 and float(m[4]) < float(m[3]), text
    assert len(logs[m[1]]["loss"]) == len(logs1[m[1]]["loss"]) == 4


def test_readme_command_under_torchrun_prints_no_known_library_warnings() -> None:
    skip_without_tbe("the example's default --embedding-kernel fused")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(ROOT / "examples" / "train_hstu.py"),
           "--enable-balanced-shuffler", "--cpu", *SMALL]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    tail = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, tail
    assert SPEEDUP.search(proc.stdout) is not None, tail
    for text in ("broadcast_buffers", "is_fx_tracing", "TopologyFactory", "HeuristicalStorageReservation",
                 "dense tensor size", "_get_pg_default_device", "Multiple backends are registered"):
        assert text not in proc.stdout + proc.stderr, (text, tail)


def test_cli_rejects_combinations_that_cannot_run() -> None:
    ex = _example()
    with pytest.raises(SystemExit):
        ex.parse_args(["--enable-balanced-shuffler", "--balanced-loader"])
    with pytest.raises(SystemExit):
        ex.parse_args(["--embedding-kernel", "torch"])  # TorchRec's pipeline needs a sharded module
    with pytest.raises(SystemExit):
        ex.parse_args(["--embedding-kernel", "dense", "--cpu"])  # FBGEMM's CPU dense lookup pools
    with pytest.raises(SystemExit):
        ex.parse_args(["--log-every", "0"])  # once a ZeroDivisionError on rank 0 after the first step
    with pytest.raises(SystemExit):
        ex.parse_args(["--enable-balanced-shuffler", "--uneven-batches", "1"])  # the baseline would hang
    with pytest.raises(SystemExit):
        ex.parse_args(["--balanced-loader", "--no-baseline", "--uneven-batches", "-1"])
    assert ex.modes_from_args(ex.parse_args([])) == ["pipeline"]
    assert ex.modes_from_args(ex.parse_args(["--balanced-loader", "--no-baseline"])) == ["loader"]
