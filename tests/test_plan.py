"""Pure planning (balancer._plan), run for every rank in one process."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer._plan import (
    destinations,
    gather_segments,
    partition_task,
    plan_rank,
    sample_bytes,
    section_elements,
    simple_lower_bound,
    validate_partition,
    wire_layout,
)
from balancer._stats import (
    H_BATCH,
    H_DETAIL,
    H_FP,
    H_MAGIC,
    H_STATUS,
    HEADER_LEN,
    MAGIC,
    Agreement,
    Status,
    decide,
)
from balancer.batch import BaseBatch
from tests.reference import greedy


def _random_case(rng: np.random.Generator, w: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    dest = rng.permutation(np.repeat(np.arange(w), b))
    real = rng.integers(0, b + 1, size=w)
    real[rng.integers(0, w)] = rng.choice([0, b])
    return dest, real


def test_plans_are_globally_consistent() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        w, b = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        dest, real = _random_case(rng, w, b)
        plans = [plan_rank(dest, b, real, r) for r in range(w)]
        seen = []
        for r, p in enumerate(plans):
            assert p.send_counts.sum() == real[r] == p.send_order.size
            assert p.num_out <= b
            # the send order groups this rank's real samples by destination
            assert sorted(p.send_order.tolist()) == list(range(real[r]))
            assert (np.diff(dest[r * b + p.send_order]) >= 0).all()
            for d in range(w):
                assert p.send_counts[d] == plans[d].recv_counts[r], (r, d)
                group = p.send_order[p.send_counts[:d].sum() : p.send_counts[: d + 1].sum()]
                got = plans[d].sources[plans[d].recv_counts[:r].sum() : plans[d].recv_counts[: r + 1].sum()]
                assert (r * b + group).tolist() == got.tolist(), (r, d)
            assert (np.diff(p.sources) > 0).all()
            seen += p.sources.tolist()
        expected = [g for g in range(w * b) if g % b < real[g // b]]
        assert sorted(seen) == expected  # every real sample exactly once, padding never


def test_plan_docstring_example() -> None:
    dest, real = np.array([0, 1, 1, 0, 0, 1]), np.array([3, 2])
    p0, p1 = plan_rank(dest, 3, real, 0), plan_rank(dest, 3, real, 1)
    assert (p0.send_order.tolist(), p0.send_counts.tolist(), p0.recv_counts.tolist(),
            p0.sources.tolist()) == ([0, 1, 2], [1, 2], [1, 2], [0, 3, 4])
    assert (p1.send_order.tolist(), p1.send_counts.tolist(), p1.recv_counts.tolist(),
            p1.sources.tolist()) == ([0, 1], [2, 0], [2, 0], [1, 2])


def test_validate_partition() -> None:
    assert [p.tolist() for p in validate_partition([[1, 0], [3, 2]], 2, 2)] == [[1, 0], [3, 2]]
    with pytest.raises(ValueError, match="3 parts, expected num_parts=2"):
        validate_partition([[0], [1], [2, 3]], 2, 2)
    with pytest.raises(ValueError, match="part 0 has 1 indices, expected batch_size=2"):
        validate_partition([[0], [1, 2, 3]], 2, 2)
    with pytest.raises(ValueError, match="an index repeats"):
        validate_partition([[0, 1], [1, 3]], 2, 2)
    with pytest.raises(ValueError, match=r"expected \[0, 4\)"):
        validate_partition([[0, 1], [2, 4]], 2, 2)
    d = destinations(validate_partition([[3, 0], [1, 2]], 2, 2), 4)
    assert d.tolist() == [0, 1, 1, 0]


def _headers(*rows: tuple[int, int, int]) -> np.ndarray:
    h = np.zeros((len(rows), HEADER_LEN), np.int64)
    h[:, H_MAGIC] = MAGIC
    for r, (status, batch, fp) in enumerate(rows):
        h[r, H_STATUS], h[r, H_BATCH], h[r, H_FP] = status, batch, fp
    return h


def test_decide() -> None:
    a = Agreement(4, 7)
    assert decide(_headers((0, 4, 7), (0, 4, 7)), a).kind == "ok"
    v = decide(_headers((0, 4, 7), (0, 4, 7)), None)
    assert (v.kind, v.agreement) == ("retry", a)
    v = decide(_headers((0, 6, 7), (0, 6, 7)), a)
    assert (v.kind, v.agreement) == ("retry", Agreement(6, 7))
    v = decide(_headers((0, 4, 7), (0, 6, 7), (0, 4, 7)), a)
    assert v.kind == "error" and v.offenders == (1,)
    assert "rank 1: batch_size=6, expected 4" in v.message
    v = decide(_headers((0, 4, 7), (0, 4, 9)), None)
    assert v.offenders == (1,) and "fingerprint" in v.message
    h = _headers((0, 4, 7), (Status.NEGATIVE, 4, 7))
    h[1, H_DETAIL] = 2
    v = decide(h, a)
    assert v.offenders == (1,) and "workloads[2] < 0" in v.message
    v = decide(_headers((Status.BAD_INPUT, -1, 0), (Status.NONFINITE, 4, 7)), a)
    assert v.offenders == (0, 1) and "NaN" in v.message
    h = _headers((0, 4, 7), (0, 4, 7))
    h[0, H_MAGIC] = 3
    assert decide(h, a).offenders == (0,)


@dataclasses.dataclass(kw_only=True)
class _DenseBatch(BaseBatch):
    dense: torch.Tensor


def _batch(keys: list[str], vdtype: torch.dtype = torch.int64, dense_shape: tuple[int, ...] = (3,),
           weights: bool = True, b: int = 4) -> _DenseBatch:
    n = b * len(keys)
    f = KeyedJaggedTensor(keys=keys, values=torch.zeros(n, dtype=vdtype), lengths=torch.ones(n, dtype=torch.int64),
                          weights=torch.ones(n, dtype=torch.float16) if weights else None)
    return _DenseBatch(features=f, batch_size=b, feature_to_max_seqlen={},
                       dense=torch.zeros(b, *dense_shape, dtype=torch.float64), labels=torch.zeros(b))


def test_wire_layout_and_fingerprint() -> None:
    batch = _batch(["a", "b"])
    lay = wire_layout(batch)
    assert [(s.field, s.kind, s.itemsize, s.count, s.row, s.width) for s in lay.sections] == [
        ("features", "values", 8, 2, 0, 0), ("features", "weights", 2, 2, 0, 0),
        ("labels", "dense", 4, 1, -1, 1), ("dense", "dense", 8, 1, -1, 3)]
    assert lay.num_lengths == 2
    # per sample: 2 int64 lengths, 2 int64 values, 2 fp16 weights, a f32 label, 3 f64 dense
    assert sample_bytes(batch, lay).tolist() == [16 + 16 + 4 + 4 + 24] * 4
    assert section_elements(lay, np.array([[1, 2], [0, 3]])).tolist() == [[1, 5], [1, 5], [2, 0], [6, 0]]
    same = wire_layout(_batch(["a", "b"]))
    assert same.fingerprint == lay.fingerprint
    for other in (_batch(["b", "a"]), _batch(["a", "b"], torch.int32), _batch(["a", "b"], dense_shape=(4,)),
                  _batch(["a", "b"], weights=False), _batch(["a", "b"], b=5)):
        assert wire_layout(other).fingerprint != lay.fingerprint


def test_partition_task_never_worsens_the_max_load() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        w, b = 3, 4
        workloads = rng.integers(0, 20, size=w * b)
        real = np.full(w, b)
        out = partition_task(workloads, workloads * 8, real, 1, greedy, None, simple_lower_bound)
        loads = np.bincount(out.dest, weights=workloads, minlength=w)
        assert loads.max() <= workloads.reshape(w, b).sum(1).max()
        assert loads.max() >= out.lower_bound - 1e-9
        assert out.plan.rank == 1 and np.bincount(out.dest).tolist() == [b] * w
    # a partition worse than the current placement is not applied
    workloads = np.array([1, 9, 5, 5, 1, 9])
    out = partition_task(workloads, workloads, np.array([3, 3]), 0,
                         lambda wl, n: [[1, 3, 5], [0, 2, 4]], None, simple_lower_bound)
    assert out.dest.tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("unit", [torch.int64, torch.int32, torch.float16, torch.uint8])
def test_gather_segments_is_bit_exact(unit: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    raw[:64] = 0xFF  # NaN bit patterns for the floating unit
    buf = raw.view(unit)
    lengths = torch.randint(0, 9, (64,), generator=g)
    lengths[-1] = buf.numel() - int(lengths[:-1].sum())
    ids = torch.randperm(63, generator=g)[:40]
    total = int(lengths[ids].sum())
    got = gather_segments(buf, lengths, ids, total)
    offsets = [0, *torch.cumsum(lengths, 0).tolist()]
    want = torch.cat([buf[offsets[i] : offsets[i + 1]] for i in ids.tolist()])
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
