"""Tests for balancer.partition.free_partition (balancer/partition/_free.py)."""

from __future__ import annotations

import itertools
import statistics

import numpy as np
import pytest
import torch

from balancer.partition import free_partition, lower_bound
from balancer.partition._free import free_assign


def _heavy(dist: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dist == "zipf":
        lens = np.minimum(rng.zipf(1.2, n), 4096)
    else:
        lens = np.clip(np.rint(rng.lognormal(6.0, 1.0, n)), 1, 8192).astype(np.int64)
    return lens * lens + 1024 * lens


def _check(parts: list[list[int]], n: int, w: int, lo: int = 0, hi: int | None = None) -> None:
    assert len(parts) == w
    assert sorted(i for p in parts for i in p) == list(range(n)), "every index exactly once"
    assert all(p == sorted(p) for p in parts)
    assert all(lo <= len(p) <= (n if hi is None else hi) for p in parts)


def _max_load(x: np.ndarray, parts: list[list[int]]) -> float:
    return max(x[np.asarray(p, dtype=np.int64)].sum().item() for p in parts)


def _brute(x: np.ndarray, w: int, lo: int, hi: int | None) -> int:
    best = None
    for labels in itertools.product(range(w), repeat=x.size):
        lab = np.array(labels)
        counts = np.bincount(lab, minlength=w)
        if counts.min() < lo or (hi is not None and counts.max() > hi):
            continue
        top = int(np.bincount(lab, weights=x, minlength=w).max())
        best = top if best is None else min(best, top)
    assert best is not None
    return best


def test_small_cases_against_brute_force() -> None:
    rng = np.random.default_rng(1)
    optimal = total = 0
    for _ in range(150):
        n, w = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        x = rng.integers(0, 50, n) ** 2
        lo = int(rng.integers(0, n // w + 1))
        hi = None if rng.random() < 0.5 else int(rng.integers(max(lo, 1, -(-n // w)), n + 1))
        parts = free_partition(x, w, min_size=lo, max_size=hi)
        _check(parts, n, w, lo, hi)
        best = _brute(x, w, lo, hi)
        got = _max_load(x, parts)
        assert lower_bound(x, w, equal_size=False, min_size=lo, max_size=hi) <= best, "the bound is a bound"
        assert got <= 1.05 * best
        optimal += got == best
        total += 1
    assert optimal >= 0.95 * total


@pytest.mark.parametrize("dist", ["zipf", "lognormal"])
def test_heavy_tails_within_1e4_of_the_bound(dist: str) -> None:
    gaps = []
    for seed, (n, w) in enumerate([(8192, 8), (8192, 64), (4096, 128), (1024, 16), (512, 8),
                                   (256, 32), (100, 7)]):
        x = _heavy(dist, n, seed)
        parts = free_partition(x, w)
        _check(parts, n, w)
        simple = max(int(x.max()), -(-int(x.sum()) // w))  # max(largest item, mean)
        gaps.append(_max_load(x, parts) / simple - 1)
        # Never worse than equal-count contiguous chunks (what a loader deals).
        if n % w == 0:
            assert _max_load(x, parts) <= x.reshape(w, -1).sum(axis=1).max()
    assert statistics.median(gaps) <= 1e-4, gaps


def test_one_huge_sample_gets_a_rank_of_its_own() -> None:
    x = np.array([1000] + [10] * 99)
    parts = free_partition(x, 4, min_size=1)
    _check(parts, 100, 4, lo=1)
    assert [0] in parts, "the huge item alone; the others share the rest"
    assert _max_load(x, parts) == 1000


def test_max_size_binding_tightens_the_bound_and_is_met() -> None:
    x = np.array([10, 9, 5, 1, 1, 1])
    assert lower_bound(x, 2, equal_size=False) == 14  # two of 10, 9, 5 share a part
    assert _max_load(x, free_partition(x, 2)) == 14  # {10, 1, 1, 1}, {9, 5}
    # Three items each: two of the top three and one more item, >= 5 + 9 + 1.
    assert lower_bound(x, 2, equal_size=False, max_size=3) == 15
    parts = free_partition(x, 2, max_size=3)
    _check(parts, 6, 2, hi=3)
    assert _max_load(x, parts) == 15
    rng = np.random.default_rng(0)
    for _ in range(20):
        w, b = int(rng.integers(2, 9)), int(rng.integers(1, 20))
        y = _heavy("lognormal", w * b, int(rng.integers(1 << 30)))
        parts = free_partition(y, w, max_size=b)  # max_size binds: exactly b each
        _check(parts, w * b, w, b, b)
        assert _max_load(y, parts) >= lower_bound(y, w, equal_size=False, max_size=b)


def test_min_size_fills_every_part_even_with_zeros() -> None:
    assert free_partition([0, 0, 0], 3, min_size=1) == [[2], [1], [0]]
    parts = free_partition([5, 0, 0, 0, 0, 0, 0], 3, min_size=2)
    _check(parts, 7, 3, lo=2)
    parts = free_partition(np.arange(20), 6, min_size=3)
    _check(parts, 20, 6, lo=3)


def test_inputs_floats_tensors_and_determinism() -> None:
    x = _heavy("zipf", 500, 3)
    a = free_partition(x, 7)
    assert free_partition(x.tolist(), 7) == a
    assert free_partition(torch.from_numpy(x), 7) == a
    f = x.astype(np.float64) / 3.0
    pf = free_partition(f, 7)
    _check(pf, 500, 7)
    assert _max_load(f, pf) <= lower_bound(f, 7, equal_size=False) * (1 + 1e-4)
    assert free_partition([], 3) == [[], [], []]
    assert free_partition([4, 1], 5) == [[0], [1], [], [], []]


def test_capacity_on_a_second_quantity() -> None:
    # Balance x while no part may hold more than 10 tokens.
    x = np.array([50, 40, 30, 20, 10, 5], dtype=np.int64)
    tok = np.array([9, 2, 2, 5, 5, 1], dtype=np.int64)
    labels = free_assign(x, 3, sizes=tok, cap=10)
    assert labels is not None
    assert np.bincount(labels, weights=tok, minlength=3).max() <= 10
    assert free_assign(x, 2, sizes=tok, cap=10) is None  # 24 tokens do not fit in 2 x 10


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"min_size": 2}, r"5 items cannot give 3 parts min_size=2 each \(needs 6\)"),
    ({"max_size": 1}, r"5 items do not fit in 3 parts of max_size=1 \(holds 3\)"),
    ({"min_size": 2, "max_size": 1}, "min_size=2 > max_size=1"),
    ({"min_size": -1}, "min_size=-1, expected >= 0"),
    ({"max_size": 0}, "max_size=0, expected >= 1"),
    ({"min_size": 1.5}, "min_size=1.5, expected an int"),
])
def test_size_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        free_partition([1, 2, 3, 4, 5], 3, **kwargs)


def test_workload_errors() -> None:
    with pytest.raises(ValueError, match=r"workloads\[1\] = nan, expected a finite value"):
        free_partition([1.0, float("nan")], 2)
    with pytest.raises(ValueError, match=r"workloads\[0\] = -1, expected >= 0"):
        free_partition([-1, 2], 2)
    with pytest.raises(ValueError, match="num_parts=0, expected >= 1"):
        free_partition([1, 2], 0)
    with pytest.raises(TypeError, match="num_parts=2.0, expected an int"):
        free_partition([1, 2], 2.0)  # type: ignore[arg-type]


def test_min_size_none_is_named() -> None:
    # int(None) once raised a bare TypeError
    with pytest.raises(ValueError, match="min_size=None, expected an int"):
        free_partition([1, 2, 3, 4], 2, min_size=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_size=None, expected an int"):
        lower_bound([1, 2, 3, 4], 2, equal_size=False, min_size=None)  # type: ignore[arg-type]
