"""Locality for a balanced partition: keep samples on the rank they live on (:func:`localize`).

Works on ``rows`` [W, B] of sample indices. Never changes how many items a
part has and never lets any part exceed the input's max load ``M``.

1. :func:`assign_parts` -- which rank gets which part, maximising the bytes
   that stay: an assignment problem on the ``W x W`` overlap matrix, solved by
   greedy largest-overlap-first and then pairwise exchanges of ranks while an
   exchange helps (a 2-opt; exact for ``W <= 2``, within a few percent of the
   optimum assignment in tests).
2. :func:`tie_swaps` -- items with equal workload are interchangeable: within
   each value group, items are re-dealt to the group's slots so that as many as
   possible land on their home rank. Zero-workload padding and repeated lengths
   make this common.
3. :func:`rebalance_from_home` -- start from the home placement itself (every
   rank keeps its own samples, overflow goes to ranks with room) and run the
   swap refinement down to the same max ``M``; it moves only the few items
   the balance needs. Kept when it reaches ``M`` and keeps more bytes home.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from balancer.partition._refine import polish, polish_pairs, sort_order, swap_rounds
from balancer.partition._validate import as_workloads, check_home

__all__ = ["assign_parts", "localize", "localize_rows", "rebalance_from_home", "stay_bytes", "tie_swaps"]

# Re-balancing from the home placement costs a full refinement; beyond this many
# parts it rarely reaches the balanced max in budget and is skipped.
_HOME_START_MAX_PARTS = 32


def stay_bytes(rows: np.ndarray, home: np.ndarray, sizes: np.ndarray) -> float:
    """Bytes of samples whose home is the rank (row) they are in."""
    ranks = np.repeat(np.arange(rows.shape[0]), rows.shape[1])
    flat = rows.ravel()
    return float(sizes[flat][home[flat] == ranks].sum())


def assign_parts(rows: np.ndarray, home: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Rank for every part (a permutation of ``range(W)``), maximising stay bytes."""
    w, b = rows.shape
    flat = rows.ravel()
    part = np.repeat(np.arange(w), b)
    overlap = np.bincount(part * w + home[flat], weights=sizes[flat], minlength=w * w).reshape(w, w)
    # Greedy by largest overlap, vectorised: an edge that is the best remaining
    # one of both its part and its rank is taken by greedy anyway, so take all
    # such edges at once and repeat (ties broken by index: deterministic).
    rank_of = np.full(w, -1, np.int64)
    free_p = np.arange(w)
    free_r = np.arange(w)
    while free_p.size:
        sub = overlap[np.ix_(free_p, free_r)]
        if not sub.max() > 0:
            rank_of[free_p] = free_r  # nothing left to gain: in order
            break
        best_r = np.argmax(sub, axis=1)  # per free part
        best_p = np.argmax(sub, axis=0)  # per free rank
        mutual = np.flatnonzero(best_p[best_r] == np.arange(free_p.size))
        rank_of[free_p[mutual]] = free_r[best_r[mutual]]
        keep_r = np.ones(free_r.size, bool)
        keep_r[best_r[mutual]] = False
        keep_p = np.ones(free_p.size, bool)
        keep_p[mutual] = False
        free_p, free_r = free_p[keep_p], free_r[keep_r]
    if w <= 256:
        # 2-opt: exchange the ranks of two parts while that raises the total.
        rows_idx = np.arange(w)
        for _ in range(4):
            cur = overlap[rows_idx, rank_of]
            cross = overlap[:, rank_of]  # cross[p, q]: part p on q's rank
            gain = cross + cross.T - cur[:, None] - cur[None, :]
            best = int(np.argmax(gain))
            if gain.flat[best] <= 0:
                break
            p, q = divmod(best, w)
            rank_of[p], rank_of[q] = rank_of[q], rank_of[p]
    return rank_of


