"""Equal-count partitioning of per-sample workloads across data-parallel ranks.

Each step the shuffler has ``N = W * B`` workloads (``W`` ranks, ``B`` samples
per rank) and needs ``W`` parts of exactly ``B`` samples each with the largest
part sum as small as possible; then samples move between ranks.

Pipeline of :func:`balanced_partition` (``x`` = workloads; the steps live in
``_partition_solve``):

1. sort ``x`` once (tie-free keys ``x << log2 N | index``, one plain sort), and
   compute :func:`lower_bound` from the same prefix sums;
2. a greedy start with a cardinality cap. Up to N = 8192: LPT (largest
   item to the lightest part that still has room), with equal-size
   Karmarkar-Karp tried too when LPT misses the target (KK starts ~10x closer
   on smooth inputs). Larger inputs: the projected-load greedy
   (``_partition_fill``: serve the part with the smallest ``load + free slots
   * mean remaining item``, so parts with many empty slots take the small
   items), dealt a row or more at a time -- within ~1e-4 of the bound at
   N = 262,144 in ~32-70 numpy steps, where LPT is up to 2.3e-3 above it;
3. swap refinement to ``lower_bound * (1 + rtol)`` under a work budget that
   depends on ``N`` and ``W`` only: parallel rounds in which every part above
   the target trades one item with a light (or another heavy) part, single
   best swaps for the heaviest part, then (few parts) two-for-two swaps. No
   swap raises the max, so stopping early (budget, ``deadline_ms``) is safe;
4. optionally (``tokens``) a hard per-part cap on a second quantity
   (``_partition_tokens``), and (``home``) :func:`localize`: choose which part
   each rank gets, and trade items so that samples stay on their home rank
   without raising the max.

Threads and the GIL: the shuffler runs this in a background thread while the
main thread launches GPU work. Numpy releases the GIL inside sorts, searches,
``argmin`` and element-wise calls on > 500 elements; a thread that wants it
back waits up to ``sys.getswitchinterval()`` (5 ms). With libtorch loaded the
main thread wins nearly every such hand-off, so when it is busy in pure Python
each of those calls costs the partition ~5 ms (2 ms becomes ~50 ms at
64x128); when it is busy with torch ops (which release the GIL at dispatch)
the partition runs at ~2x its standalone time and the main thread loses
~5-8 % of a 50 ms step. Pure Python would avoid the waits but hold the GIL
throughout. The way out is :class:`PartitionWorker`: the same partition in a
child process (numpy only); ``submit`` on the main thread and ``wait`` later
costs the main thread < 1 % and the partition ~1.3x its standalone time under
both kinds of main thread. Within this module the numpy work is kept to few,
large calls (one sort, ~25 calls per start step or refinement round). Numbers:
``docs/benchmarks_partition.md``.

All functions are deterministic: the same input gives the same output on every
rank and process (stable sorts or tie-free keys everywhere).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from balancer._limits import MAX_TOTAL
from balancer._partition_bound import bound_sorted
from balancer._partition_free import free_assign, labels_to_lists
from balancer._partition_kk import kk_equal, kk_free
from balancer._partition_locality import assign_parts, localize_rows
from balancer._partition_refine import sort_order
from balancer._partition_solve import solve
from balancer._partition_tokens import apply_token_cap, check_tokens_met, token_cap
from balancer._partition_worker import PartitionWorker

logger = logging.getLogger(__name__)

__all__ = [
    "PartitionStats",
    "PartitionWorker",
    "balanced_partition",
    "free_partition",
    "imbalance",
    "karmarkar_karp",
    "localize",
    "lower_bound",
    "partition_stats",
]

def _check_num_parts(num_parts: int) -> None:
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)):
        raise TypeError(f"num_parts={num_parts!r}, expected an int")
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts}, expected >= 1")


def _as_workloads(workloads: Any, num_parts: int, name: str = "workloads") -> np.ndarray:
    """Validate and convert to int64 (integer input) or float64 (float input)."""
    _check_num_parts(num_parts)
    arr = np.asarray(workloads)
    if arr.ndim != 1:
        raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected 1-D [N]")
    n = arr.size
    if n % num_parts:
        raise ValueError(f"{name} has {n} entries, not divisible by num_parts={num_parts}")
    kind = arr.dtype.kind
    if kind in "biu":
        if kind == "u" and n and int(arr.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"{name} max {int(arr.max())} does not fit in int64")
        x = arr.astype(np.int64, copy=False)
    elif kind == "f":
        x = arr.astype(np.float64, copy=False)
        if n and not np.isfinite(x).all():
            i = int(np.flatnonzero(~np.isfinite(x))[0])
            raise ValueError(f"{name}[{i}] = {x[i]}, expected a finite value")
    else:
        raise ValueError(f"{name} has dtype {arr.dtype}, expected integers or floats")
    if n and x.min() < 0:
        i = int(np.argmin(x))
        raise ValueError(f"{name}[{i}] = {x[i]}, expected >= 0")
    if n and float(x.sum(dtype=np.float64)) >= MAX_TOTAL:
        raise ValueError(f"{name} sum to {float(x.sum(dtype=np.float64)):.3g}, expected < 2**61")
    return x


def lower_bound(workloads: Any, num_parts: int) -> float:
    """Cardinality-aware lower bound on the max part load.

    Every part holds exactly ``B = N / W`` items. With ``v`` the workloads
    sorted descending and ``S(j)`` the sum of the ``j`` smallest:

    * mean: the parts share the total, so some part has ``>= sum / W``;
    * pigeonhole: of the ``k`` largest items some part holds ``c = ceil(k/W)``;
      the sum of any ``c`` of them is at least the sum of the ``c`` smallest of
      the ``k``, and its other ``B - c`` items (distinct from those) sum to at
      least ``S(B - c)``. ``k = 1`` gives ``max item + S(B - 1)``;
    * grouped: let the ``k`` largest items (``k < W``) lie in ``m`` distinct
      parts, ``ceil(k/B) <= m <= k``. Those parts hold ``mB`` items, the ``k``
      plus ``mB - k`` others, so their total is ``>= top_k + S(mB - k)`` and
      one of them carries the average. Minimising over ``m`` covers every
      partition. This is tight when a few huge items each need a part topped
      up with the smallest fillers (e.g. 362 clipped samples among 8192 parts).

    The bound is the maximum over all terms, the grouped term for every
    ``k < W`` (the minimum over ``m`` by binary search: the average is
    unimodal in ``m``). For integers it is exact (ceil of the averages,
    rounded down to a float); for floats it is reduced by ``4 N eps`` to
    absorb rounding.

    Args:
        workloads: [N] non-negative workloads (list, ndarray or CPU tensor).
        num_parts: W.

    Returns:
        A value no partition into parts of exactly ``N / W`` items can beat.

    Raises:
        ValueError: see :func:`balanced_partition`.
    """
    x = _as_workloads(workloads, num_parts)
    return _as_float(bound_sorted(np.sort(x), num_parts), x.size)


def _as_float(bound: int | float, n: int) -> float:
    if isinstance(bound, int):
        f = float(bound)
        return f if int(f) <= bound else math.nextafter(f, -math.inf)
    return bound * (1.0 - 4.0 * n * np.finfo(np.float64).eps)


def _to_lists(order: np.ndarray, rows: np.ndarray) -> list[list[int]]:
    out: list[list[int]] = np.sort(order[rows], axis=1).tolist()
    return out


def karmarkar_karp(workloads: Any, num_parts: int, equal_size: bool = True) -> list[list[int]]:
    """Largest differencing method (Karmarkar-Karp) into ``num_parts`` parts.

    Drop-in for the function of the same name in NVIDIA recsys-examples and
    verl: same arguments, same result type, the same partitions up to ties.
    ``equal_size=True`` (rows of ``W`` sorted items as initial states) gives
    every part exactly ``N / W`` items; ``equal_size=False`` is plain KK
    (``O(N)`` heap merges, compatibility only). :func:`balanced_partition` is
    better on every benchmark input; see ``docs/benchmarks_partition.md``.

    Args:
        workloads: [N] non-negative workloads (list, ndarray or CPU tensor).
        num_parts: W.
        equal_size: require exactly ``N / W`` items per part.

    Returns:
        ``W`` lists of sample indices (each ascending).

    Raises:
        ValueError: see :func:`balanced_partition` (N must be divisible by
            ``num_parts`` only when ``equal_size``).
    """
    _check_num_parts(num_parts)
    x = _as_workloads(workloads, num_parts if equal_size else 1)
    order = sort_order(x)
    v = x[order]
    if not equal_size:
        free = kk_free(v, num_parts)
        return [np.sort(order[free == j]).tolist() for j in range(num_parts)]
    part = kk_equal(v, num_parts)
    assert part is not None, "kk_equal only gives up when asked to"
    return _to_lists(order, np.argsort(part, kind="stable").reshape(num_parts, -1))


def balanced_partition(workloads: Any, num_parts: int, home: Any = None, sizes: Any = None, *,
                       rtol: float = 1e-5, deadline_ms: float | None = None, tokens: Any = None,
                       max_tokens: float | None = None) -> list[list[int]]:
    """The library's partitioner: a cardinality-aware greedy start, then swap refinement.

    Example: workloads ``[9, 1, 8, 2, 7, 3]`` into 2 parts of 3 gives
    ``[[0, 3, 5], [1, 2, 4]]`` with loads 14 and 16 (contiguous chunks: 18
    and 12). 16 is optimal: one part holds two of the three largest (9, 8, 7),
    so at least ``8 + 7`` plus the smallest item ``1`` -- the pigeonhole term
    of :func:`lower_bound`.

    The work done is a deterministic function of ``(workloads, num_parts)``:
    refinement stops at ``rtol`` or when a budget of swap steps derived from
    ``N`` and ``W`` is spent, so every rank computes the same partition.

    Args:
        workloads: [N] non-negative workloads (int or float; list, ndarray or
            CPU tensor), ``N = num_parts * B``.
        num_parts: W, the number of parts (ranks).
        home: optional [N] rank each sample lives on; when given the result is
            passed through :func:`localize` (part ``r`` goes to rank ``r``).
        sizes: optional [N] bytes per sample for :func:`localize`.
        rtol: stop refining once the max load is within ``rtol`` of
            :func:`lower_bound` (0 refines until no swap helps or the budget
            is spent).
        deadline_ms: optional safety net: stop refining after this many
            milliseconds and return the best partition so far (the greedy
            start always completes, and no swap raises the max). Ranks running
            at different speeds can then stop at different swaps and return
            *different* partitions, which breaks the shuffler's assumption that
            every rank computes the same one; leave it ``None`` there.
        tokens: optional [N] second per-sample quantity with a hard per-part
            cap, e.g. tokens (activation memory) while ``workloads`` is
            compute. Every part ends with at most ``max_tokens`` of it; the
            max compute load stays within ``rtol`` of :func:`lower_bound`
            whenever the cap leaves room (see ``docs/benchmarks_partition.md``).
        max_tokens: the cap on ``tokens`` per part; default
            ``1.01 * sum(tokens) / num_parts``.

    Returns:
        ``W`` lists of exactly ``B`` sample indices each (each ascending);
        every index appears once.

    Raises:
        TypeError: ``num_parts`` is not an int.
        ValueError: ``num_parts < 1``; ``workloads`` not 1-D, its length not
            divisible by ``num_parts``, negative, NaN/inf, non-numeric, or
            summing to 2**61 or more; ``rtol < 0``; ``deadline_ms <= 0``;
            ``tokens`` malformed (as ``workloads``); ``max_tokens`` below what
            any partition can meet (the message names the cap, the proven
            minimum and the best cap found).
    """
    out: list[list[int]] = _localized_rows(workloads, num_parts, home, sizes, rtol=rtol, deadline_ms=deadline_ms,
                                           tokens=tokens, max_tokens=max_tokens).tolist()
    return out


def _localized_rows(workloads: Any, num_parts: int, home: Any = None, sizes: Any = None, *, rtol: float = 1e-5,
                    deadline_ms: float | None = None, tokens: Any = None,
                    max_tokens: float | None = None) -> np.ndarray:
    """:func:`balanced_partition` as an int64 array ``[W, B]`` (the planner keeps arrays)."""
    rows = _partition_rows(workloads, num_parts, rtol=rtol, deadline_ms=deadline_ms,
                           tokens=tokens, max_tokens=max_tokens)
    if home is not None:
        x = _as_workloads(workloads, num_parts)
        h, s = _check_home(home, sizes, x.size, num_parts)
        local = localize_rows(x, rows, h, s)
        if tokens is not None:
            # localize trades items by compute alone; keep its result only if
            # the token cap still holds, else just assign whole parts to ranks.
            t = _as_workloads(tokens, num_parts, "tokens")
            if t[local].sum(axis=1).max() > token_cap(t, num_parts, max_tokens):
                local = rows[np.argsort(assign_parts(rows, h, s), kind="stable")]
        rows = local
    return rows


def _partition_rows(workloads: Any, num_parts: int, *, rtol: float = 1e-5,
                    deadline_ms: float | None = None, tokens: Any = None,
                    max_tokens: float | None = None) -> np.ndarray:
    """:func:`balanced_partition` without ``home``, as an int64 array [W, B] (rows ascending).

    Building ``W`` Python lists costs ~10 ms at N = 262,144 (more than the
    partition itself); callers that want an array (the partition child) can
    skip it here.
    """
    x = _as_workloads(workloads, num_parts)
    if not rtol >= 0:
        raise ValueError(f"rtol={rtol}, expected >= 0")
    if deadline_ms is not None and not deadline_ms > 0:
        raise ValueError(f"deadline_ms={deadline_ms}, expected > 0 or None")
    start = time.perf_counter()
    n, w = x.size, num_parts
    b = n // w
    t = None if tokens is None else _as_workloads(tokens, num_parts, "tokens")
    if t is not None and t.size != n:
        raise ValueError(f"tokens has {t.size} entries, expected {n} (one per workload)")
    if b <= 1 or w == 1:
        rows = np.arange(n, dtype=np.int64).reshape(w, b)
        if t is not None:
            check_tokens_met(t, rows, token_cap(t, w, max_tokens), w, None)
        return rows
    stop_at = None if deadline_ms is None else start + deadline_ms / 1e3
    sol = solve(x, w, rtol, stop_at)
    if t is not None:
        sol.rows = apply_token_cap(sol, t, w, rtol, max_tokens)
    rows = np.sort(sol.order[sol.rows], axis=1)
    return rows


def localize(parts: Sequence[Sequence[int]], workloads: Any, home: Any,
             sizes: Any = None) -> list[list[int]]:
    """Re-order (and lightly re-shape) parts so that samples stay on their home rank.

    ``result[r]`` is what rank ``r`` receives. Two steps, neither of which
    raises the max part load or changes any part's item count:

    1. assign parts to ranks maximising the ``sizes`` that stay home (a
       ``W x W`` assignment: greedy by largest overlap, then pairwise
       exchanges while they help);
    2. trade items between ranks so more stay home: items of equal workload
       are interchangeable, and a re-balance started from the home placement
       itself (swap refinement to the same max load) often keeps most samples
       where they are; the better of the two is returned.

    Example: rank 0 holds samples 0, 1 and rank 1 holds 2, 3 (``home =
    [0, 0, 1, 1]``); parts ``[[2, 3], [0, 1]]`` come back as ``[[0, 1], [2, 3]]``
    and nothing moves.

    Args:
        parts: ``W`` sequences of exactly ``B`` indices, a permutation of
            ``range(N)``.
        workloads: [N] workloads (as for :func:`balanced_partition`).
        home: [N] int rank in ``[0, W)`` that sample ``i`` lives on.
        sizes: optional [N] non-negative bytes per sample (default 1 each).

    Returns:
        ``W`` lists of sample indices (each ascending), ``result[r]`` for rank ``r``.

    Raises:
        ValueError: malformed ``parts``, ``home`` or ``sizes``.
    """
    w = len(parts)
    x = _as_workloads(workloads, max(w, 1))
    n = x.size
    rows = np.asarray(parts, dtype=np.int64).reshape(w, -1) if w else np.zeros((0, 0), np.int64)
    if rows.size != n or not np.array_equal(np.sort(rows.ravel()), np.arange(n)):
        raise ValueError(f"parts must be {w} lists of {n // max(w, 1)} indices forming a "
                         f"permutation of range({n})")
    h, s = _check_home(home, sizes, n, w)
    out: list[list[int]] = localize_rows(x, rows, h, s).tolist()
    return out


def _check_home(home: Any, sizes: Any, n: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """``home`` as int64 [N] in ``[0, W)`` and ``sizes`` as float64 [N] (default ones)."""
    h = np.asarray(home)
    if h.shape != (n,) or h.dtype.kind not in "iu" or (n and (h.min() < 0 or h.max() >= w)):
        raise ValueError(f"home has shape {h.shape} and dtype {h.dtype}, expected [{n}] ints in [0, {w})")
    if sizes is None:
        s = np.ones(n, np.float64)
    else:
        s = np.asarray(sizes, dtype=np.float64)
        if s.shape != (n,) or not np.isfinite(s).all() or (n and s.min() < 0):
            raise ValueError(f"sizes has shape {s.shape}, expected [{n}] finite values >= 0")
    return h.astype(np.int64), s


@dataclasses.dataclass(frozen=True, eq=False)
class PartitionStats:
    """Balance of one partition. ``loads`` is [W]; the rest are scalars."""

    loads: np.ndarray
    """Sum of workloads per part."""
    max_load: float
    """Largest part load: the step time of the slowest rank."""
    mean_load: float
    """Average part load (``sum / W``): the ideal."""
    max_over_mean: float
    """``max_load / mean_load`` (1.0 is perfect balance; 1.0 when all zero)."""
    bound: float
    """:func:`lower_bound` for the same workloads and ``W``."""
    max_over_bound: float
    """``max_load / bound``: 1.0 means provably optimal."""

    def speedup_over(self, before: PartitionStats) -> float:
        """How much faster the slowest rank gets: ``before.max_load / self.max_load``."""
        return before.max_load / self.max_load if self.max_load > 0 else 1.0


def partition_stats(workloads: Any, parts: Sequence[Sequence[int]]) -> PartitionStats:
    """Loads and balance ratios of ``parts`` (indices into ``workloads``).

    Args:
        workloads: [N] workloads.
        parts: ``W`` sequences of indices covering ``range(N)``, equal sizes.

    Returns:
        A :class:`PartitionStats`.
    """
    w = len(parts)
    x = _as_workloads(workloads, max(w, 1))
    loads = np.array([x[np.asarray(p, dtype=np.int64)].sum() for p in parts], dtype=x.dtype)
    bound = lower_bound(x, max(w, 1))
    top = float(loads.max()) if w else 0.0
    mean = float(x.sum()) / max(w, 1)
    return PartitionStats(loads, top, mean, top / mean if mean > 0 else 1.0, bound,
                          top / bound if bound > 0 else 1.0)


def imbalance(workloads: Any, num_parts: int) -> PartitionStats:
    """Stats of "no balancing": contiguous chunks, rank ``r`` keeps ``[rB, (r+1)B)``."""
    x = _as_workloads(workloads, num_parts)
    return partition_stats(x, np.arange(x.size).reshape(num_parts, -1).tolist())


def free_partition(workloads: Any, num_parts: int, *, min_size: int = 0,
                   max_size: int | None = None) -> list[list[int]]:
    """``num_parts`` parts of free (or bounded) item counts with the smallest max sum.

    Example: ``[9, 1, 8, 2, 7, 3]`` into 2 parts gives ``[[0, 1, 3, 5], [2, 4]]``,
    loads 15 and 15 (optimal); equal counts cannot beat 16. Algorithm and
    bound: ``balancer/_partition_free.py``.

    Args:
        workloads: [N] non-negative workloads (as for :func:`balanced_partition`;
            N need not be divisible by ``num_parts``).
        num_parts: W.
        min_size, max_size: items per part (``None``: unbounded).

    Returns:
        ``W`` ascending index lists covering ``range(N)``; deterministic.

    Raises:
        TypeError, ValueError: as :func:`balanced_partition`; bounds that are
            not ints, negative, crossed, or that ``N`` items cannot meet.
    """
    _check_num_parts(num_parts)
    labels = free_assign(_as_workloads(workloads, 1), num_parts, min_size, max_size)
    assert labels is not None, "without a cap the greedy always places every item"
    return labels_to_lists(labels, num_parts)
