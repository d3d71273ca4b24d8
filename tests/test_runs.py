"""Run gathers planned on the host, against slicing; every element size, both kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from balancer import _gather
from balancer._gather import host_tensors, take_runs, upload
from balancer._runs import IndexBlob, merge_runs, plan_runs


def test_merge_runs() -> None:
    s, n = merge_runs(np.array([0, 2, 5, 7, 7, 20]), np.array([2, 3, 2, 0, 1, 4]))
    assert s.tolist() == [0, 20] and n.tolist() == [8, 4]
    s, n = merge_runs(np.array([4, 0]), np.array([2, 4]))
    assert s.tolist() == [4, 0] and n.tolist() == [2, 4]  # adjacent in the source but out of order


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float16, torch.uint8])
@pytest.mark.parametrize("use_fbgemm", [True, False])
def test_take_runs_is_bit_exact(dtype: torch.dtype, use_fbgemm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gather, "_PERMUTE", use_fbgemm and _gather._PERMUTE)
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(rng.integers(0, 256, 4096).astype(np.uint8))
    raw[:64] = 0xFF  # NaN bit patterns for the floating unit
    buf = raw.view(dtype)
    for _ in range(20):
        cuts = np.sort(rng.choice(buf.numel(), size=2 * int(rng.integers(0, 30)), replace=False))
        starts, ends = cuts[0::2], cuts[1::2]
        order = rng.permutation(starts.size)
        blob = IndexBlob()
        g = plan_runs(blob, buf.numel(), starts[order], (ends - starts)[order])
        got = take_runs(buf, g, upload(host_tensors(blob.freeze(), pin=False), torch.device("cpu")))
        want = torch.cat([buf[a:b] for a, b in zip(starts[order], ends[order], strict=True)] + [buf[:0]])
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_overlapping_runs_are_rejected() -> None:
    with pytest.raises(AssertionError, match="overlap"):
        plan_runs(IndexBlob(), 10, np.array([0, 3]), np.array([5, 2]))
