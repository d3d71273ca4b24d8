"""Tests for balancer.partition: invariants over random instances, bounds, errors."""

from __future__ import annotations

import ast
import functools
import itertools
import math
import pathlib
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import balancer.partition
from balancer.partition import (
    PartitionStats,
    PartitionWorker,
    balanced_partition,
    imbalance,
    karmarkar_karp,
    localize,
    lower_bound,
    partition_stats,
)
from balancer.partition._balanced import _ascending_rows
from balancer.partition._tokens import _best_move, _range_min, _wide_single, deal_by_room
from tests.reference import greedy

# numpy 2.1 changed Generator.zipf's draws (the same seed gives other values; 1.x and
# 2.0 agree with each other). The limits of the tests marked with this were measured on
# the newer draws; older numpy builds other instances, some of which land above them.
# The partition itself is the same under every numpy (the instances differ, not it).
measured_on_numpy_2_1_zipf = pytest.mark.skipif(
    np.lib.NumpyVersion(np.__version__) < "2.1.0",
    reason="quality limits measured on numpy >= 2.1's Generator.zipf draws (older numpy draws other instances)")


def _lengths(dist: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if dist == "uniform":
        return rng.integers(1, 4097, n)
    if dist == "zipf":
        return np.minimum(rng.zipf(1.2, n), 4096)
    if dist == "ties":
        return rng.integers(0, 4, n)
    out = np.clip(np.rint(rng.lognormal(6.0, 1.0, n)), 1, 8192).astype(np.int64)
    if dist == "padded":
        out[rng.random(n) < 0.1] = 0
    return out


def _instances(count: int, seed: int = 0) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        w = int(rng.integers(1, 65))
        b = int(rng.integers(1, 65))
        dist = ("uniform", "lognormal", "zipf", "padded", "ties")[i % 5]
        lens = _lengths(dist, w * b, rng).astype(np.int64)
        out.append((lens * lens + 1024 * lens, w))
    return out


INSTANCES = _instances(60)


def _check_parts(parts: list[list[int]], n: int, w: int, equal: bool = True) -> None:
    assert len(parts) == w
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n)), "every index exactly once"
    if equal:
        assert all(len(p) == n // w for p in parts), "every part exactly B items"


def _max_load(x: np.ndarray, parts: list[list[int]]) -> int | float:
    """Exact for ints (Python ints), plain float sums for floats."""
    return max((x[np.asarray(p, dtype=np.int64)].sum().item() for p in parts), default=0)


@pytest.mark.parametrize("case", range(len(INSTANCES)))
def test_balanced_partition_invariants(case: int) -> None:
    x, w = INSTANCES[case]
    parts = balanced_partition(x, w)
    _check_parts(parts, x.size, w)
    top = _max_load(x, parts)
    contiguous = int(x.reshape(w, -1).sum(axis=1).max())
    assert top <= contiguous, "never worse than no balancing"
    assert top >= lower_bound(x, w), "never below the lower bound"
    assert all(p == sorted(p) for p in parts)


@pytest.mark.parametrize("case", range(0, len(INSTANCES), 3))
def test_karmarkar_karp_invariants(case: int) -> None:
    x, w = INSTANCES[case]
    parts = karmarkar_karp(x, w)
    _check_parts(parts, x.size, w)
    assert _max_load(x, parts) >= lower_bound(x, w)
    free = karmarkar_karp(x, w, equal_size=False)
    _check_parts(free, x.size, w, equal=False)
    assert _max_load(x, free) >= x.sum() / w


@pytest.mark.parametrize("w,b", [(2, 3), (7, 5), (64, 8), (1000, 4)])
def test_kk_rows_equals_grouping_the_labels_by_sort(w: int, b: int) -> None:
    from balancer.partition._kk import kk_equal, kk_rows

    v = np.sort(np.random.default_rng(w + b).integers(0, 10_000, w * b))
    part = kk_equal(v, w)
    assert part is not None
    np.testing.assert_array_equal(kk_rows(part, w), np.argsort(part, kind="stable").reshape(w, b))


def _capped_lpt(v: list[Any], loads: list[Any], room: list[int]) -> list[list[int]]:
    """Capped LPT by a linear scan: ``v`` ascending, served largest first, each to the
    open part with the least load (then the lowest index); positions per part."""
    loads, room = list(loads), list(room)
    got: list[list[int]] = [[] for _ in loads]
    for pos in range(len(v) - 1, -1, -1):
        j = min((j for j in range(len(loads)) if room[j] > 0), key=lambda j: (loads[j], j))
        got[j].append(pos)
        loads[j] += v[pos]
        room[j] -= 1
    return got


@pytest.mark.parametrize("kind", ["int", "ties", "float", "huge"])
def test_lpt_heap_is_capped_lpt(kind: str) -> None:
    from balancer.partition._lpt import _serve, lpt_heap

    rng = np.random.default_rng(len(kind))
    for _ in range(40):
        w, b = int(rng.integers(2, 12)), int(rng.integers(1, 9))
        v = np.sort({"int": lambda n: rng.integers(0, 1000, n), "ties": lambda n: rng.integers(0, 3, n),
                     "float": lambda n: rng.random(n),
                     # beyond int64 once multiplied by W: the heap keeps (load, part) pairs
                     "huge": lambda n: rng.integers(1 << 60, 1 << 62, n)}[kind](w * b))
        got = _capped_lpt(v.tolist(), [0] * w, [b] * w)
        np.testing.assert_array_equal(lpt_heap(v, w), np.array([g[::-1] for g in got]).reshape(w, b))
        # From loads and rooms of their own (lpt_rows' tail).
        loads = rng.integers(0, 3000, w).tolist() if kind != "float" else rng.random(w).tolist()
        room = rng.integers(0, b + 1, w).tolist()
        items = v[: sum(room)]
        assert _serve(items, loads, room) == _capped_lpt(items.tolist(), loads, room)


def test_karmarkar_karp_matches_textbook_on_small_example() -> None:
    # Rows (1,2) (3,4) (5,6) merged largest-spread first: loads 10 and 11.
    parts = karmarkar_karp([1, 2, 3, 4, 5, 6], 2)
    loads = sorted(sum([1, 2, 3, 4, 5, 6][i] for i in p) for p in parts)
    assert loads == [10, 11]
    free = karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in free) == [14, 16]


def test_karmarkar_karp_equal_size_false_allows_any_length() -> None:
    parts = karmarkar_karp([10, 1, 1, 1, 1, 1, 1], 2, equal_size=False)
    _check_parts(parts, 7, 2, equal=False)
    assert sorted(len(p) for p in parts) == [1, 6]


def test_determinism_and_input_types() -> None:
    x, w = INSTANCES[7]
    first = balanced_partition(x, w)
    assert balanced_partition(x, w) == first
    assert balanced_partition(x.tolist(), w) == first
    assert balanced_partition(torch.from_numpy(x), w) == first
    assert balanced_partition(x.astype(np.int32), w) == first
    assert karmarkar_karp(torch.from_numpy(x), w) == karmarkar_karp(x.tolist(), w)
    assert lower_bound(torch.from_numpy(x), w) == lower_bound(x, w)
    # CPU tensors numpy cannot take as they are: bfloat16 (TypeError) and ones that require grad
    y = x.astype(np.float64)
    for t in (torch.from_numpy(y).to(torch.bfloat16), torch.from_numpy(y).float().requires_grad_()):
        assert balanced_partition(t, w) == balanced_partition(t.detach().double().numpy(), w)


@pytest.mark.parametrize("w,b", [(1, 5), (5, 1), (4, 4), (3, 7)])
def test_edge_shapes(w: int, b: int) -> None:
    n = w * b
    for x in (np.full(n, 7), np.zeros(n, np.int64), np.arange(n)):
        parts = balanced_partition(x, w)
        _check_parts(parts, n, w)
        if x.max() == x.min():
            assert _max_load(x, parts) == int(x[:b].sum()), "equal workloads: perfect balance"
        _check_parts(karmarkar_karp(x, w), n, w)


def test_empty_input() -> None:
    assert balanced_partition([], 3) == [[], [], []]
    assert karmarkar_karp(np.zeros(0), 2) == [[], []]
    assert lower_bound([], 2) == 0.0


def test_float_inputs() -> None:
    rng = np.random.default_rng(3)
    x = rng.random(96) * 10
    parts = balanced_partition(x, 8)
    _check_parts(parts, 96, 8)
    top = _max_load(x, parts)
    assert lower_bound(x, 8) <= top <= x.reshape(8, -1).sum(axis=1).max()
    assert top <= lower_bound(x, 8) * (1 + 1e-3)
    _check_parts(karmarkar_karp(x.tolist(), 8), 96, 8)


@pytest.mark.parametrize(("w", "b", "seed", "kind"), [(128, 32, 0, "div7"), (512, 64, 0, "div10"),
                                                   (1024, 16, 1, "div7"), (4096, 32, 1, "ulp"),
                                                   (16384, 16, 0, "ulp")])
def test_float_ties_are_partitioned(w: int, b: int, seed: int, kind: str) -> None:
    # Float costs where many samples share the smallest value (length 1):
    # the prefix sums' rounding once left fill's step a few ulps from 0 and
    # it divided by that, which crashed (IndexError), warned, or lost and
    # duplicated samples (5 of 108 such inputs; 14 of 132 with ulp noise).
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.zipf(1.2, w * b), 4096)
    x = lens * lens + 256.0 * lens
    x = x * (1 + 2.2e-16 * rng.integers(0, 3, x.size)) / 7.0 if kind == "ulp" else x / float(kind[3:])
    with np.errstate(all="raise"):
        parts = balanced_partition(x, w)
    _check_parts(parts, x.size, w)
    assert _max_load(x, parts) <= lower_bound(x, w) * (1 + 1e-2)


