"""The lower bound on the max part load: one function for equal and free part sizes.

:func:`bound_sorted` works on workloads sorted ascending and their prefix sums
``S`` (``S[j]`` = sum of the ``j`` smallest). Every part holds at least ``a``
items: ``a = B = N / W`` for equal sizes (:func:`balanced_partition`), and
``a = max(min_size, N - (W - 1) max_size)`` for free sizes
(:func:`free_partition`, ``plan_dispatch``, micro-batches). The bound is the
maximum of:

* mean and max item: the parts share the total; some part holds the largest;
* pigeonhole: of the ``k`` largest some part holds ``c = ceil(k / W)``, at
  least the ``c`` smallest of them, plus ``a - c`` other items, at least
  ``S(a - c)``;
* grouped (equal sizes only): the ``k < W`` largest lie in at most ``k``
  parts. Any ``k`` parts that hold them all hold ``kB`` items, the ``k`` and
  ``k (B - 1)`` others, at least ``top_k + S(k(B - 1))``, and one of them
  carries the average ``g_k = (top_k + S(k(B - 1))) / k``, for every ``k``;
* crowded (equal sizes only, :mod:`balancer.partition._crowded`): when the
  largest tie blocks (truncated lengths) force parts to hold ``c`` of their
  items each, fillers too big to join them must fit in the other parts, and
  those crowded parts carry at least their own average.

Until the fourteenth pass of issue 14 the grouped term was the minimum over
the number ``m`` of parts the ``k`` largest occupy (``ceil(k / B) <= m <=
k``) of their average ``g_k(m) = (top_k + S(mB - k)) / m``, found by a
binary search. Beside the mean term that is the same bound: ``g_k(m)`` is
unimodal in ``m`` (going to ``m + 1`` parts adds the next ``B`` fillers,
``chunk(m) = S((m+1)B - k) - S(mB - k)``; ``g_k`` falls while ``chunk(m) <
g_k(m)``, and once ``chunk(m) >= g_k(m)`` it stays so, since ``g_k(m + 1)``
lies between the two and chunks grow with ``m``). Where its minimum lies
below ``m = k``, ``g_k`` rises from there to ``g_k(W)``, the mean, so
``g_k(k)`` is below the mean too; otherwise the minimum is ``g_k(k)``.

The grouped term holds for free sizes too (with ``a`` in place of ``B``; it
adds nothing when ``a <= 1``), but the free-size refinement targets were
measured without it, so it is used for equal sizes only.

The micro-batch planner adds a bound of its own for a token budget
(``balancer.microbatch._capped_bound``): it counts tokens rather than items
and fills with the cheapest cost per token, a different quantity.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from balancer.partition._crowded import crowded_bound
from balancer.partition._validate import as_workloads, check_num_parts, check_sizes

__all__ = ["as_float", "bound_ordered", "bound_sorted", "lower_bound", "prefix_sums"]


def lower_bound(workloads: Any, num_parts: int, *, equal_size: bool = True, min_size: int = 0,
                max_size: int | None = None) -> float:
    """Lower bound on the max part load: no partition into ``num_parts`` parts beats it.

    Equal sizes (default), every part exactly ``B = N / W`` items, as in
    :func:`balanced_partition`. With ``v`` the workloads sorted descending and
    ``S(j)`` the sum of the ``j`` smallest:

    * mean: the parts share the total, so some part has ``>= sum / W``;
    * pigeonhole: of the ``k`` largest items some part holds ``c = ceil(k/W)``;
      the sum of any ``c`` of them is at least the sum of the ``c`` smallest of
      the ``k``, and its other ``B - c`` items (distinct from those) sum to at
      least ``S(B - c)``. ``k = 1`` gives ``max item + S(B - 1)``;
    * grouped: the ``k`` largest items (``k < W``) lie in at most ``k``
      parts. Any ``k`` parts that hold them all hold ``kB`` items, the ``k``
      plus ``k (B - 1)`` others, so their total is ``>= top_k + S(k(B - 1))``
      and one of them carries the average. This is tight when a few huge
      items each need a part topped up with the smallest fillers (e.g. 362
      clipped samples among 8192 parts);
    * crowded: with ``K`` the largest tie block and ``c = ceil(K/W)``, at least
      ``K - (c-1)W`` parts hold ``c`` of those items; a filler too big to sit
      beside ``c`` of them must go to the other parts, and when those cannot
      hold all such fillers below a load ``T``, no partition stays below ``T``
      (:mod:`balancer.partition._crowded`). Also, the ``K - (c-1)W`` parts
      holding the most of the ``K`` hold at least ``c`` each on average, and
      ``B - c`` other items each: one of them carries their average.

    The bound is the maximum over all terms, the grouped term for every
    ``k < W``. For integers it is exact (ceil of the averages,
    rounded down to a float); for floats it is reduced by ``4 N eps`` to
    absorb rounding.

    ``equal_size=False``: parts of ``min_size`` to ``max_size`` items (``None``:
    unbounded), as in :func:`free_partition`; ``N`` need not be divisible by
    ``num_parts``. Mean, largest item and the pigeonhole term with parts of at
    least ``max(min_size, N - (W - 1) max_size)`` items.

    Args:
        workloads: [N] non-negative workloads (list, ndarray or CPU tensor).
        num_parts: W.
        equal_size: parts of exactly ``N / W`` items; ``False``: free sizes.
        min_size, max_size: items per part, with ``equal_size=False`` only.

    Returns:
        A value no partition with those part sizes can beat.

    Raises:
        ValueError: see :func:`balanced_partition`; with ``equal_size=False``
            see :func:`free_partition`; ``min_size`` or ``max_size`` given
            with ``equal_size=True``.
    """
    if equal_size:
        if min_size or max_size is not None:
            raise ValueError(f"min_size={min_size!r}, max_size={max_size!r}: item-count bounds "
                             "apply to free sizes (equal_size=False) only")
        x = as_workloads(workloads, num_parts)
        return as_float(bound_sorted(np.sort(x), num_parts), x.size)
    check_num_parts(num_parts)
    x = as_workloads(workloads, 1)
    lo, hi = check_sizes(x.size, num_parts, min_size, max_size)
    bound = bound_sorted(np.sort(x), num_parts, equal_size=False, min_size=lo,
                         max_size=None if max_size is None else hi)
    return as_float(bound, x.size)


def bound_ordered(workloads: Any, num_parts: int, order: np.ndarray | None) -> float:
    """:func:`lower_bound` (equal sizes), sorting ``workloads[order]`` instead of ``workloads``.

    ``order`` is an order that sorts the workloads or nearly does (the
    partition's sorted order of the same or of monotonically quantized
    workloads; ``None``: none known). A stable sort of the reordered values
    gives the same ascending array as sorting the workloads, and on nearly
    sorted input it costs a pass or two: at N = 262,144 float workloads on the
    CI box, 0.8-1.5 ms against 11 ms (the shuffler's partition child computes
    this bound every step).
    """
    x = as_workloads(workloads, num_parts)
    v = np.sort(x) if order is None else np.sort(x[order], kind="stable")
    return as_float(bound_sorted(v, num_parts), x.size)


def as_float(bound: int | float, n: int) -> float:
    """A float no larger than ``bound`` (an exact int rounded down; a float
    lowered by ``4 n eps`` to absorb the rounding of ``n``-term sums)."""
    if isinstance(bound, int):
        f = float(bound)
        return f if int(f) <= bound else math.nextafter(f, -math.inf)
    return bound * (1.0 - 4.0 * n * np.finfo(np.float64).eps)


def prefix_sums(v: np.ndarray) -> np.ndarray:
    """[N + 1] prefix sums of ``v`` in its own dtype (exact for int64)."""
    prefix = np.zeros(v.size + 1, v.dtype)
    np.cumsum(v, out=prefix[1:])
    return prefix


def bound_sorted(v: np.ndarray, num_parts: int, *, equal_size: bool = True, min_size: int = 0,
                 max_size: int | None = None, prefix: np.ndarray | None = None) -> int | float:
    """:func:`lower_bound` on ascending ``v`` (an exact int for int64 input, else a float).

    Args:
        v: [N] workloads sorted ascending (N divisible by ``num_parts`` with
            ``equal_size``).
        num_parts: W.
        equal_size: parts of exactly ``N / W`` items; ``False``: free sizes
            within ``[min_size, max_size]`` (validated; ``None``: unbounded).
        min_size, max_size: items per part, with ``equal_size=False``.
        prefix: optional :func:`prefix_sums` of ``v`` (computed if omitted).
    """
    n, w = v.size, int(num_parts)  # (a numpy integer W would turn the exact int bound into a float)
    if n == 0:
        return 0
    is_int = v.dtype.kind == "i"
    if prefix is None:
        prefix = prefix_sums(v)
    total = prefix[n]
    best = max(-(-int(total) // w) if is_int else float(total) / w, v[n - 1].item())
    if equal_size:
        b = n // w
        least = b  # items every part holds at least
    else:
        least = max(min_size, n - (w - 1) * (n if max_size is None else max_size), 0)
    # Pigeonhole: some part holds c = ceil(k/W) of the k largest. Within a block
    # of equal c the bound grows as k shrinks, so k = (c-1)W + 1 suffices.
    c = np.arange(1, -(-n // w) + 1)
    k = (c - 1) * w + 1
    pig = prefix[n - k + c] - prefix[n - k] + prefix[np.maximum(least - c, 0)]
    best = max(best, pig.max().item())
    if not equal_size or w < 2:
        return best
    # Grouped, for every k < W: the k largest and k (B - 1) smallest others
    # over k parts.
    k = np.arange(1, w, dtype=np.int64)
    num = total - prefix[n - k] + prefix[k * (b - 1)]
    f = -(-num // k) if is_int else num / k
    return crowded_bound(v, prefix, w, max(best, f.max().item()))
