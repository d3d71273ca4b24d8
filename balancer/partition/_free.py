"""Free-size partitioning: ``W`` parts of any (or bounded) item counts, smallest max sum.

This is multiway number partitioning (``P || C_max``), the problem behind a
token-budget dispatch (ranks may receive different numbers of samples) and
behind cutting one rank's samples into micro-batches. Optional constraints:
``min_size <= items per part <= max_size``, and a second per-item quantity
(``sizes``, e.g. tokens) whose per-part sum must stay ``<= cap`` (a micro-batch
token budget) while the first one (``x``, e.g. FLOPs) is balanced.

:func:`free_assign` on the items sorted descending:

1. LPT: the largest item goes to the lightest part that may take it (count
   below ``max_size``, room under ``cap``); once the items left are exactly
   the ones parts below ``min_size`` still miss, only those parts are served.
   Without constraints this is a plain heap loop (~0.3 us per item). On heavy
   tails LPT alone lands within ~1e-5 of the bound (``lower_bound`` with
   ``equal_size=False``): the last items it places are the smallest ones, and
   they even the parts out.
2. Refinement (:mod:`balancer.partition._free_refine`): parallel rounds in
   which every part above the target moves one item to, or swaps one with, a
   light part, then single moves/swaps of the heaviest part, until within
   ``rtol`` of that bound or no move helps. Every constraint holds
   throughout.

The state both steps work on, and LPT itself, live in
:mod:`balancer.partition._free_state`. Deterministic: ties in the sort are
broken by index, ties in LPT by part id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from balancer.partition._bound import bound_sorted
from balancer.partition._free_refine import rounds, steps
from balancer.partition._free_state import FreeState
from balancer.partition._refine import sort_order
from balancer.partition._validate import as_workloads, check_num_parts, check_sizes

__all__ = ["free_assign", "free_partition", "labels_to_lists"]


def free_partition(workloads: Any, num_parts: int, *, min_size: int = 0,
                   max_size: int | None = None) -> list[list[int]]:
    """``num_parts`` parts of free (or bounded) item counts with the smallest max sum.

    Example: ``[9, 1, 8, 2, 7, 3]`` into 2 parts gives ``[[0, 1, 3, 5], [2, 4]]``,
    loads 15 and 15 (optimal); equal counts cannot beat 16. Algorithm and
    bound: ``balancer/partition/_free.py``.

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
    check_num_parts(num_parts)
    labels = free_assign(as_workloads(workloads, 1), num_parts, min_size, max_size)
    assert labels is not None, "without a cap the greedy always places every item"
    return labels_to_lists(labels, num_parts)


def labels_to_lists(labels: np.ndarray, w: int) -> list[list[int]]:
    """Part id per item [N] -> ``w`` ascending index lists."""
    order = np.argsort(labels, kind="stable")
    cuts = np.searchsorted(labels[order], np.arange(1, w))
    return [p.tolist() for p in np.split(order, cuts)]


def free_assign(x: np.ndarray, w: int, min_size: int = 0, max_size: int | None = None,
                sizes: np.ndarray | None = None, cap: Any = None,
                rtol: float = 1e-5, start: np.ndarray | None = None) -> np.ndarray | None:
    """Part id per item: ``W`` parts of free size with a small maximum sum of ``x``.

    Args:
        x: [N] validated non-negative workloads (int64 or float64).
        w: number of parts ``W >= 1``.
        min_size, max_size: item-count bounds per part (validated by
            :func:`balancer.partition._validate.check_sizes`; ``None`` is unbounded).
        sizes: optional [N] second quantity per item (e.g. tokens), same
            dtype kind as ``cap``; with ``cap``, every part keeps
            ``sum(sizes) <= cap``.
        cap: the per-part limit on ``sizes``.
        rtol: stop refining within ``rtol`` of the free-size lower bound.
        start: optional [N] part ids of a feasible assignment to refine
            instead of building one (e.g. a token-balanced packing).

    Returns:
        [N] int64 part id per item (in input order), or ``None`` when the greedy
        could not place an item under ``cap`` (not a proof of infeasibility).
    """
    n = x.size
    lo, hi = check_sizes(n, w, min_size, max_size)
    order = sort_order(x)
    v = x[order]
    s = None if sizes is None else sizes[order]
    st = FreeState(v, s, w)
    if start is not None:
        st.part[:] = start[order]
        np.add.at(st.loads, st.part, v)
        np.add.at(st.counts, st.part, 1)
        if st.toks is not None and s is not None:
            np.add.at(st.toks, st.part, s)
    elif s is not None or hi < n:
        if not st.lpt(range(n - 1, -1, -1), lo, hi, cap):
            return None
    else:
        # The last W * min_size items may have to fill parts below min_size.
        st.lpt_free(w * lo)
        st.lpt(range(w * lo - 1, -1, -1), lo, hi, cap)
    bound = bound_sorted(v, w, equal_size=False, min_size=lo, max_size=None if max_size is None else hi)
    target = bound * (1 + rtol) if rtol > 0 else bound
    if v.dtype.kind == "i":
        target = int(target)
    if st.loads.max(initial=0) > target:  # else both return at once (steps after splitting
        rounds(st, target, lo, hi, cap, 16)  # every part's members: ~10 ms at W = 5,000)
        steps(st, target, lo, hi, cap, 2 * w + 32)
    out = np.empty(n, np.int64)
    out[order] = st.part
    return out
