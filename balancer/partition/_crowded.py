"""The crowded-parts term of the equal-size lower bound: fillers too big to sit next to ``c`` big items.

Truncated lengths put many samples at the same, largest cost (every sequence
cut at ``max_seq_len``). Take the ``K`` largest items ("big", the top tie
block) and ``c = ceil(K / W)``; suppose every part stays at or below ``T``:

1. no part holds ``c + 1`` big items when ``(c + 1) v_K + S(B - c - 1) > T``
   (``v_K`` the smallest big item, ``S(j)`` the sum of the ``j`` smallest
   items), so at least ``a = K - (c - 1) W`` parts hold exactly ``c`` of them:
   the *crowded* parts;
2. a crowded part's fillers sum to at most ``T - c v_K``, so none of them
   exceeds ``cap = T - c v_K - S(B - c - 1)``: every non-big item above
   ``cap`` (the *forced* items) lies in one of the other ``W - a'`` parts
   (``a' >= a`` crowded parts);
3. those parts hold the forced items, the ``K - c a'`` big items the crowded
   ones left, and other items in their remaining slots, so together at least
   ``sum(forced) + (the K - c a' smallest big) + S(slots)``. When that exceeds
   ``(W - a') T`` for every ``a'``, no partition stays below ``T``.

Going from ``a'`` to ``a' + 1`` crowded parts lowers the left side by ``c``
big items and ``B - c`` fillers, at most ``c v_max + (B - c) v[slots - 1]``,
and the right side by ``T``; when that is at most ``T`` the test at ``a' = a``
decides every ``a'`` (otherwise the term claims nothing). The test is
monotone in ``T``, so a bisection finds the largest ``T`` it refutes.

Measured on Zipf lengths clipped at 4096 (cost ``L^2 + 256 L``; 17 % of the
samples at the clip), 16384 x 16: the term is 1.4e-3 to 3.4e-3 above the mean
and pigeonhole terms (seeds 0-2), where ``K`` is the clipped block. It is
tried for the few largest tie blocks only; each costs one scalar test unless
it raises the bound.

The crowded parts also bound the max by their own average
(:func:`crowded_average`). Order the parts by how many big items they hold:
the first ``a`` hold at least ``c a`` of them (if one of the other ``W - a``
holds ``c`` or more, so does each of the first ``a``; otherwise the others
hold at most ``(c - 1)(W - a) = K - c a``). Those ``a`` parts then hold
``c a`` big items, at least the ``c a`` smallest, and ``a (B - c)`` other
items, at least the ``a (B - c)`` smallest (any that many distinct items
weigh that much), so one of them carries at least the average. This term
needs no cap and no bisection. With ``K < W`` (``c = 1``, ``a = K``) it is
the grouped term of :mod:`balancer.partition._bound`, which takes it for
every ``K < W``; here it runs for the top tie blocks, whatever their size.
It is what is left above the other terms on Zipf at small shapes, where the
crowded parts need more fillers than the ``B - c`` smallest that the
pigeonhole term gives each. Over 16 seeds of ``bench_partition`` it raises
the bound on 7 at 16x16 (2.0e-5 to 3.3e-4), 9 at 128x8, 7 at 64x16 and all
16 at 2048x8, and the partitions there end within 2.2e-5 of it
(``docs/benchmarks_partition.md``, "The crowded parts' own average").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

__all__ = ["Crowding", "crowded_average", "crowded_bound", "crowding"]

_BLOCKS = 4  # tie blocks from the top tried as the big items


class Crowding(NamedTuple):
    """How the ``K`` largest items crowd the parts under a cap ``T`` on every part
    (steps 1 and 2 of the module docstring)."""

    c: int  # ceil(K / W): the crowded parts hold this many big items, the others c - 1
    a: int  # the crowded parts, K - (c - 1) W
    keep: int  # the non-big items at or below ``cap`` (the first ``keep``); the rest are forced


def crowding(v: np.ndarray, num_parts: int, k: int, t: int | float,
             smallest: Callable[[int], int | float]) -> Crowding | None:
    """:class:`Crowding` of the ``k`` largest items of ascending ``v`` under ``t``, or
    ``None`` where they do not crowd the parts: ``c >= B``, or ``c + 1`` of them fit in
    one part with the ``B - c - 1`` smallest items.

    ``smallest(j)`` is the sum of the ``j`` smallest items (prefix sums). The
    bound, the crowded start and the benchmark's class split share this
    arithmetic; the bound calls it with Python scalars inside a bisection on ``t``.
    """
    n = v.size
    b = n // num_parts
    c = -(-k // num_parts)
    if c >= b:
        return None
    low = v[n - k].item()
    fill = smallest(b - c - 1)
    if (c + 1) * low + fill <= t:
        return None
    cap = t - c * low - fill
    return Crowding(c, k - (c - 1) * num_parts, int(np.searchsorted(v[: n - k], cap, side="right")))


def crowded_average(n: int, num_parts: int, k: int, smallest: Callable[[int], int | float],
                    is_int: bool) -> int | float:
    """The crowded parts' own average for the ``k`` largest of ``n`` items (module
    docstring): no partition into ``num_parts`` equal parts has a max load below it.

    ``smallest(j)`` is the sum of the ``j`` smallest items; exact (an int) for
    integer sums.
    """
    w = num_parts
    b = n // w
    c = -(-k // w)
    a = k - (c - 1) * w
    # The a parts holding the most of the k largest hold at least c a of them
    # (at least the c a smallest) and a (B - c) other items.
    num = smallest(n - k + c * a) - smallest(n - k) + smallest(a * (b - c))
    return -(-num // a) if is_int else num / a


def crowded_bound(v: np.ndarray, prefix: np.ndarray, num_parts: int, best: int | float) -> int | float:
    """The crowded-parts bound on ascending ``v`` if it beats ``best``, else ``best``.

    Args:
        v: [N] workloads sorted ascending (int64 or float64), ``N = W * B``.
        prefix: :func:`~balancer.partition._bound.prefix_sums` of ``v``.
        num_parts: W.
        best: a lower bound already proven (an exact int for int64 input).

    Returns:
        An int for int64 input (no partition has a max load below it), a float
        otherwise (lowered by the rounding margin of ``N``-term sums).
    """
    n, w = v.size, num_parts
    b = n // w
    if w < 2 or b < 2:
        return best
    is_int = v.dtype.kind == "i"
    s = prefix.tolist() if n <= 64 else None  # tiny inputs: Python scalars are cheaper
    vmax = v[n - 1].item()
    total = prefix[n].item()
    margin = 0 if is_int else 8.0 * n * float(np.finfo(np.float64).eps) * total

    def S(j: int) -> int | float:
        return s[j] if s is not None else prefix[j].item()

    def refuted(t: int | float, k: int) -> bool:
        """Whether no partition keeps every part at or below ``t`` (the test above)."""
        crowd = crowding(v, w, k, t, S)
        if crowd is None:
            return False
        c, a, keep = crowd
        parts = w - a
        forced = n - k - keep
        slots = parts * b - (c - 1) * parts - forced
        if slots < 0:
            return True
        if c * vmax + (b - c) * (v[slots - 1].item() if slots else 0) > t:
            return False  # the test at a' = a might not cover more crowded parts
        load = (S(n - k) - S(keep)) + (S(n - k + (c - 1) * parts) - S(n - k)) + S(slots)
        return load - parts * t > margin

    k = 0
    for _ in range(_BLOCKS):
        if k >= n:
            break
        k = n - int(np.searchsorted(v, v[n - 1 - k], side="left"))  # through the next tie block
        best = max(best, crowded_average(n, w, k, S, is_int) - margin)
        if not refuted(best, k):
            continue
        lo, hi = best, total  # refuted at lo; never at total (nothing is forced there)
        if is_int:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if refuted(mid, k) else (lo, mid)
            best = lo + 1  # every partition has a part above lo
        else:
            for _ in range(64):
                mid = 0.5 * (lo + hi)
                if not lo < mid < hi:
                    break
                lo, hi = (mid, hi) if refuted(mid, k) else (lo, mid)
            best = lo
    return best
