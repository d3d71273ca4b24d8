"""Projected-load greedy with a cardinality cap: the start of ``balanced_partition`` at scale.

Capped LPT (largest item to the lightest part with room, ``_lpt``)
ignores how many slots a part still has to fill. A part that waited while its
huge first item was balanced by the others ends with more empty slots than the
rest, and the small items that fill them push it over the level (4096x64
lognormal: 2.3e-3 above the bound). The rule here serves the part with the
smallest *projected* load instead::

    proj_j = load_j + slots_j * mu,   mu = mean of the items not yet dealt

(every open slot will receive an average remaining item). A part with more
empty slots is served later and, since items come largest first, ends with
smaller ones. Done exactly (one item at a time, a heap) the rule is within
~1e-4 of ``lower_bound`` on every benchmark shape (4096x64 lognormal: 7.7e-5,
where capped LPT is 2.3e-3 above it).

One item at a time is far too slow at N = 262,144 in Python. A *step* here
deals about ``rows_per_step`` rows of items (``rows_per_step * open parts``,
and only items within a factor 2 of the largest remaining one, 4 at
5-8 items a part) at once:

1. ``mu`` is the mean of what remains *after* the step (the projection the
   step moves towards); the open parts are sorted by ``proj``;
2. water-filling the step's total (``k`` items of mean excess ``e = mean -
   mu``) over the sorted projections gives a level ``lam``; a part below it
   is owed ``ceil((lam - proj_j) / e0)`` items, ``e0 = largest item - mu``
   (at most its free slots). Parts far below the level (a part whose first
   item was small) catch up within a step or two; dividing by the largest
   excess rather than the mean keeps parts near the level from being owed an
   extra item they would not get one at a time (uniform 8192x32: 2.4e-4 with
   the mean, 5.2e-5 with ``e0``);
3. items are dealt in rounds, largest first, each round going to the parts
   still owed an item in projection order (the lightest gets the largest).
   When all parts are within one item of each other a step is simply full
   rounds.

A step costs ~30 numpy calls on the open parts plus a few passes over the
items it deals, so a partition costs ``O(B / rows_per_step)`` steps (measured:
22-50 steps at 8192x32). Once fewer than half the parts are open a step deals
at least ``1 / _TAIL_STEPS`` of the remaining items (see ``_TAIL_STEPS``).

When no item is left above 0 the remaining slots are filled with the zeros in
order. Everything is deterministic: projections are sorted with tie-free
integer keys (``order_floats``).
"""

from __future__ import annotations

import numpy as np

from balancer.partition._refine import order_floats

__all__ = ["fill"]

_BAND = 0.5  # a step deals only items >= _BAND * the largest remaining one
# ... and >= _BAND_FEW * it at 5-8 items a part, where each part takes an item
# or two a step and column re-matching follows: fewer, fuller steps. Side by
# side with 0.5 (bench_partition.py --only scale --before f01da70 --seeds 3,
# per-seed medians): 32768x8 lognormal 25.7 -> 18.6 ms, Zipf 26.7 -> 23.6,
# 16384x8 and 2048x8 to 8192x8 1.0-1.1x, quality the same or closer. At B = 4
# it was mixed (65536x4 Zipf 32.7 -> 41.7 ms: its start ends above re-matching's
# stop more often), at B = 32 it cost quality (8192x32 Zipf worst 5.0e-6 -> 1.7e-3).
_BAND_FEW = 0.25
_BAND_FEW_B = (5, 8)
_FEW = 64  # _deal: rounds over more parts than this go one by one
# Once fewer than half the parts are open, the open ones are those that took a
# huge item early and wait for the smallest items; a step there deals at least
# 1/_TAIL_STEPS of what remains instead of one row of the open parts (8192x32
# lognormal, measured on fill alone while tuning: ~50 tail steps of ~300 items
# -> ~15, fill 17 -> 14 ms, quality unchanged; applied from the start it costs
# uniform inputs 2x in quality).
_TAIL_STEPS = 8


