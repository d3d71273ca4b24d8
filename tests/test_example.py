"""Smoke test: the HSTU example runs under torchrun on 2 CPU ranks, flag on and off."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from balancer.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(
    r"summary: steps=(\d+) balanced=(True|False) mean_step_ms=[\d.]+ "
    r"imbalance_before=([\d.]+) imbalance_after=([\d.]+) final_loss=([\d.]+)"
)


@pytest.mark.parametrize("balanced", [False, True], ids=["off", "on"])
def test_train_hstu_two_cpu_ranks(balanced: bool) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(ROOT / "examples" / "train_hstu.py"), "--cpu",
        "--steps", "4", "--batch-size", "8", "--max-seqlen", "64", "--dim", "16",
    ]
    if balanced:
        cmd.append("--enable-balanced-shuffler")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    tail = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, tail
    m = SUMMARY.search(proc.stdout)
    assert m is not None, tail
    steps, flag, before, after = int(m[1]), m[2] == "True", float(m[3]), float(m[4])
    assert (steps, flag) == (4, balanced)
    assert before >= 1.0 and 1.0 <= after <= before
    if not balanced:
        assert after == before
    assert len(re.findall(r"^step +\d+/4 loss", proc.stdout, flags=re.M)) == 4