def test_a_partition_that_loses_a_sample_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    # The last check before any result leaves: a search fault (here a solve
    # that hands one sample to two parts) raises instead of losing a sample.
    import balancer.partition._balanced as balanced_mod

    real = balanced_mod.solve

    def faulty(*args: Any, **kwargs: Any) -> Any:
        sol = real(*args, **kwargs)
        sol.rows[1, 0] = sol.rows[0, 0]
        return sol

    monkeypatch.setattr(balanced_mod, "solve", faulty)
    x = np.arange(64)
    with pytest.raises(RuntimeError, match=r"holds 64 items for 64 positions, 2 of them not exactly once"):
        balanced_partition(x, 4)


def test_large_integers_are_exact() -> None:
    rng = np.random.default_rng(4)
    x = (1 << 40) + rng.integers(0, 1 << 20, 64)
    parts = balanced_partition(x, 4)
    loads = [sum(int(x[i]) for i in p) for p in parts]  # Python ints: exact
    stats = partition_stats(x, parts)
    assert [int(v) for v in stats.loads] == loads
    assert stats.max_load == max(loads)
    assert lower_bound(x, 4) <= max(loads)
    # Two parts of one item each: the bound is the exact max item.
    assert lower_bound([(1 << 40) + 1, 1 << 40], 2) == float((1 << 40) + 1)


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"workloads has 10 entries, not divisible by num_parts=4"):
        balanced_partition(np.ones(10), 4)
    with pytest.raises(ValueError, match=r"workloads has 10 entries, not divisible by num_parts=4"):
        karmarkar_karp(list(range(10)), 4)
    with pytest.raises(ValueError, match=r"num_parts=0, expected >= 1"):
        balanced_partition([1, 2], 0)
    with pytest.raises(ValueError, match=r"workloads\[1\] = -3, expected >= 0"):
        balanced_partition([1, -3], 2)
    with pytest.raises(ValueError, match=r"workloads\[0\] = nan, expected a finite value"):
        lower_bound([float("nan"), 1.0], 2)
    with pytest.raises(ValueError, match=r"workloads\[1\] = inf"):
        balanced_partition([1.0, float("inf")], 1)
    with pytest.raises(ValueError, match=r"shape \(2, 2\), expected 1-D"):
        balanced_partition(np.ones((2, 2)), 2)
    with pytest.raises(ValueError, match=r"dtype <U1"):
        balanced_partition(["a", "b"], 2)
    with pytest.raises(ValueError, match=r"expected < 2\*\*61"):
        balanced_partition([1 << 62, 1 << 62], 2)
    with pytest.raises(ValueError, match=r"workloads sum to 2.30584e\+18, expected < 2\*\*61"):
        balanced_partition([1 << 60, 1 << 60], 1)
    # floats whose sum overflows float64: the same error, and no overflow warning on the way
    for fn in (balanced_partition, karmarkar_karp, lower_bound):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match=r"workloads sum to inf, expected < 2\*\*61"):
                fn([1e308, 1e308, 1.0, 1.0], 2)
    # below the limit by 1: accepted (float64 sums rounded these totals up to 2**61)
    assert balanced_partition([(1 << 61) - 1], 1) == [[0]]
    assert balanced_partition([1 << 60, (1 << 60) - 1], 2) == [[0], [1]]
    with pytest.raises(TypeError, match=r"num_parts=2.0, expected an int"):
        balanced_partition([1, 2], 2.0)  # type: ignore[arg-type]


# ------------------------------------------------------------ tiny instances, brute force
def _equal_partitions(n: int, w: int):  # type: ignore[no-untyped-def]
    """All partitions of range(n) into w unordered groups of n // w."""
    b = n // w

    def rec(items: tuple[int, ...]):  # type: ignore[no-untyped-def]
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for others in itertools.combinations(rest, b - 1):
            left = tuple(i for i in rest if i not in others)
            for tail in rec(left):
                yield [(first, *others), *tail]

    yield from rec(tuple(range(n)))


@functools.cache
def _partition_table(n: int, w: int) -> np.ndarray:
    """Every partition of :func:`_equal_partitions` as one int64 array ``[P, w, n // w]``."""
    return np.array(list(_equal_partitions(n, w)), dtype=np.int64)


def _brute_optimum(x: np.ndarray, w: int) -> Any:
    """The smallest max part load over every equal-count partition of ``x`` (a Python int or
    float, exact): each part's items summed in index order, as ``x[list(g)].sum()`` sums them."""
    return x[_partition_table(x.size, w)].sum(axis=-1).max(axis=-1).min().item()


def _optimum(x: np.ndarray, w: int) -> int:
    return int(_brute_optimum(x, w)) if x.dtype.kind in "iu" else min(
        max(int(x[list(g)].sum()) for g in part) for part in _equal_partitions(x.size, w))


def test_bound_and_partition_against_brute_force() -> None:
    rng = np.random.default_rng(5)
    shapes = [(2, 2), (2, 3), (2, 4), (3, 2), (4, 2)]
    hits = total = 0
    for trial in range(150):
        w, b = shapes[trial % len(shapes)]
        kind = trial % 3
        if kind == 0:
            x = rng.integers(0, 20, w * b)
        elif kind == 1:
            x = rng.integers(1, 1000, w * b) ** 2
        else:
            x = np.where(rng.random(w * b) < 0.3, rng.integers(500, 1000, w * b), rng.integers(0, 5, w * b))
        opt = _optimum(x, w)
        assert lower_bound(x, w) <= opt
        got = _max_load(x, balanced_partition(x, w, rtol=0.0))
        assert got >= opt
        hits += got == opt
        total += 1
        if w == 2 and b == 2:
            assert got == opt, "two parts of two: one swap reaches the optimum"
    assert hits / total >= 0.95, f"optimal on {hits}/{total} tiny instances"