def tie_swaps(x: np.ndarray, rows: np.ndarray, home: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Re-deal items of equal workload among their slots to favour home ranks.

    Within one value group, for every rank ``r`` up to ``min(#slots on r,
    #items from r)`` items go home (largest ``sizes`` first); the rest of the
    group fills the group's remaining slots. Loads do not change.
    """
    w, b = rows.shape
    flat = rows.ravel()
    slot_rank = np.repeat(np.arange(w), b)
    val = x[flat]
    by_item = np.lexsort((-sizes[flat], home[flat], val))
    by_slot = np.lexsort((slot_rank, val))
    sv = val[by_item]  # equal to val[by_slot]: the same multiset, sorted
    group = np.r_[0, np.cumsum(sv[1:] != sv[:-1])]
    ikey = group * w + home[flat][by_item]  # ascending
    skey = group * w + slot_rank[by_slot]  # ascending
    # Position of each item (slot) within its (group, rank) run, and how many
    # slots (items) share that key: matched iff position < that count.
    i_pos = np.arange(flat.size) - np.searchsorted(ikey, ikey, "left")
    s_pos = np.arange(flat.size) - np.searchsorted(skey, skey, "left")
    i_hit = i_pos < np.searchsorted(skey, ikey, "right") - np.searchsorted(skey, ikey, "left")
    s_hit = s_pos < np.searchsorted(ikey, skey, "right") - np.searchsorted(ikey, skey, "left")
    out = np.empty_like(flat)
    # Matched items and slots list the same (group, rank) keys in the same
    # order; unmatched ones have equal counts per group, also in order.
    out[by_slot[s_hit]] = flat[by_item[i_hit]]
    out[by_slot[~s_hit]] = flat[by_item[~i_hit]]
    return np.sort(out.reshape(w, b), axis=1)


def rebalance_from_home(x: np.ndarray, home: np.ndarray, num_parts: int,
                        max_load: int | float, max_steps: int) -> np.ndarray | None:
    """Start from the home placement and refine down to ``max_load``.

    Args:
        x: [N] workloads.
        home: [N] rank per sample, in ``[0, num_parts)``.
        num_parts: W.
        max_load: the max part load to reach (the balanced partition's).
        max_steps: swap budget of the single-swap polish.

    Returns:
        [W, B] rows (indices) whose max load is ``<= max_load``, or ``None``
        if the refinement could not get there within ``max_steps`` swaps.
    """
    n, w = x.size, num_parts
    b = n // w
    # Keep up to B items per rank (the lightest-indexed first); the overflow
    # fills the ranks that have room, in order.
    order = np.lexsort((np.arange(n), home))
    counts = np.bincount(home, minlength=w)
    pos_in_rank = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
    keep = pos_in_rank < b
    rows = np.empty((w, b), np.int64)
    kept_rank = home[order][keep]
    kept_col = pos_in_rank[keep]
    rows[kept_rank, kept_col] = order[keep]
    room = b - np.minimum(counts, b)
    if room.any():
        rr = np.repeat(np.arange(w), room)
        cc = np.concatenate([np.arange(b - k, b) for k in room.tolist()])
        rows[rr, cc] = order[~keep]
    # Refine in sorted-position space, as balanced_partition does.
    srt = sort_order(x)
    rank = np.empty(n, np.int64)
    rank[srt] = np.arange(n)
    v = x[srt]
    prow = np.sort(rank[rows], axis=1)
    loads = v[prow].sum(axis=1)
    if loads.max() > max_load:
        swap_rounds(v, prow, loads, max_load, 16, max(1, 256 // max(b, 1)))
        polish(v, prow, loads, max_load, max_steps)
        polish_pairs(v, prow, loads, max_load, 16)
    if loads.max() > max_load:
        return None
    return np.sort(srt[prow], axis=1)


def localize_rows(x: np.ndarray, rows: np.ndarray, home: np.ndarray,
                  sizes: np.ndarray) -> np.ndarray:
    """See :func:`localize`; ``rows`` [W, B] indices in, out."""
    w, b = rows.shape
    if w <= 1 or b == 0:
        return np.sort(rows, axis=1)
    max_load = x[rows].sum(axis=1).max()
    best = rows[np.argsort(assign_parts(rows, home, sizes), kind="stable")]
    best = tie_swaps(x, best, home, sizes)  # whole parts re-ordered, equal items traded: the same sums
    if w <= _HOME_START_MAX_PARTS:
        alt = rebalance_from_home(x, home, w, max_load, 4 * w + 32)
        if alt is not None and x.dtype.kind == "f" and _exceeds(x, alt, _exact_max(x, rows)):
            alt = None  # the refinement's running float sums were an ulp or two off
        if alt is not None:
            alt = tie_swaps(x, alt, home, sizes)
            if stay_bytes(alt, home, sizes) > stay_bytes(best, home, sizes):
                best = alt
    return best


def _near_max(x: np.ndarray, rows: np.ndarray, limit: float) -> list[float]:
    """Exact sums (``math.fsum``) of the parts whose numpy sum lies within rounding of ``limit`` or above."""
    loads = x[rows].sum(axis=1)
    slack = abs(limit) * 4 * rows.shape[1] * np.finfo(np.float64).eps
    return [math.fsum(x[rows[i]].tolist()) for i in np.flatnonzero(loads >= limit - slack)]


def _exact_max(x: np.ndarray, rows: np.ndarray) -> float:
    """The max part load of float ``rows``, summed exactly."""
    return max(_near_max(x, rows, float(x[rows].sum(axis=1).max())))


def _exceeds(x: np.ndarray, rows: np.ndarray, limit: float) -> bool:
    """Whether a part of float ``rows`` sums, exactly, to more than ``limit``."""
    return any(t > limit for t in _near_max(x, rows, limit))


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
    x = as_workloads(workloads, max(w, 1))
    n = x.size
    try:
        given = np.asarray(parts) if w else np.zeros((0, 0), np.int64)
    except ValueError:  # ragged
        given = np.zeros(0)
    if given.ndim != 2 or (given.dtype.kind not in "iu" and given.size) or given.size != n:
        raise ValueError(f"parts must be {w} lists of {n // max(w, 1)} int indices forming a "
                         f"permutation of range({n})")
    rows = given.astype(np.int64)
    if not np.array_equal(np.sort(rows.ravel()), np.arange(n)):
        raise ValueError(f"parts must be {w} lists of {n // max(w, 1)} indices forming a "
                         f"permutation of range({n})")
    h, s = check_home(home, sizes, n, w)
    out: list[list[int]] = localize_rows(x, rows, h, s).tolist()
    return out