def fill(vals: np.ndarray, num_parts: int, prefix: np.ndarray,
         rows_per_step: int, alternate: bool = False,
         start: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Projected-load greedy on ascending ``vals``; see the module docstring.

    Args:
        vals: [N] workloads sorted ascending (int64 or float64), N divisible
            by ``num_parts``.
        num_parts: W.
        prefix: [N + 1] prefix sums of ``vals`` (``prefix[i] = sum(vals[:i])``).
        rows_per_step: about this many rows of ``W`` items are dealt per step
            (1 follows the one-item rule closely; more is faster and coarser).
        alternate: full rounds within a step alternate direction (lightest
            part first, then heaviest first) instead of always serving the
            lightest first, which hands it the largest item of every round.
        start: optional ``(rows, load, slots, pos)`` for parts that already
            hold items: ``rows`` [W, N / W] has part ``j``'s items in its last
            ``N / W - slots[j]`` places (ascending, all at positions ``>= pos``)
            and ``load`` [W] their sums; ``vals[:pos]`` are dealt into the
            free places, and ``rows`` is filled in place
            (:mod:`balancer.partition._crowded_start`).

    Returns:
        ``(rows, loads)``: [W, N / W] int64 sorted positions per part (each row
        ascending) and [W] part loads (exact for int64 input).
    """
    n = vals.size
    w = num_parts
    cap = n // w
    band = _BAND_FEW if _BAND_FEW_B[0] <= cap <= _BAND_FEW_B[1] else _BAND
    is_int = vals.dtype.kind != "f"
    if start is None:
        flat = np.empty(n, np.int64)
        ids = np.arange(w, dtype=np.int64)  # open parts, in the order of the last sort
        load = np.zeros(w, vals.dtype)  # exact for integers
        slots = np.full(w, cap, np.int64)
        loads = np.zeros(w, vals.dtype)  # by part id, filled in as parts close
        pos = n  # vals[:pos] are still to be dealt, largest first
    else:
        rows0, load0, slots0, pos = start
        flat = rows0.reshape(-1)  # a view: filled in place
        ids = np.flatnonzero(slots0 > 0)
        load, slots = load0[ids].astype(vals.dtype), slots0[ids].astype(np.int64)
        loads = load0.astype(vals.dtype)  # by part id; parts full from the start keep theirs
    while pos > 0:
        x0 = vals[pos - 1]
        if x0 == 0:
            # Only zeros left: they change no load; fill the open slots in order.
            starts = np.cumsum(slots) - slots
            col = np.arange(pos) - np.repeat(starts, slots)
            flat[np.repeat(ids, slots) * cap + col] = np.arange(pos)
            slots[:] = 0
            break
        parts = ids.size
        thr = int(np.ceil(band * float(x0))) if is_int else band * float(x0)
        k = rows_per_step * parts
        if 2 * parts < w:
            k = max(k, -(-pos // _TAIL_STEPS))
        k = max(1, min(k, pos - int(np.searchsorted(vals[:pos], thr, side="left"))))
        rest = pos - k
        mu = float(prefix[rest]) / rest if rest else 0.0
        e = float(prefix[pos] - prefix[rest]) / k - mu  # >= 0: the step deals the largest items
        e0 = float(x0) - mu  # what the first item adds to a projection
        proj = load + slots * mu
        # The parts are kept in the previous step's order, which is mostly
        # still right: timsort is ~2x faster than quicksort on that.
        order = order_floats(proj, nearly_sorted=True, nonneg=True)
        ids, load, slots, proj = ids[order], load[order], slots[order], proj[order]
        if k >= parts and proj[-1] - proj[0] < e0:
            # All parts lie within one item of each other: full rounds.
            owed = np.minimum(slots, k // parts)
        elif e <= 0 or not e0 > 0 or vals[0] == x0:
            # Every remaining item equals x0 (or, with float workloads, lies
            # within the prefix sums' rounding of it, which leaves e and e0 a
            # few ulps off 0, either side): any dealing gives the same loads.
            owed = slots.copy()
        else:
            # Water level: raising the lowest projections by `k * e` in total;
            # a part below it is owed one item per `e0` (the largest item's
            # excess) of its distance, so light parts catch up in few steps
            # without overshooting.
            csum = np.cumsum(proj)
            need = np.arange(1, parts + 1) * proj - csum
            inside = int(np.searchsorted(need, k * e, side="right"))
            level = (k * e + csum[inside - 1]) / inside
            owed = np.minimum(np.ceil((level - proj[:inside]) / e0), slots[:inside]).astype(np.int64)
            owed[0] = max(owed[0], 1)
        # owed >= 1 on a prefix of the projection order (0 only where proj ==
        # level); with float workloads rounding can put a 0 inside it: the
        # parts before the first 0 are dealt to.
        short = np.flatnonzero(owed <= 0)
        owed = owed[: int(short[0]) if short.size else owed.size]
        pos = _deal(vals, flat, cap, ids, load, slots, owed, pos, alternate)
        if not slots[: owed.size].all():
            keep = slots > 0
            loads[ids[~keep]] = load[~keep]
            ids, load, slots = ids[keep], load[keep], slots[keep]
    loads[ids] = load
    rows: np.ndarray = flat.reshape(w, cap)
    return rows, loads


def _deal(vals: np.ndarray, flat: np.ndarray, cap: int, ids: np.ndarray, load: np.ndarray,
          slots: np.ndarray, owed: np.ndarray, pos: int, alternate: bool = False) -> int:
    """Deal ``owed[j] >= 1`` items to part ``ids[j]`` for ``j < owed.size``, largest first.

    Round ``r`` serves every part still owed an item, in the order of ``ids``
    (the projection order: the lightest gets the largest item); updates
    ``flat``, ``load`` and ``slots`` in place.

    Returns:
        The new ``pos`` (items ``vals[:pos]`` remain).
    """
    m = owed.size
    total = min(int(owed.sum()), pos)
    # The rounds that serve every one of the m parts form one dense block.
    width = min(int(owed.min()), total // m)
    if width:
        # A part's row fills from its end: positions come largest first, so
        # every row ends up ascending without a sort.
        base = ids[:m] * cap + (slots[:m] - 1)
        block = base[None, :] - np.arange(width)[:, None]  # [width, m], round-major
        src = np.arange(pos - 1, pos - 1 - width * m, -1).reshape(width, m)
        got = vals[pos - width * m : pos][::-1].reshape(width, m)  # views, no gather
        if width > 1 and alternate:
            src[1::2] = src[1::2, ::-1]
            load[:m] += got[0::2].sum(axis=0) + got[1::2, ::-1].sum(axis=0)
        else:
            load[:m] += got.sum(axis=0)
        flat[block.ravel()] = src.ravel()
        slots[:m] -= width
        pos -= width * m
        total -= width * m
    # Further rounds, each over the parts still owed: a slice-free loop while
    # many parts take part, then one vectorised pass for the few stragglers
    # that are owed many items (parts far below the level).
    who = np.flatnonzero(owed > width)
    r = width
    while total > 0 and who.size > _FEW:
        now = who[: min(who.size, total)]
        t = now.size
        flat[ids[now] * cap + (slots[now] - 1)] = np.arange(pos - 1, pos - 1 - t, -1)
        load[now] += vals[pos - t : pos][::-1]
        slots[now] -= 1
        pos -= t
        total -= t
        r += 1
        who = who[owed[who] > r]
    if total > 0 and who.size:
        # Round r' serves those still owed more than r'. Ordered by what they
        # are owed (stable: projection order within equal counts) each round
        # is a prefix.
        need = owed[who] - r
        by_need = np.argsort(-need, kind="stable")
        who, need = who[by_need], need[by_need]
        per_round = np.bincount(need, minlength=int(need[0]) + 1)[:0:-1].cumsum()[::-1]
        rnd = np.repeat(np.arange(per_round.size), per_round)[:total]
        part = who[np.arange(rnd.size) - (np.cumsum(per_round) - per_round)[rnd]]
        t = rnd.size
        flat[ids[part] * cap + (slots[part] - 1) - rnd] = np.arange(pos - 1, pos - 1 - t, -1)
        np.add.at(load, part, vals[pos - t : pos][::-1])  # same dtype: numpy's fast path
        slots[:m] -= np.bincount(part, minlength=m)
        pos -= t
    return pos