@pytest.mark.parametrize("w", [2, 7, 256, 257, 1000])
def test_ascending_rows_sorts_each_part(w: int) -> None:
    rng = np.random.default_rng(w)
    b = 3 * (1 + 300 // w)
    order, rows = rng.permutation(w * b), rng.permutation(w * b).reshape(w, b)
    np.testing.assert_array_equal(_ascending_rows(order, rows), np.sort(order[rows], axis=1))


def test_two_items_a_part_are_partitioned_optimally() -> None:
    # B = 2: every tiny instance at the brute-force optimum, and at scale the
    # max of the largest-with-smallest pairing (optimal, see the brute force).
    rng = np.random.default_rng(11)
    for trial in range(60):
        w = 2 + trial % 4
        x = rng.integers(0, 50, 2 * w) ** (1 + trial % 3)
        assert _max_load(x, balanced_partition(x, w, rtol=0.0)) == _optimum(x, w), x
    for x in (np.minimum(rng.zipf(1.2, 8192), 4096) ** 2, rng.integers(0, 3, 8192),
              rng.lognormal(6.0, 1.0, 8192), np.full(8192, 0.1)):
        parts = balanced_partition(x, 4096)
        _check_parts(parts, x.size, 4096)
        v = np.sort(x)
        assert _max_load(x, parts) == (v[:4096] + v[:4095:-1]).max()


@pytest.mark.parametrize("top", [3, 1 << 16, 1 << 31, (1 << 47) + 5, 1 << 50, 1 << 62])
@pytest.mark.parametrize("n", [100, 5000])
def test_sort_values_is_the_stable_order(top: int, n: int) -> None:
    """Every path of sort_values (radix of 1-3 digits, packed keys, argsort) gives the stable
    ascending order: ties by index."""
    from balancer.partition._refine import sort_values

    rng = np.random.default_rng(top % 1000 + n)
    x = rng.integers(0, top, n, dtype=np.int64)
    x[rng.random(n) < 0.2] = top - 1  # ties at the top digit
    order, vals = sort_values(x)
    np.testing.assert_array_equal(order, np.argsort(x, kind="stable"))
    np.testing.assert_array_equal(vals, np.sort(x))


@pytest.mark.parametrize("quantized", [False, True])
def test_solve_rows_bound_equals_lower_bound(quantized: bool) -> None:
    """The shuffler's call sorts the workloads in the partition's order before its bound;
    it must equal lower_bound's exactly, whatever that order (ties, floats, B = 1)."""
    from balancer.partition._balanced import solve_rows

    rng = np.random.default_rng(5)
    for w, b in [(4, 1), (8, 16), (64, 64), (16, 2048)]:
        x = rng.lognormal(0.0, 1.5, w * b)
        x[rng.random(x.size) < 0.3] = 1.25  # ties
        # distinct values that quantize alike, descending by index: the quantized order has them reversed
        x[: x.size // 7] = 2.0 * (1 - 1e-12 * np.arange(x.size // 7))
        home = np.repeat(np.arange(w), b)
        for workloads in ([x, np.rint(x * 1000).astype(np.int64)] if not quantized else [x * 1e9]):
            for kw in ({}, {"home": home}, {"tokens": np.ones(x.size, np.int64), "max_tokens": float(b)}):
                rows, _, bound = solve_rows(workloads, w, quantized=quantized, **kw)
                assert sorted(rows.ravel().tolist()) == list(range(x.size))
                if quantized:
                    top = float(workloads.max())
                    assert bound == float(lower_bound(workloads / top, w)) * top
                else:
                    assert bound == lower_bound(workloads, w)


def test_bound_is_tight_for_one_huge_item() -> None:
    x = np.array([100, 1, 1, 1, 2, 2, 3, 3])
    assert lower_bound(x, 2) == 103.0  # 100 + the 3 smallest
    assert _max_load(x, balanced_partition(x, 2)) == 103


@pytest.mark.parametrize("parts", [np.int64(2), np.int32(2), np.uint8(2)])
def test_a_numpy_integer_num_parts_keeps_the_integer_bound_exact(parts: Any) -> None:
    # Once 4.999999999999982 and 10.999999999999941: the bound of integer workloads
    # took the float path (lowered by 4 N eps) when W was a numpy integer.
    assert lower_bound([1, 2, 3, 4], parts) == lower_bound([1, 2, 3, 4], 2) == 5.0
    assert lower_bound([9, 1, 6, 3, 2, 0], parts) == 11.0
    assert lower_bound([1, 2, 3, 4, 5], parts, equal_size=False) == 8.0


# ------------------------------------------------------------ stats
def test_partition_stats_and_imbalance() -> None:
    x = np.array([9, 1, 8, 2, 7, 3])
    before = imbalance(x, 2)
    assert isinstance(before, PartitionStats)
    assert before.loads.tolist() == [18, 12]
    parts = balanced_partition(x, 2)
    assert parts == [[0, 3, 5], [1, 2, 4]]  # the docstring example
    after = partition_stats(x, parts)
    assert after.max_load == 16 and after.bound == 16 and after.max_over_bound == 1.0
    assert after.max_over_mean == pytest.approx(16 / 15)
    assert after.speedup_over(before) == pytest.approx(18 / 16)


# ------------------------------------------------------------ locality
def _dest(parts: list[list[int]], n: int) -> np.ndarray:
    dest = np.empty(n, np.int64)
    for r, p in enumerate(parts):
        dest[p] = r
    return dest


@pytest.mark.parametrize("case", range(0, 40, 4))
def test_localize_invariants(case: int) -> None:
    x, w = INSTANCES[case]
    n = x.size
    home = np.arange(n) // (n // w)
    sizes = np.sqrt(x) + 1.0
    parts = balanced_partition(x, w)
    out = localize(parts, x, home, sizes)
    _check_parts(out, n, w)
    assert sorted(map(sorted, out)) != [] and sorted(i for p in out for i in p) == list(range(n))
    assert _max_load(x, out) <= _max_load(x, parts), "never raises the max load"
    stay = sizes[_dest(out, n) == home].sum()
    blind = sizes[_dest(parts, n) == home].sum()
    assert stay >= blind, "at least the placement-blind assignment"
    rng = np.random.default_rng(case)
    shuffled = [parts[i] for i in rng.permutation(w)]
    assert sizes[_dest(localize(shuffled, x, home, sizes), n) == home].sum() >= \
        sizes[_dest(shuffled, n) == home].sum(), "at least the identity assignment"


def test_localize_keeps_a_balanced_home() -> None:
    # Home is already perfectly balanced: every rank has the same multiset.
    w, b = 4, 6
    x = np.tile(np.array([5, 1, 9, 3, 7, 2]), w)
    home = np.arange(w * b) // b
    home_parts = [list(range(r * b, (r + 1) * b)) for r in range(w)]
    rng = np.random.default_rng(0)
    shuffled = [home_parts[i] for i in rng.permutation(w)]
    assert localize(shuffled, x, home) == home_parts
    assert balanced_partition(x, w, home=home) == home_parts
    # Items of equal workload are interchangeable: a scrambled but equally
    # balanced partition is brought back home.
    scrambled = [[r + w * k for k in range(b)] for r in range(w)]
    assert localize(scrambled, np.arange(w * b) * 0 + 1, home) == home_parts


def test_localize_moves_little_at_four_ranks() -> None:
    rng = np.random.default_rng(1)
    w, b = 4, 128
    lens = np.clip(np.rint(rng.lognormal(6, 1, w * b)), 1, 8192).astype(np.int64)
    x = lens * lens + 1024 * lens
    home = np.arange(w * b) // b
    sizes = 64 + 8 * lens
    parts = balanced_partition(x, w)
    out = localize(parts, x, home, sizes)
    moved = sizes[_dest(out, w * b) != home].sum()
    blind = sizes[_dest(parts, w * b) != home].sum()
    assert moved <= 0.5 * blind, "the shuffler's target: <= 50 % of placement-blind bytes"
    assert _max_load(x, out) <= _max_load(x, parts)


def test_localize_errors() -> None:
    with pytest.raises(ValueError, match="permutation"):
        localize([[0, 1], [1, 2]], [1, 1, 1, 1], [0, 0, 1, 1])
    with pytest.raises(ValueError, match="home"):
        localize([[0, 1], [2, 3]], [1, 1, 1, 1], [0, 0, 1, 2])
    # float indices were truncated (0.7 -> 0), ragged parts got numpy's own message
    for parts in ([[0.7, 1], [2, 3]], [[0, 1], [2, 3, 4], [5]]):
        with pytest.raises(ValueError, match=r"parts must be \d lists of 2 int indices"):
            localize(parts, list(range(2 * len(parts))), [0] * 2 * len(parts))
    assert localize([[3, 1, 2, 0]], [1, 2, 3, 4], [0, 0, 0, 0]) == [[0, 1, 2, 3]]  # one part: ascending too


def _exact_max(x: np.ndarray, parts: list[list[int]]) -> float:
    return max(math.fsum(x[i] for i in p) for p in parts)


def test_localize_never_raises_the_exact_max_of_float_workloads() -> None:
    # The re-balance from home tracked loads by running float sums: its result
    # could end an ulp above the input's max (374.3 -> 374.30000000000007).
    rng = np.random.default_rng(7)
    raised = 0
    for _ in range(300):
        w, b = 8, 8
        x = np.round(rng.uniform(0, 100, w * b), 1)
        parts = balanced_partition(x, w)
        home = rng.integers(0, w, w * b)
        top = _exact_max(x, parts)
        raised += _exact_max(x, localize(parts, x, home)) > top
        raised += _exact_max(x, balanced_partition(x, w, home=home)) > top
    assert raised == 0


# ------------------------------------------------------------ worker process
def test_partition_worker_matches_in_process() -> None:
    worker = PartitionWorker()
    try:
        x, w = INSTANCES[11]
        assert worker(x, w) == balanced_partition(x, w)
        home = np.arange(x.size) // (x.size // w)
        assert worker.submit(x, w, home).wait() == balanced_partition(x, w, home=home)
        assert worker(np.arange(12, dtype=np.float64), 3) == balanced_partition(np.arange(12.0), 3)
        with pytest.raises(ValueError, match="not divisible by num_parts=4"):
            worker(np.ones(10), 4)
        assert worker([], 2) == [[], []]
        # Two large requests in flight: the child blocked writing reply 1 while
        # the parent blocked writing request 2, for ever (from N = 8192 on).
        big = np.arange(8192 * 4)
        first, second = worker.submit(big, 8), worker.submit(big[::-1].copy(), 8)
        assert second.wait() == balanced_partition(big[::-1].copy(), 8) and first.wait() == balanced_partition(big, 8)
        # Input the in-process call refuses is refused here too, before the request
        # (a home of the wrong length once hung the pipe; the others were partitioned).
        for kwargs, error, text in (
                ({"home": [0, 1]}, ValueError, r"home has shape \(2,\)"),
                ({"home": [0.0, 0.5, 1.0, 1.0]}, ValueError, "home has shape .* dtype float64"),
                ({"num_parts": 2.5}, TypeError, "num_parts=2.5, expected an int"),
                ({"num_parts": True}, TypeError, "num_parts=True, expected an int"),
                ({"workloads": np.ones((2, 2))}, ValueError, r"workloads has shape \(2, 2\), expected 1-D")):
            call = {"workloads": [1, 2, 3, 4], "num_parts": 2} | kwargs
            with pytest.raises(error, match=text):
                worker.submit(call.pop("workloads"), call.pop("num_parts"), **call)
        with pytest.raises(ValueError, match=r"workloads\[0\] = nan, expected a finite value"):
            worker.submit([float("nan"), 1, 2, 3], 2, quantized=True)  # quantize hid the NaN once
        assert worker([1, 2, 3, 4], 2) == balanced_partition([1, 2, 3, 4], 2)  # the pipe is in step
    finally:
        worker.close()
        worker.close()
    with pytest.raises(RuntimeError, match="PartitionWorker is closed"):
        worker([1, 2], 2)  # once written into whatever file reused the pipe's descriptor


def _child_modules() -> functools.partial[Any]:
    """A picklable call that lists the child's loaded torch/torchrec modules."""
    return functools.partial(eval, "[m for m in __import__('sys').modules if m.split('.')[0] in "
                                   "('torch', 'torchrec')]")


def test_partition_worker_child_imports_no_torch() -> None:
    """The child runs the partition and the shuffler's planning with numpy alone."""
    from balancer._header import H_REAL, HEADER_LEN
    from balancer._plan_layout import PlanLayout
    from balancer._step import plan_step

    w, b = 2, 3
    rows = np.zeros((w, HEADER_LEN + b), np.int64)
    rows[:, H_REAL] = b
    rows[:, HEADER_LEN:] = np.array([[9.0, 1, 8], [2, 7, 3]]).view(np.int64)
    worker = PartitionWorker()
    try:
        assert worker([9, 1, 8, 2, 7, 3], 2) == [[0, 3, 5], [1, 2, 4]]
        step = worker.submit_call(plan_step, rows=rows, layout=PlanLayout(b, 0, (), ()), seq=0, rank=0,
                                  comm="all2all", locality=False).wait_call()
        assert step.stats.max_after == 16
        assert worker.submit_call(_child_modules()).wait_call() == []
    finally:
        worker.close()


def test_partition_package_has_no_import_cycle() -> None:
    """No module of balancer/partition imports the package entry (its __init__),
    the modules' imports among themselves form no cycle, and nothing outside
    the package is imported but torch-free leaves (the worker child's chain)."""
    root = pathlib.Path(balancer.partition.__file__).parent
    allowed_outside = {"balancer._limits", "balancer._quantize"}
    graph: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        name = "balancer.partition" if path.stem == "__init__" else f"balancer.partition.{path.stem}"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t.split(".")[0] in ("torch", "torchrec"):
                    raise AssertionError(f"{name} imports {t}")
                if t.startswith("balancer.partition._"):
                    deps.add(t if t in {f"balancer.partition.{p.stem}" for p in root.glob("*.py")}
                             else t.rsplit(".", 1)[0])
                elif t == "balancer.partition":
                    assert name == "balancer.partition", f"{name} imports the package entry"
                elif t.startswith("balancer.") and t.rsplit(".", 1)[0] != "balancer.partition":
                    assert t in allowed_outside or t.rsplit(".", 1)[0] in allowed_outside, (
                        f"{name} imports {t}, outside the partition package")
        graph[name] = deps
    assert len(graph) > 10 and graph["balancer.partition"], "the package's modules were read"
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"import cycle: {' -> '.join(path + (node,))}"
        if node not in done:
            for dep in sorted(graph.get(node, ())):
                visit(dep, path + (node,))
            done.add(node)

    for node in sorted(graph):
        visit(node, ())


def test_lower_bound_free_sizes() -> None:
    x = np.array([9, 1, 8, 2, 7, 3])
    assert lower_bound(x, 2) == 16  # equal counts: two of 9, 8, 7 share a part
    assert lower_bound(x, 2, equal_size=False) == 15  # free sizes: the mean
    assert lower_bound(x, 2, equal_size=False, min_size=3, max_size=3) == 16
    assert lower_bound(np.arange(7), 3, equal_size=False) == 7  # N need not divide
    with pytest.raises(ValueError, match="equal_size=False"):
        lower_bound(x, 2, max_size=3)
    with pytest.raises(ValueError, match="cannot give 3 parts min_size=3"):
        lower_bound(x, 3, equal_size=False, min_size=3)


# ------------------------------------------------------------ quality guard
# Bound-relative thresholds on seeded heavy-tailed instances. Calibrated on the
# current pipeline with margin; switching the swap refinement off makes every
# group below fail (see docs/benchmarks_partition.md, "Quality guard").
def _seeded(dist: str, w: int, b: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + seed)
    if dist == "zipf":
        lens = np.minimum(rng.zipf(1.2, w * b), 4096).astype(np.int64)
    elif dist == "uniform":
        lens = rng.integers(1, 4097, w * b)
    else:
        lens = np.clip(np.rint(rng.lognormal(6.0, 1.0, w * b)), 1, 8192).astype(np.int64)
    return lens * lens + 1024 * lens


GUARD = [("lognormal", 8, 64), ("lognormal", 64, 32), ("lognormal", 256, 32),
         ("lognormal", 16, 256), ("lognormal", 512, 8), ("lognormal", 1024, 16),
         ("zipf", 8, 64), ("zipf", 256, 32), ("zipf", 16, 256)]


@pytest.mark.parametrize("dist,w,b", GUARD)
def test_quality_within_2e5_of_bound(dist: str, w: int, b: int) -> None:
    gaps = []
    for seed in range(4):
        x = _seeded(dist, w, b, seed)
        gaps.append(_max_load(x, balanced_partition(x, w)) / lower_bound(x, w) - 1)
    assert max(gaps) <= 2e-5, f"{dist} {w}x{b}: max/bound - 1 = {gaps}"


@measured_on_numpy_2_1_zipf
def test_quality_on_the_random_suite() -> None:
    # The 60 random instances above (1 <= W, B <= 64, five distributions);
    # those far above the bound are small instances where the bound is loose.
    gaps = np.array([_max_load(x, balanced_partition(x, w)) / lower_bound(x, w) - 1
                     for x, w in INSTANCES])
    assert (gaps > 1e-5).sum() <= 18, f"{(gaps > 1e-5).sum()} of 60 above 1e-5 (16 expected)"
    assert (gaps > 1e-4).sum() <= 13, f"{(gaps > 1e-4).sum()} of 60 above 1e-4"
    assert float(np.median(gaps)) <= 1e-5


def test_optimal_where_greedy_is_not() -> None:
    # Small instances on which largest-first greedy misses the optimum; the
    # refinement must close the gap on (nearly) all of them.
    rng = np.random.default_rng(7)
    shapes = [(2, 3), (2, 4), (3, 2), (3, 3), (4, 2), (2, 5)]
    cases = hits = 0
    for trial in range(400):
        w, b = shapes[trial % len(shapes)]
        x = rng.integers(1, 60, w * b) ** 2
        opt = _optimum(x, w)
        if _max_load(x, greedy(x, w)) == opt:
            continue
        got = _max_load(x, balanced_partition(x, w, rtol=0.0))
        assert got >= opt
        cases += 1
        hits += got == opt
        if cases == 40:
            break
    assert cases == 40
    assert hits >= 36, f"optimal on {hits} of {cases} instances where greedy is not"


def test_grouped_bound_covers_every_k(monkeypatch: pytest.MonkeyPatch) -> None:
    # 300 equal huge items H among 400 parts of 2: the grouped term with k = 300
    # (beyond the old cap of 256) gives H + the average of the 300 smallest
    # fillers; with k = 256 it would be the average of the 256 smallest.
    w, b = 400, 2
    rng = np.random.default_rng(0)
    fill = np.sort(rng.integers(1, 1000, w * b - 300))
    x = np.concatenate([np.full(300, 10**6), fill])
    expected = 10**6 + -(-int(fill[:300].sum()) // 300)
    with monkeypatch.context() as m:  # the grouped term alone
        m.setattr("balancer.partition._bound.crowded_bound", lambda v, prefix, w, best: best)
        assert lower_bound(x, w) == float(expected) > 10**6 + fill[:256].sum() / 256
    # Each H sits with exactly one filler: the optimum is H + the 300th smallest,
    # and the crowded term proves it (the 201 fillers >= fill[299] cannot all
    # fit in the 200 slots of the 100 parts without an H).
    assert lower_bound(x, w) == 10**6 + int(fill[299]) > expected
    assert _max_load(x, balanced_partition(x, w)) == 10**6 + int(fill[299])


def _truncated(rng: np.random.Generator, w: int, b: int, floats: bool) -> np.ndarray:
    """A tiny instance with a tie block at the top: lengths cut at a maximum."""
    n = w * b
    top = int(rng.integers(20, 200))
    k = int(rng.integers(w + 1, n - 1))
    rest = rng.integers(0, top, n - k) ** int(rng.integers(1, 3))
    x = np.minimum(np.concatenate([np.full(k, top), rest]), top)
    rng.shuffle(x)
    return x * 1.37 if floats else x


def test_crowded_bound_against_brute_force(monkeypatch: pytest.MonkeyPatch) -> None:
    # Truncated instances: the crowded term never passes the optimum, raises
    # the bound on some and makes it tight on some (measured while building it:
    # 600 instances, 0 above the optimum, 42 raised, 24 of them to the optimum).
    from balancer.partition import _bound

    rng = np.random.default_rng(0)
    shapes = [(3, 3), (3, 4), (4, 3), (2, 6), (5, 2), (2, 5)]
    raised = tight = 0
    for trial in range(240):
        w, b = shapes[trial % len(shapes)]
        x = _truncated(rng, w, b, floats=trial % 3 == 0)
        opt = _brute_optimum(x, w)
        new = lower_bound(x, w)
        with monkeypatch.context() as m:
            m.setattr(_bound, "crowded_bound", lambda v, prefix, w, best: best)
            old = lower_bound(x, w)
        assert old <= new <= opt, (w, sorted(x.tolist()), old, new, opt)
        raised += new > old
        tight += new > old and new >= opt * (1 - 1e-12)
    assert raised >= 10 and tight >= 5, (raised, tight)


def test_crowded_average_against_brute_force(monkeypatch: pytest.MonkeyPatch) -> None:
    # A top block far above the rest: the parts holding c of it set the max, and
    # together they need a (B - c) fillers, not B - c each. The crowded parts'
    # own average never passes the optimum and raises the bound on some
    # instances (measured while building it: 0 of 2,100 above the optimum on
    # several generators; adding 3 to the average put 93 of 120 above it, and
    # one more filler in its sum all 120).
    from balancer.partition import _crowded

    rng = np.random.default_rng(0)
    w, b = 3, 4  # the smallest shape where it raises the bound (8-15 % of such instances)
    n = w * b
    raised = 0
    for trial in range(60):
        k = int(rng.integers(w + 1, min(n - 1, 2 * w + w // 2 + 2)))  # c = 2 mostly
        x = np.concatenate([np.full(k, int(rng.integers(200, 400))),
                            rng.integers(1, 41, n - k) * int(rng.integers(1, 3))])
        rng.shuffle(x)
        x = x * 1.37 if trial % 3 == 0 else x
        opt = _brute_optimum(x, w)
        new = lower_bound(x, w)
        with monkeypatch.context() as m:
            m.setattr(_crowded, "crowded_average", lambda *args: 0)
            old = lower_bound(x, w)
        assert old <= new <= opt, (w, sorted(x.tolist()), old, new, opt)
        raised += new > old
    assert raised >= 3, raised  # 5 of these 60


def test_crowded_bound_at_scale_on_clipped_zipf(monkeypatch: pytest.MonkeyPatch) -> None:
    # Zipf lengths clipped at 4096 (~2.7 clipped samples per part at B = 16):
    # parts holding three clipped samples cannot take the larger fillers. The
    # crowded term raises the bound (measured: 6.1e-4 on 16384 x 16, 1.3e-3 on
    # 1024 x 16, 4.9e-5 on 2048 x 8) and stays below what the partition reaches.
    from balancer.partition import _bound

    for w, b, least in ((16384, 16, 5e-4), (1024, 16, 1e-3), (2048, 8, 4e-5)):
        x = _seeded("zipf", w, b, 0)
        new = lower_bound(x, w)
        with monkeypatch.context() as m:
            m.setattr(_bound, "crowded_bound", lambda v, prefix, w, best: best)
            old = lower_bound(x, w)
        reached = _max_load(x, balanced_partition(x, w))
        assert old * (1 + least) < new <= reached, (w, b, old, new, reached)


def test_large_inputs_are_deterministic() -> None:
    # N > 2048 takes the projected-load start; same input, same output.
    x = _seeded("lognormal", 128, 32, 0)
    first = balanced_partition(x, 128)
    assert balanced_partition(x.tolist(), 128) == first
    assert balanced_partition(torch.from_numpy(x), 128) == first
    _check_parts(first, x.size, 128)


# ------------------------------------------------------------ column re-matching
def test_rematch_move_is_the_best_matching_of_its_column() -> None:
    # One move against every way of handing a column's items back (5! = 120):
    # the move reaches the best max load of them all (or keeps the old one).
    # A budget under two cycles starts from the largest column (b - 1).
    from balancer.partition._rematch import rematch_columns

    rng = np.random.default_rng(11)
    for _ in range(20):
        w, b = 5, 3
        vals = np.sort(rng.integers(0, 1000, w * b))
        rows = np.sort(rng.permutation(w * b).reshape(w, b), axis=1)
        loads = vals[rows].sum(axis=1)
        before = int(loads.max())
        col, rest = rows[:, b - 1], loads - vals[rows[:, b - 1]]
        best = min(int((rest + vals[col[list(p)]]).max()) for p in itertools.permutations(range(w)))
        rematch_columns(vals, rows, loads, target=-1, max_moves=1)
        assert int(loads.max()) == min(before, best)
        assert (loads == vals[rows].sum(axis=1)).all()
        assert sorted(rows.ravel().tolist()) == list(range(w * b))
        assert (np.diff(rows, axis=1) > 0).all(), "rows ascending again"


@pytest.mark.parametrize("block", [(2,), (0, 2), (1, 3)])
@pytest.mark.parametrize("floats,exact", [(False, True), (False, False), (True, True)])
def test_rematch_block_move_is_the_best_matching_of_its_block(block: tuple[int, ...], floats: bool, exact: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # One block move against every way of handing the parts' blocks back (5! = 120):
    # the block's items travel together, and the move reaches the best max load
    # of them all (or keeps the old one). Integers take the exact order (up to
    # 256 parts) or the coarse keys (exact too for spans below 2**16, as here);
    # floats order_floats.
    from balancer.partition import _rematch

    monkeypatch.setattr(_rematch, "_blocks", lambda b: [block])
    if not exact:
        monkeypatch.setattr(_rematch, "_EXACT_MAX_PARTS", 0)
    rng = np.random.default_rng(12)
    for _ in range(20):
        w, b = 5, 4
        vals = np.sort(rng.integers(0, 1000, w * b)) * (1.5 if floats else 1)
        rows = np.sort(rng.permutation(w * b).reshape(w, b), axis=1)
        loads = vals[rows].sum(axis=1)
        before = loads.max()
        sums = vals[rows[:, list(block)]].sum(axis=1)
        rest = loads - sums
        best = min((rest + sums[list(p)]).max() for p in itertools.permutations(range(w)))
        groups = sorted(sorted(rows[q, list(block)].tolist()) for q in range(w))
        _rematch.rematch_blocks(vals, rows, loads, target=-1, max_moves=1)
        assert loads.max() == min(before, best)
        np.testing.assert_array_equal(loads, vals[rows].sum(axis=1))
        assert sorted(rows.ravel().tolist()) == list(range(w * b))
        assert (np.diff(rows, axis=1) > 0).all(), "rows ascending again"
        # the blocks moved whole: every old block lies in one part
        assert all(any(set(g) <= set(rows[q].tolist()) for q in range(w)) for g in groups)


# Few items per part, many parts: single swaps alone end 3-9e-3 (256x4) and
# ~4e-3 (8192x8) above the bound; column re-matching brings both below these.
# At B <= 4 the moves take blocks of two columns at every N: 256x4 ends 3.8e-4
# to 6.3e-4 above the bound on these seeds, single columns 1.3-1.9e-3.
# Above N = 1,024 the moves take blocks of two columns (rematch_blocks), and
# above N = 16,384 they stop within 5e-5 of the bound (_REMATCH_RTOL). On these
# seeds single columns ended 1.2-1.8e-4 (1024x8), 1.2-1.7e-4 (8192x8), 4.0-7.7e-4
# (32768x8, where the issue asks 1e-4 in the median) and 5.1-7.4e-3 (16384x4);
# blocks end 1.6-2.0e-5, 3.9-4.6e-5, 3.5-4.4e-5 and 1.9e-4 to 1.7e-3. 16384x16:
# 2.0-3.5e-5 (4.5e-4 without re-matching). 16384x4: seeds 1 and 3 end 1.1e-3 and
# 1.7e-3 that way; the crowded start's second try (one length-4096 sample per
# part at most) took them to 8.1e-5 and 1.4e-4, and a re-matching budget of 32
# moves instead of 16 (_REMATCH_MIN_MOVES) takes all four to 4.3-5.0e-5 (with 16
# they end 8.4e-5 to 2.1e-4 now).
@pytest.mark.parametrize("w,b,limit", [(256, 4, 1e-3), (1024, 8, 5e-5), (8192, 8, 1e-4), (32768, 8, 1e-4),
                                       (16384, 16, 1e-4), (16384, 4, 1e-4)])
def test_quality_with_few_items_per_part(w: int, b: int, limit: float) -> None:
    gaps = []
    for seed in range(4):
        x = _seeded("uniform", w, b, seed)
        parts = balanced_partition(x, w)
        _check_parts(parts, x.size, w)
        gaps.append(_max_load(x, parts) / lower_bound(x, w) - 1)
    assert max(gaps) <= limit, f"uniform {w}x{b}: max/bound - 1 = {gaps}"


def test_level_others_frees_a_tie_at_the_top(monkeypatch: pytest.MonkeyPatch) -> None:
    # bench_partition's 8x32 padded instance, seed 5: one part holds the largest
    # item (0.99 of the bound) and zeros; it ties at the top with another heavy
    # part, and every swap that lowers one raises the other. Single and
    # two-for-two swaps stop 4.9e-3 above the bound (an exact MIP reaches
    # 6.3e-5). Levelling the other parts gives the heavy ones room.
    from balancer.partition import _solve
    from balancer.partition._refine import level_others

    lens = _lengths("padded", 256, np.random.default_rng(5))
    x = (lens * lens + 1024 * lens).astype(np.int64)
    bound = lower_bound(x, 8)
    assert max(int(x[p].sum()) for p in balanced_partition(x, 8)) <= bound * (1 + 1e-4)
    monkeypatch.setattr(_solve, "_LEVEL_ROUNDS", 0)
    stuck = _solve.solve(x, 8, 1e-5)
    assert stuck.loads.max() > bound * (1 + 1e-3), "polish alone stops far above the bound"
    rows, loads = stuck.rows.copy(), stuck.loads.copy()
    for pairs in (0, 6):
        top = loads.max()
        level_others(stuck.vals, rows, loads, int(bound * (1 + 1e-5)), 256, pairs, 4)
        assert loads.max() <= top  # never raises the max
        np.testing.assert_array_equal(loads, stuck.vals[rows].sum(axis=1))
        np.testing.assert_array_equal(np.sort(rows.ravel()), np.arange(256))  # every item once, B per part
    assert loads.max() <= bound * (1 + 1e-4)


# ------------------------------------------------------------ crowded parts
# Zipf lengths clipped at 4096 put ~17 % of the samples at one largest cost, 2.7
# per part at B = 16: the parts holding two of them carry the large fillers. The
# regular path ends 3.8e-3 to 9.6e-3 above the bound on seeds 0-2; the crowded
# start 9.8e-6 to 4.9e-4 (3.2e-5 to 8.5e-5 at 4096x16 and 16384x16). At 1024x16
# and 2048x16 seeds 3-7 need the second try's other goals for the cores: with
# the first goal alone 1024x16 seeds 3-6 end 2.7e-3 to 9.0e-3 above the bound
# and 2048x16 seed 3 1.7e-2; with them 9.4e-5 to 4.9e-4 and 3.0e-4.
@pytest.mark.parametrize("w,b,limit,seeds", [(1024, 16, 1e-3, 8), (2048, 16, 1e-3, 8), (4096, 16, 2e-4, 3),
                                             (16384, 16, 2e-4, 3)])
@measured_on_numpy_2_1_zipf
def test_crowded_parts_end_near_the_bound(w: int, b: int, limit: float, seeds: int) -> None:
    for seed in range(seeds):
        x = _seeded("zipf", w, b, seed)
        parts = balanced_partition(x, w)
        _check_parts(parts, x.size, w)
        gap = _max_load(x, parts) / lower_bound(x, w) - 1
        assert gap <= limit, f"zipf {w}x{b} seed {seed}: max/bound - 1 = {gap:.2e}"
        if seed == 0:
            assert balanced_partition(x.tolist(), w) == parts, "every rank computes the same partition"


@measured_on_numpy_2_1_zipf
def test_small_crowded_inputs_get_the_crowded_start_as_a_second_try() -> None:
    # Below N = 1,025 too, a regular result more than 1e-3 above the bound gets
    # the crowded start as a second try (two or more big items per part, its own
    # goal for the cores). 64x16 Zipf, seeds 0-7: without it the worst ends
    # 1.7e-2 above the bound and seed 6 1.4e-3; with it 7.1e-3 and 9.5e-6.
    gaps = []
    for seed in range(8):
        x = _seeded("zipf", 64, 16, seed)
        parts = balanced_partition(x, 64)
        _check_parts(parts, x.size, 64)
        gaps.append(_max_load(x, parts) / lower_bound(x, 64) - 1)
        if seed == 6:
            assert balanced_partition(x.tolist(), 64) == parts, "every rank computes the same partition"
    assert max(gaps) <= 8e-3 and gaps[6] <= 1e-4, f"zipf 64x16: max/bound - 1 = {gaps}"


def test_a_crowded_start_that_misses_falls_back_to_the_regular_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Above N = 16,384 the crowded start goes first; where it ends more than
    # 1e-3 above the bound, the regular path is its second try. Spoil the first
    # crowded start (parts dealt in sorted order: ~2x the bound) and the result
    # must still be within 1e-3: 2.9e-4 here (4.4e-5 unspoiled).
    from balancer.partition import _solve

    real = _solve.crowded_start
    spoiled = []

    def first_spoiled(v: np.ndarray, w: int, *args: Any, **kwargs: Any) -> Any:
        got = real(v, w, *args, **kwargs)
        if got is None or spoiled:
            return got
        spoiled.append(True)
        rows = np.arange(v.size).reshape(w, -1)  # the largest items together
        return rows, v[rows].sum(axis=1)

    monkeypatch.setattr(_solve, "crowded_start", first_spoiled)
    w, b = 4096, 16
    x = _seeded("zipf", w, b, 0)
    parts = balanced_partition(x, w)
    _check_parts(parts, x.size, w)
    assert spoiled, "the crowded start went first"
    gap = _max_load(x, parts) / lower_bound(x, w) - 1
    assert gap <= 1e-3, f"zipf {w}x{b} seed 0 after a spoiled crowded start: max/bound - 1 = {gap:.2e}"


def test_crowded_start_gives_the_big_items_and_forced_fillers_their_parts() -> None:
    from balancer.partition._bound import bound_sorted, prefix_sums
    from balancer.partition._crowded_start import crowded_start
    from balancer.partition._refine import sort_values
    from balancer.partition._solve import equal_labels

    w, b = 512, 16
    _, v = sort_values(_seeded("zipf", w, b, 0))
    prefix = prefix_sums(v)
    bound = bound_sorted(v, w, prefix=prefix)
    out = crowded_start(v, w, prefix, bound, bound, 2, True, equal_labels)
    assert out is not None
    rows, loads = out
    assert rows.shape == (w, b) and (np.sort(rows, axis=None) == np.arange(v.size)).all()
    assert (np.diff(rows, axis=1) > 0).all(), "rows ascending"
    assert (v[rows].sum(axis=1) == loads).all()
    k = int((v == v[-1]).sum())
    c = -(-k // w)
    a = k - (c - 1) * w
    big = (rows >= v.size - k).sum(axis=1)
    assert (big[:a] == c).all() and (big[a:] == c - 1).all()
    # A filler that cannot sit beside c big items under the bound is in a part with c - 1.
    cap = bound - c * int(v[-1]) - int(v[: b - c - 1].sum())
    forced = (v[rows] > cap) & (rows < v.size - k)
    assert forced[a:].any() and not forced[:a].any()
    # Not crowded: uniform lengths (the top tie block is tiny), and lognormal ones
    # (a few samples at the clip set the bound; the mean load is far below it).
    for dist in ("uniform", "lognormal"):
        _, u = sort_values(_seeded(dist, w, b, 0))
        pu = prefix_sums(u)
        bu = bound_sorted(u, w, prefix=pu)
        assert crowded_start(u, w, pu, bu, bu, 2, True, equal_labels) is None, dist


@pytest.mark.parametrize("alternate", [False, True])
def test_fill_from_a_start_keeps_what_the_parts_hold(alternate: bool) -> None:
    from balancer.partition._bound import prefix_sums
    from balancer.partition._fill import fill
    from balancer.partition._refine import sort_values

    w, b = 64, 16
    _, v = sort_values(_seeded("lognormal", w, b, 2))
    prefix = prefix_sums(v)
    n = v.size
    empty = (np.empty((w, b), np.int64), np.zeros(w, np.int64), np.full(w, b), n)
    rows, loads = fill(v, w, prefix, 2, alternate)
    rows2, loads2 = fill(v, w, prefix, 2, alternate, start=empty)
    assert (rows == rows2).all() and (loads == loads2).all()
    # Parts 0..9 hold the 3 largest items each, parts 10..19 one each, part 20 a full row.
    held = np.zeros(w, np.int64)
    held[:10], held[10:20], held[20] = 3, 1, b
    taken = np.arange(n - held.sum(), n)
    part = np.repeat(np.arange(w), held)
    offset = np.arange(part.size) - np.repeat(np.cumsum(held) - held, held)
    start = np.full((w, b), -1, np.int64)
    start[part, b - held[part] + offset] = taken
    load = np.zeros(w, np.int64)
    np.add.at(load, part, v[taken])
    before = start.copy()
    rows3, loads3 = fill(v, w, prefix, 2, alternate, start=(start, load, b - held, n - int(held.sum())))
    assert (np.sort(rows3, axis=None) == np.arange(n)).all() and (np.diff(rows3, axis=1) > 0).all()
    assert (v[rows3].sum(axis=1) == loads3).all()
    kept = before >= 0
    assert (rows3[kept] == before[kept]).all(), "items already placed stay"


# ------------------------------------------------------------ deadline
def test_deadline_returns_a_valid_partition_no_worse_than_the_start() -> None:
    x = _seeded("lognormal", 64, 64, 1)
    full = balanced_partition(x, 64, rtol=0.0)
    rushed = balanced_partition(x, 64, rtol=0.0, deadline_ms=1e-6)  # refinement skipped
    _check_parts(rushed, x.size, 64)
    assert _max_load(x, full) <= _max_load(x, rushed) <= _max_load(x, greedy(x, 64)) * 1.001
    with pytest.raises(ValueError, match=r"deadline_ms=0, expected a number > 0 or None"):
        balanced_partition(x, 64, deadline_ms=0)
    for bad in (True, "5"):  # True was 1 ms; "5" raised a bare TypeError
        with pytest.raises(ValueError, match=rf"deadline_ms={bad!r}, expected a number > 0 or None"):
            balanced_partition(x, 64, deadline_ms=bad)
    with pytest.raises(ValueError, match=r"rtol=-1, expected a finite number >= 0"):
        balanced_partition(x, 64, rtol=-1)


# ------------------------------------------------------------ compute and memory
def _zipf_tokens(w: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.zipf(1.2, w * 32), 4096).astype(np.int64)
    return lens * lens + 256 * lens, lens


@pytest.mark.parametrize("w", [8, 16])
def test_token_cap_is_honoured(w: int) -> None:
    for seed in range(3):
        x, lens = _zipf_tokens(w, seed)
        cap = 1.01 * lens.sum() / w
        parts = balanced_partition(x, w, tokens=lens)
        _check_parts(parts, x.size, w)
        assert max(int(lens[p].sum()) for p in parts) <= cap
        assert _max_load(x, parts) >= lower_bound(x, w)
        explicit = balanced_partition(x, w, tokens=lens, max_tokens=cap)
        assert explicit == parts


@pytest.mark.parametrize("seed", [4, 18])
def test_tight_token_cap_reaches_the_compute_bound(seed: int) -> None:
    # Tokens <= 1.01 x mean and compute within 1e-4 of its bound at once. From
    # the compute-first start alone the search stops 1.5-2e-3 above the bound
    # on both seeds; the second start (deal_by_room) reaches it.
    x, lens = _zipf_tokens(8, seed)
    cap = 1.01 * lens.sum() / 8
    parts = balanced_partition(x, 8, tokens=lens, max_tokens=cap)
    _check_parts(parts, x.size, 8)
    assert max(int(lens[p].sum()) for p in parts) <= cap
    assert _max_load(x, parts) <= lower_bound(x, 8) * (1 + 1e-4)


@pytest.mark.parametrize(("w", "seed", "slack"), [(8, 2, 1.01), (12, 4, 1.02), (16, 5, 1.01)])
def test_relay_reaches_the_compute_bound_where_polish_stops(w: int, seed: int, slack: float) -> None:
    # Polish stops where the parts with compute to spare are full of tokens:
    # 4.0e-4, 5.6e-4 and 1.6e-3 above the bound without relays
    # (_RELAY_SEARCHES = 0). An exact solver (tokens_mip.py's program) finds
    # 9.5e-5 on the first case, so the gap was the search's.
    x, lens = _zipf_tokens(w, seed)
    cap = slack * lens.sum() / w
    for costs in (x, x / 7.0):  # float costs too: no swap of equal items counts as a move
        parts = balanced_partition(costs, w, tokens=lens, max_tokens=cap)
        _check_parts(parts, x.size, w)
        assert max(int(lens[p].sum()) for p in parts) <= cap
        assert _max_load(costs, parts) <= lower_bound(costs, w) * (1 + 1e-4), costs.dtype


@pytest.mark.parametrize(("w", "seed", "slack", "limit"), [(32, 4, 1.02, 2e-4), (64, 0, 1.02, 2e-4)])
def test_wide_search_goes_on_where_relays_stop(w: int, seed: int, slack: float, limit: float) -> None:
    # Past W ~ 32 the partner with a fitting swap often sits beyond the ~6
    # that polish and relays search: without the wide search
    # (_WIDE_SEARCHES = 0) these end 7.9e-4 and 1.2e-3 above the bound.
    x, lens = _zipf_tokens(w, seed)
    cap = slack * lens.sum() / w
    parts = balanced_partition(x, w, tokens=lens, max_tokens=cap)
    _check_parts(parts, x.size, w)
    assert max(int(lens[p].sum()) for p in parts) <= cap
    assert _max_load(x, parts) <= lower_bound(x, w) * (1 + limit)


@pytest.mark.parametrize("floats", [False, True])
def test_wide_single_is_the_best_single_swap(floats: bool) -> None:
    # Against every single swap of the heaviest part with every lighter part,
    # enumerated one by one: the lowest pair max, both parts within the cap.
    rng = np.random.default_rng(7)
    found = 0
    for trial in range(40):
        w, b = int(rng.integers(8, 40)), int(rng.integers(1, 12))
        lens = rng.integers(1, 60, w * b)
        vals = lens * lens + 16 * lens
        vals = vals / 3.0 if floats else vals
        order = np.argsort(vals, kind="stable")
        v, tok = vals[order], lens[order]
        rows = np.sort(rng.permutation(w * b).reshape(w, b), axis=1)
        loads, tsum = v[rows].sum(axis=1), tok[rows].sum(axis=1)
        cap = float(np.quantile(tsum, 0.7)) + float(rng.integers(0, 20))
        p = int(np.argmax(loads))
        one = float(np.spacing(loads.max())) if floats else 1.0
        best = None
        for q in range(w):
            if loads[q] >= loads[p] - one:
                continue
            for i in range(b):
                for j in range(b):
                    dc = v[rows[p, i]] - v[rows[q, j]]
                    dt = tok[rows[p, i]] - tok[rows[q, j]]
                    if (dc >= one and loads[q] + dc <= loads[p] - one
                            and tsum[p] - dt <= cap and tsum[q] + dt <= cap):
                        s = max(loads[p] - dc, loads[q] + dc)
                        if best is None or s < best[0]:
                            best = (s, q, i, j)
        got = _wide_single(v, tok, rows, loads, tsum, cap, p, one)
        # Tokens ascend with cost here: listing only the token window's range gives the same swap.
        assert np.all(np.diff(tok) >= 0)
        assert _wide_single(v, tok, rows, loads, tsum, cap, p, one, ascending=True) == got, trial
        if best is None:
            assert got is None, trial
            continue
        assert got is not None, trial
        s, (gp, gq, (gi,), (gj,)) = got
        assert gp == p and s == best[0], trial
        dc = v[rows[p, gi]] - v[rows[gq, gj]]
        dt = tok[rows[p, gi]] - tok[rows[gq, gj]]
        assert max(loads[p] - dc, loads[gq] + dc) == best[0], trial
        assert tsum[p] - dt <= cap and tsum[gq] + dt <= cap, trial
        found += 1
    assert found >= 20, "most trials have a swap to find"


@pytest.mark.parametrize("repair", [True, False])
@pytest.mark.parametrize("floats", [False, True])
def test_best_move_is_the_best_swap(floats: bool, repair: bool) -> None:
    # _best_move (single and two-for-two swaps between two parts) against
    # every such swap enumerated one by one. Repair: the most tokens moved
    # (up to the excess), then the lowest pair max; a single swap that moves
    # the whole excess ends the search. Polish: the lowest pair max; any
    # single swap ends it. With B <= 8 every candidate fits the search's
    # budget, so it must find that optimum.
    def score(dc: float, dt: float, lp: float, lq: float, clear: float | None) -> float:
        pair = max(lp - dc, lq + dc)
        if clear is None:
            return pair
        return (1.0 - min(dt, clear) / clear) + 1e-6 * pair / max(lp, lq, 1.0)

    rng = np.random.default_rng(11)
    found = 0
    for trial in range(120):
        b = int(rng.integers(2, 9))
        lens = rng.integers(1, 80, 2 * b)
        vals = lens * lens + 16 * lens
        vals = vals / 3.0 if floats else vals
        v, tok = vals.astype(np.float64), lens
        rows = np.arange(2 * b).reshape(2, b)
        loads = v[rows].sum(axis=1)
        if not repair and loads[0] < loads[1]:
            rows, loads = rows[::-1].copy(), loads[::-1].copy()
        lp, lq = float(loads[0]), float(loads[1])
        if repair:  # both loads may rise up to 0-5 % above the max
            allowed = max(lp, lq) * (1 + float(rng.uniform(0, 0.05)))
            win_c, low, room = (lp - allowed, allowed - lq), 1e-9, float(rng.integers(1, 150))
            clear: float | None = float(rng.integers(1, 150))
        else:  # lower the heavier part, within a narrow token window (0-5 each way)
            win_c, low, room = (1.0, lp - lq - 1.0), -float(rng.integers(0, 6)), float(rng.integers(0, 6))
            clear = None

        best = None
        for size in (1, 2):
            if size == 2 and best is not None and (not repair or best < 1e-3):
                break  # a single swap fits (repair: moves the whole excess; its token term is 0)
            for ia in itertools.combinations(range(b), size):
                for jb in itertools.combinations(range(b), size):
                    dc = sum(v[rows[0, i]] for i in ia) - sum(v[rows[1, j]] for j in jb)
                    dt = sum(int(tok[rows[0, i]]) for i in ia) - sum(int(tok[rows[1, j]]) for j in jb)
                    if win_c[0] <= dc <= win_c[1] and low <= dt <= room:
                        s = score(dc, dt, lp, lq, clear)
                        if best is None or s < best:
                            best = s
        got = _best_move(v, tok, rows, 0, 1, win_c, (low, room), loads, clear=clear)
        if best is None:
            assert got is None, trial
            continue
        assert got is not None, trial
        s, (_, _, ia, jb) = got
        assert len(ia) == len(jb) and len(set(ia)) == len(ia) and len(set(jb)) == len(jb), trial
        dc = sum(v[rows[0, i]] for i in ia) - sum(v[rows[1, j]] for j in jb)
        dt = sum(int(tok[rows[0, i]]) for i in ia) - sum(int(tok[rows[1, j]]) for j in jb)
        assert win_c[0] <= dc <= win_c[1] and low <= dt <= room, trial
        assert s == pytest.approx(best, rel=1e-12, abs=1e-15) and score(dc, dt, lp, lq, clear) == pytest.approx(best, rel=1e-12), trial
        found += len(ia) == 2
    assert found >= 15, f"many trials are won by a two-for-two swap: {found}"


def test_range_min_is_the_minimum_of_each_range() -> None:
    # The sparse table behind the two-for-two ranking, against slicing, for one
    # row and for two at once (the polish asks for the least and the most).
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 7, 64, 100, 496):
        x = rng.integers(-50, 50, (2, n)).astype(np.float64)
        lo = rng.integers(0, n + 1, 300)
        hi = lo + rng.integers(-3, n + 1, 300)
        hi = np.clip(hi, 0, n)
        want = [[r[a:b].min() if b > a else np.inf for a, b in zip(lo, hi, strict=True)] for r in x]
        np.testing.assert_array_equal(_range_min(x[:1], lo, hi), want[:1])
        np.testing.assert_array_equal(_range_min(x, lo, hi), want)
    assert _range_min(np.zeros((1, 0)), np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (1, 0)


def test_repair_move_is_the_best_swap_at_b32() -> None:
    # At B = 32 a repair search has more two-for-two candidates in its
    # compute window than it scores (~125,000 on average in the benchmark):
    # it scores those of the pairs of items that can move the most tokens.
    # Against all of them (numpy brute force), on the fullest and the
    # emptiest part of a compute-balanced partition: the search that took
    # candidates in compute order found the optimum on 10 of these 30.
    def brute(v: np.ndarray, tok: np.ndarray, rows: np.ndarray, win_c: tuple[float, float],
              room: float, ld: np.ndarray, clear: float) -> float:
        lp, lq = float(ld[0]), float(ld[1])
        cp, cq = v[rows[0]], v[rows[1]]
        tp, tq = tok[rows[0]].astype(np.float64), tok[rows[1]].astype(np.float64)
        best = np.inf
        for pick in ((np.arange(32), np.zeros(32, np.int64)), np.triu_indices(32, 1)):
            if best < 1e-3:  # a single swap moved the whole excess
                break
            i, k = pick
            two = len(i) > 32
            c_p = cp[i] + cp[k] if two else cp
            t_p = tp[i] + tp[k] if two else tp
            c_q = cq[i] + cq[k] if two else cq
            t_q = tq[i] + tq[k] if two else tq
            dc, dt = c_p[:, None] - c_q[None, :], t_p[:, None] - t_q[None, :]
            ok = (dc >= win_c[0]) & (dc <= win_c[1]) & (dt >= 1e-9) & (dt <= room)
            s = (1.0 - np.minimum(dt, clear) / clear) + 1e-6 * np.maximum(lp - dc, lq + dc) / max(lp, lq)
            best = min(best, float(np.where(ok, s, np.inf).min()))
        return best

    hits = total = 0
    for seed in range(30):
        rng = np.random.default_rng(seed)
        lens = np.minimum(rng.zipf(1.2, 16 * 32), 4096).astype(np.int64)
        vals = (lens * lens + 256 * lens).astype(np.float64)
        parts = np.array(balanced_partition(vals, 16))
        tsum, loads = lens[parts].sum(axis=1), vals[parts].sum(axis=1)
        p, q = int(np.argmax(tsum)), int(np.argmin(tsum))
        rows, ld = parts[[p, q]], loads[[p, q]]
        allowed = float(loads.max()) * (1 + 1e-4)
        win_c = (float(ld[0]) - allowed, allowed - float(ld[1]))
        cap = 1.01 * lens.sum() / 16
        clear, room = max(float(tsum[p] - cap), 1.0), max(float(cap - tsum[q]), 1.0)
        want = brute(vals, lens, rows, win_c, room, ld, clear)
        if want == np.inf:
            continue
        got = _best_move(vals, lens, rows, 0, 1, win_c, (1e-9, room), ld, clear=clear)
        assert got is not None and got[0] >= want * (1 - 1e-12), seed  # never better than the optimum
        total += 1
        hits += got[0] <= want * (1 + 1e-12)
    assert total >= 25 and hits >= total - 2, (hits, total)


def test_token_cap_deadline_keeps_the_cap() -> None:
    # A deadline ends the compute polish but never the repair: the cap holds.
    x, lens = _zipf_tokens(16, 5)
    cap = 1.01 * lens.sum() / 16
    full = balanced_partition(x, 16, tokens=lens, max_tokens=cap)
    rushed = balanced_partition(x, 16, tokens=lens, max_tokens=cap, deadline_ms=1e-6)
    _check_parts(rushed, x.size, 16)
    assert max(int(lens[p].sum()) for p in rushed) <= cap
    assert _max_load(x, full) < _max_load(x, rushed), "the polish ran to its end without a deadline"


@pytest.mark.parametrize(("w", "share"), [(12, None), (12, 4), (96, 4), (96, 1000)])
def test_deal_by_room_is_a_partition_into_equal_parts(w: int, share: int | None) -> None:
    x, lens = _zipf_tokens(w, 3)
    order = np.argsort(x, kind="stable")
    rows = deal_by_room(x[order], lens[order], w, 1.01 * lens.sum() / w, share)
    assert rows.shape == (w, 32)
    assert np.array_equal(np.sort(rows.ravel()), np.arange(x.size))
    assert (np.diff(rows, axis=1) > 0).all(), "rows ascending"


def test_token_cap_at_scale_starts_from_the_chunked_deal() -> None:
    # Above 4,096 items the chunked deal starts (few repair moves); from the
    # compute-first start alone this instance ends 2.8e-3 above the bound,
    # in ~4x the time.
    x, lens = _zipf_tokens(256, 2)
    cap = 1.03 * lens.sum() / 256
    parts = balanced_partition(x, 256, tokens=lens, max_tokens=cap)
    _check_parts(parts, x.size, 256)
    assert max(int(lens[p].sum()) for p in parts) <= cap
    assert _max_load(x, parts) <= lower_bound(x, 256) * (1 + 1e-3)


def test_loose_token_cap_keeps_compute_quality() -> None:
    for seed in range(3):
        x, lens = _zipf_tokens(8, seed)
        plain = balanced_partition(x, 8)
        top = max(int(lens[p].sum()) for p in plain)
        capped = balanced_partition(x, 8, tokens=lens, max_tokens=top)
        assert capped == plain, "a cap the compute-only partition meets changes nothing"
        assert max(int(lens[p].sum()) for p in capped) <= top


def test_a_cap_above_every_total_is_no_cap() -> None:
    # Integer tokens with a cap wider than int64 (2**63, 1e20) raised
    # OverflowError in the numpy comparisons, and in the shuffler every step's
    # planner failed; any cap of at least the total allows every partition.
    x, lens = _zipf_tokens(8, 0)
    plain = balanced_partition(x, 8, tokens=lens, max_tokens=int(lens.sum()))
    for cap in (2**63 - 1, 2**63, 1e19, 1e20, np.uint64(2**64 - 1), float(2**70)):
        assert balanced_partition(x, 8, tokens=lens, max_tokens=cap) == plain, cap  # type: ignore[arg-type]
    assert balanced_partition(x, 8, tokens=lens.astype(float), max_tokens=1e300) == plain


def test_token_cap_with_home_still_holds() -> None:
    x, lens = _zipf_tokens(8, 1)
    home = np.arange(x.size) // 32
    parts = balanced_partition(x, 8, home=home, tokens=lens)
    _check_parts(parts, x.size, 8)
    assert max(int(lens[p].sum()) for p in parts) <= 1.01 * lens.sum() / 8


def test_token_cap_errors() -> None:
    # one item a part, or one part: every partition has the same part tokens; it
    # said "one within the cap may exist that the search missed"
    for x, w, t in (([1, 2], 2, [5, 1]), ([1, 2], 1, [5, 1])):
        with pytest.raises(ValueError, match=r"max_tokens=4 cannot be met: every partition into "):
            balanced_partition(x, w, tokens=t, max_tokens=4)
    x, lens = _zipf_tokens(8, 0)
    floor = lower_bound(lens, 8)
    with pytest.raises(ValueError, match=r"max_tokens=.* cannot be met: every partition into 8 "
                                         r"parts of 32 has a part with >= .* tokens"):
        balanced_partition(x, 8, tokens=lens, max_tokens=floor - 1)
    with pytest.raises(ValueError, match=r"tokens has 10 entries, not divisible by num_parts=8"):
        balanced_partition(x, 8, tokens=np.ones(10))
    with pytest.raises(ValueError, match=r"tokens has 8 entries, expected 256"):
        balanced_partition(x, 8, tokens=np.ones(8))
    with pytest.raises(ValueError, match=r"tokens\[0\] = -1.0, expected >= 0"):
        balanced_partition(x, 8, tokens=np.r_[-1, np.ones(255)])
    # The cap in whole tokens was shown as if passed ("max_tokens=4" for 4.9)
    with pytest.raises(ValueError, match=r"max_tokens=4 cannot be met: .* \(the max_tokens=4.9 passed, in whole "
                                         r"tokens\)$"):
        balanced_partition([1, 2, 3, 4, 5, 6], 2, tokens=[5, 5, 5, 1, 1, 1], max_tokens=4.9)
    # Arguments that were ignored without a word
    with pytest.raises(ValueError, match=r"max_tokens=1 caps the tokens per part; pass tokens"):
        balanced_partition([1, 2, 3, 4], 2, max_tokens=1)
    with pytest.raises(ValueError, match=r"sizes \(bytes per sample\) weigh what localize moves; pass home"):
        balanced_partition([1, 2, 3, 4], 2, sizes=[1, 1, 1, 1])


def test_token_cap_on_tiny_inputs_is_met_whenever_some_partition_meets_it() -> None:
    # The search is a heuristic: on 9 items it missed the only partition within
    # the default cap ("was not met"). Up to 12 items every partition is tried.
    assert balanced_partition([40, 70, 71, 36, 67, 12, 98, 42, 88], 3,
                              tokens=[14, 10, 6, 2, 12, 4, 5, 13, 18]) == [[2, 5, 8], [0, 3, 4], [1, 6, 7]]
    rng = np.random.default_rng(3)
    met = refused = 0
    for _ in range(150):
        w, b = [(3, 3), (2, 4), (4, 2), (3, 2), (2, 3)][int(rng.integers(0, 5))]
        x, t = rng.integers(1, 100, w * b), rng.integers(0, 20, w * b)
        every = list(_equal_partitions(w * b, w))
        best_tokens = min(max(int(t[list(p)].sum()) for p in parts) for parts in every)
        cap = best_tokens + int(rng.integers(0, 3))
        feasible = [parts for parts in every if max(int(t[list(p)].sum()) for p in parts) <= cap]
        try:
            got = balanced_partition(x, w, tokens=t, max_tokens=cap)
        except ValueError:
            refused += 1
            assert not feasible, (x.tolist(), t.tolist(), cap)
            continue
        met += 1
        assert max(int(t[p].sum()) for p in got) <= cap
    assert met == 150 and refused == 0  # cap >= the best partition's: always feasible


def test_token_cap_is_compared_exactly() -> None:
    # Integer caps were rounded to float64: 2**55 + 5 read as 2**55 + 8, so a part
    # of 2**55 + 6 tokens passed, and 2**55 + 1 was refused though it is met.
    t = [2**55 + 6, 0, 0, 0]
    with pytest.raises(ValueError, match="cannot be met"):
        balanced_partition([1, 2, 3, 4], 2, tokens=t, max_tokens=2**55 + 5)
    parts = balanced_partition([1, 2, 3, 4], 2, tokens=[2**55 + 1, 0, 0, 0], max_tokens=2**55 + 1)
    assert sorted(map(sorted, parts)) in ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1, 2]])
    # Float tokens: the proven minimum is lowered as lower_bound's (it once refused
    # this cap as below a "minimum" of 2.5000000000000004), and part sums are the
    # correctly rounded ones.
    c, tf = [35, 18, 0, 26], [0.4, 1.4000000000000001, 1.9000000000000001, 1.1]
    parts = balanced_partition(c, 2, tokens=tf, max_tokens=2.5)
    assert max(math.fsum(tf[i] for i in p) for p in parts) <= 2.5
    c9 = [12, 8, 5, 45, 20, 7, 14, 37, 17]
    t9 = [0.2, 0.2, 0.1, 0.30000000000000004, 0.30000000000000004, 0.2, 0.30000000000000004, 0.30000000000000004, 0.0]
    # once returned a part of 0.7000000000000001; every partition of these 9 items is tried
    with pytest.raises(ValueError, match=r"max_tokens=0.7 cannot be met: no partition into 3 parts of 3 .*all were tried"):
        balanced_partition(c9, 3, tokens=t9, max_tokens=0.7, rtol=0)
    assert min(max(math.fsum(t9[i] for i in p) for p in parts) for parts in _equal_partitions(9, 3)) > 0.7
    for bad in (float("inf"), float("nan"), -1, "5", True):
        with pytest.raises(ValueError, match=r"max_tokens=.*, expected a finite number >= 0"):
            balanced_partition([1, 2, 3, 4], 2, tokens=[1, 1, 1, 1], max_tokens=bad)  # type: ignore[arg-type]
    for bad_rtol in (float("inf"), float("nan"), -1e-3):
        with pytest.raises(ValueError, match=r"rtol=.*, expected a finite number >= 0"):
            balanced_partition([1, 2, 3, 4], 2, rtol=bad_rtol)  # inf once raised an OverflowError
