"""Swap refinement: lower the heaviest part by exchanging one item with a light part.

A partition is held as ``rows`` [W, B]: sorted positions (ranks into the
ascending value array), each row ascending, so ``vals[rows]`` is sorted per row.
Every step takes the heaviest part ``p`` and, among the ``K`` lightest, the
``K`` heaviest other parts and the owners of the smallest items (all parts
when that is cheap), the swap
``a in p <-> b in q`` whose transfer ``d = a - b`` is closest to half the gap
``D = L_p - L_q``: the pair's new maximum is ``(L_p + L_q + |2d - D|)/2``,
an improvement iff ``|2d - D| < D``. Targets ``2b + D`` are looked up in the
sorted row of ``p`` with one ``searchsorted`` for all ``~3K * B`` candidates,
so a step is ~15 numpy calls on ``~3K * B`` elements. Swaps keep every part at exactly
``B`` items and never raise the maximum.

When no single swap helps (e.g. lengths are integers and ``L^2 + 1024 L``
differs by >= 1027 between lengths, so single transfers are coarse),
:func:`polish_pairs` trades two items for two: differences of pair sums are
much denser, which closes the last gap to the bound.

Both stop where the heaviest part has no swap left. That can be a tie, or
a near one: its only trades are with a part just below it, which would go
over. :func:`level_others` then polishes the other parts as if the heaviest
were not there (lowering their max makes room), and the whole partition again.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

from balancer._limits import PACKED_KEY_LIMIT
from balancer.partition._polish_all import fits, polish_all

__all__ = ["TIMSORT_MIN_PARTS", "coarse_keys", "level_others", "order_floats", "polish", "polish_pairs", "radix_fits",
           "radix_order", "sort_order", "sort_values", "swap_rounds"]

_PARTNERS = 8
_REORDER = 8  # polish: re-sort the loads for partner choice every this many swaps
_BUDGET = 8192  # polish: partner items searched per step (all parts below this)
_ROUND_BUDGET = 2048  # swap_rounds: partner items searched per heavy part
# From this many parts on, part loads (and column re-matching's remainders) are
# ordered with timsort (``order_floats``' ``nearly_sorted``): loads by part id
# keep much of the start's order (KK numbers its parts by load), so the runs are
# long. Same keys, so the same order. Measured over whole partitions (seed 0):
# swap rounds' and the polish's sorts 32768x8 lognormal 5.7 -> 2.9 ms, Zipf 4.6 -> 1.7 ms,
# 16384x16 2.1 -> 1.4 ms; re-matching's 32768x8 uniform 19.6 -> 10.7 ms,
# 16384x16 uniform 7.6 -> 5.5 ms; equal at 8192 parts, slower on small inputs.
TIMSORT_MIN_PARTS = 16384
# sort_values: LSD radix (stable argsorts of 16-bit digits) from this many items
# on, for values below 2**(16 * _RADIX_MAX_DIGITS)
_RADIX_MIN_ITEMS = 4096
_RADIX_MAX_DIGITS = 3


def sort_order(x: np.ndarray) -> np.ndarray:
    """Ascending order of ``x`` with ties by index, the same on every platform."""
    return sort_values(x)[0]


def sort_values(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(order, x[order])``: ascending, ties by index, the same on every platform.

    Non-negative int64 below ``2**48`` from ``_RADIX_MIN_ITEMS`` items on (every
    workload the benchmarks see) is ordered by :func:`radix_order`;
    measured on the CI box, seed 0 lognormal workloads: 262,144 items 13.6 ->
    5.1 ms, 65,536 2.4 -> 0.8 ms, 8,192 0.21 -> 0.10 ms against the packed
    keys below. Smaller non-negative int64 below ``PACKED_KEY_LIMIT /
    2**ceil(log2 N)`` is sorted as unique keys ``x << bits | index`` with a
    plain ``np.sort`` -- any algorithm, SIMD or not, gives the same result --
    and both outputs are read back from the keys with a shift and a mask.
    Anything else takes the stable argsort.
    """
    n = x.size
    bits = max(1, (n - 1).bit_length())
    if x.dtype.kind == "i" and n >= _RADIX_MIN_ITEMS and radix_fits(x):
        order = radix_order(x)
        return order, x[order]
    if x.dtype.kind == "i" and n and int(x.min()) >= 0 and int(x.max()) < PACKED_KEY_LIMIT >> bits:
        keys = (x << bits) | np.arange(n, dtype=np.int64)
        keys.sort()
        return keys & ((1 << bits) - 1), keys >> bits
    order = np.argsort(x, kind="stable")
    return order, x[order]


def radix_fits(keys: np.ndarray) -> bool:
    """Whether integer ``keys`` (non-empty) can go to :func:`radix_order`: all in
    ``[0, 2**(16 * _RADIX_MAX_DIGITS))``."""
    return int(keys.min()) >= 0 and int(keys.max()) < 1 << (16 * _RADIX_MAX_DIGITS)


def radix_order(keys: np.ndarray) -> np.ndarray:
    """Stable ascending order of 1-D integer ``keys`` (see :func:`radix_fits`).

    LSD radix: one stable argsort of 16-bit digits per 16 bits of the largest
    key, lowest digit first (numpy sorts 16-bit integers stably by radix, in
    O(n)). A stable order is unique, so every platform gets the same one.
    """
    order = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
    for shift in range(16, int(keys.max()).bit_length(), 16):
        digit = ((keys >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digit[order], kind="stable")]
    return order


def coarse_keys(offsets: np.ndarray, span: int) -> np.ndarray:
    """The top 16 bits of integer ``offsets`` in ``[0, span]``, as uint16.

    A stable argsort of these keys (one radix pass) orders the offsets up to
    ``span / 2**15``: closer ones count as ties (broken by index), the same on
    every machine. Re-matching and the KK start pair items by such orders: a
    pairing off by one bucket is still a partition, only a little less good,
    at half the sort time of :func:`radix_order` on 25-bit keys.
    """
    shift = max(0, int(span).bit_length() - 16)
    return (offsets >> shift).astype(np.uint16)


def order_floats(keys: np.ndarray, nearly_sorted: bool = False, nonneg: bool = False) -> np.ndarray:
    """Ascending order of ``keys`` (cast to float64), ties broken by index.

    The keys are mapped to order-preserving int64 (IEEE bits, negatives
    flipped), their lowest ``log2(n)`` mantissa bits are replaced by the index
    and one plain ``np.sort`` orders the unique keys -- ~6x faster than a
    stable argsort at 8192 keys, and the same on every machine (unique keys:
    every algorithm agrees). Keys within ~2^-40 of each other (relative) count
    as ties (broken by index). ``nearly_sorted`` picks timsort, ~2x faster on
    keys that are mostly in order already and ~5x slower on random ones.
    ``nonneg`` (all keys >= 0, whose IEEE bits already sort as integers) saves
    the sign flip.
    """
    n = keys.size
    bits = max(1, (n - 1).bit_length())
    k = np.ascontiguousarray(keys, dtype=np.float64).view(np.int64)
    mono = k if nonneg else k ^ ((k >> 63) & np.int64(0x7FFF_FFFF_FFFF_FFFF))
    packed = ((mono >> bits) << bits) | np.arange(n, dtype=np.int64)
    packed.sort(kind="stable" if nearly_sorted else "quicksort")
    out: np.ndarray = packed & np.int64((1 << bits) - 1)
    return out


def polish(vals: np.ndarray, rows: np.ndarray, loads: np.ndarray, target: float,
           max_steps: int, max_items: int | None = None, stop_at: float | None = None) -> int:
    """Improve ``rows`` in place until the max load is ``<= target``.

    Args:
        vals: [N] workloads sorted ascending (int64 or float64).
        rows: [W, B] int64 sorted positions, each row ascending; updated in place.
        loads: [W] part sums ``vals[rows].sum(1)``; updated in place.
        target: stop once the max load is at most this (e.g. the lower bound).
        max_steps: at most this many swaps.
        max_items: stop once the steps searched this many partner items in
            total (the work budget; ``None``: no limit).
        stop_at: stop at this ``time.perf_counter()`` value (checked per step).

    Returns:
        The number of swaps made.
    """
    w, b = rows.shape
    if w < 2 or b == 0:
        return 0
    big = np.inf if vals.dtype.kind == "f" else np.iinfo(np.int64).max
    steps = 0
    # Partners: the K lightest (most room), the K heaviest others (a heavy
    # part's best trade is often with another heavy part holding smaller
    # fillers) and the owners of the K smallest items (what a part topped up
    # with small fillers can still trade down to); all parts when that is
    # cheap or when those had no swap.
    few = w - 1 > 3 * _PARTNERS and (w - 1) * b > _BUDGET
    budget = max_items if max_items is not None else -1
    if not few and fits(vals, loads):
        return polish_all(vals, rows, loads, target, max_steps, budget, stop_at)
    full = not few
    # Owners of the 2K smallest items only (scattering all N owners costs more
    # than a whole polish at N = 262,144).
    small = min(2 * _PARTNERS, rows.size)
    owner = np.zeros(small, np.int64)
    if few:
        # Only rows whose first (smallest) position is below `small` hold one:
        # scanning those few instead of all N positions saves ~0.7 ms at N = 262,144.
        hold = np.flatnonzero(rows[:, 0] < small)
        sub = rows[hold]
        r, c = np.nonzero(sub < small)
        owner[sub[r, c]] = hold[r]
    sorted_at = -_REORDER
    order = np.arange(w)
    while steps < max_steps:
        p = int(np.argmax(loads))
        lp = loads[p]
        if lp <= target or budget == 0 or (stop_at is not None and time.perf_counter() >= stop_at):
            break
        if full:
            cand = np.delete(np.arange(w), p)
        else:
            if steps >= sorted_at + _REORDER:
                # Partners from a load order at most _REORDER swaps old: a
                # swap moves two parts, sorting W loads per step costs more
                # than the step itself at W = 8192.
                order, sorted_at = order_floats(loads, nearly_sorted=w >= TIMSORT_MIN_PARTS), steps
            cand = np.unique(np.concatenate(
                [order[:_PARTNERS], order[-_PARTNERS - 1 :], owner]))
            cand = cand[cand != p]
        if budget > 0:
            if cand.size * b > budget and full and few:
                break  # the all-parts fallback does not fit in what is left
            budget = max(0, budget - cand.size * b)
        a2 = 2 * vals[rows[p]]  # ascending
        vq = vals[rows[cand]]  # [K, B]
        gap = lp - loads[cand]  # [K], > 0 unless tied with the max
        want = 2 * vq + gap[:, None]  # 2a that would split the gap evenly
        found = _closest(a2, want, gap, loads[cand], big)
        if found is None:
            if full:
                break
            full = True
            continue
        full = not few
        qi, jb, ia = found
        q = int(cand[qi])
        ra, rb = rows[p, ia], rows[q, jb]
        d = vals[ra] - vals[rb]
        rows[p, ia], rows[q, jb] = rb, ra
        rows[p].sort()
        rows[q].sort()
        if ra < small:
            owner[ra] = q
        if rb < small:
            owner[rb] = p
        loads[p] -= d
        loads[q] += d
        steps += 1
    return steps


def _search_rows(keys: np.ndarray, queries: np.ndarray, span: int | None = None) -> np.ndarray:
    """Row-wise ``searchsorted(keys[r], queries[r])``: keys [P, B], queries [P, Q].

    Integer keys are shifted by ``row * span`` so that one flat ``searchsorted``
    answers every row (exact and deterministic); floats, or spans that could
    overflow, merge each row with one stable argsort instead. ``span`` (for
    non-negative ints: more than every key and query) saves four reductions.
    """
    p, b = keys.shape
    nq = queries.shape[1]
    if keys.dtype.kind == "i" and p and b and nq:
        lo = 0
        if span is None:
            lo = min(int(keys.min()), int(queries.min()))
            span = max(int(keys.max()), int(queries.max())) - lo + 1
        if span < PACKED_KEY_LIMIT // p:
            shift = (np.arange(p, dtype=np.int64) * span - lo)[:, None]
            flat = np.searchsorted((keys + shift).ravel(), (queries + shift).ravel())
            return flat.reshape(p, nq) - (np.arange(p, dtype=np.int64) * b)[:, None]
    merged = np.concatenate([keys, queries], axis=1)
    order = np.argsort(merged, axis=1, kind="stable")
    is_key = order < b
    seen = np.cumsum(is_key, axis=1)  # keys at or before each position
    out = np.empty((p, nq), np.int64)
    r, c = np.nonzero(~is_key)
    out[r, order[r, c] - b] = seen[r, c]
    return out


def swap_rounds(vals: np.ndarray, rows: np.ndarray, loads: np.ndarray, target: float,
                max_rounds: int, partners: int = 8, max_items: int | None = None,
                stop_at: float | None = None, min_heavy: int = 1) -> int:
    """Parallel swap rounds for every part above ``target``.

    The ``m`` parts above target (at most ``W // 2``), heaviest first, meet the
    ``m`` lightest parts: heavy ``i`` looks at light ``(i + s) mod m`` for
    ``s < partners`` and picks its best single swap. A light part chosen by
    several heavy ones serves the heaviest. Every other round pairs the heavy
    parts among themselves instead (heaviest with least heavy), which is what
    parts sharing one huge item each need to even out their fillers. One round
    is ~25 numpy calls on ``m * partners * B`` elements and fixes up to ``m``
    parts; two rounds in a row without a swap end it. With ``max_items`` a
    round searches at most that many partner items (fewer partners, then only
    the heaviest parts); ``stop_at`` is a ``time.perf_counter()`` deadline.
    Rounds stop once fewer than ``min_heavy`` parts are above ``target``.

    Returns:
        The number of swaps made.
    """
    w, b = rows.shape
    total = 0
    big = np.inf if vals.dtype.kind == "f" else np.iinfo(np.int64).max
    idle = 0  # consecutive rounds without a swap
    runs = w >= TIMSORT_MIN_PARTS
    for rnd in range(max_rounds):
        order = order_floats(loads, nearly_sorted=runs)
        m = min(int(np.count_nonzero(loads > target)), w // 2)
        if m < max(1, min_heavy) or idle == 2 or (stop_at is not None and time.perf_counter() >= stop_at):
            break
        if max_items is not None:
            m = max(1, min(m, max_items // b))
        top = order[::-1][:m]
        if rnd % 2 == 0 or m < 2:
            # Heavy parts against the m lightest, `s` partners each.
            heavy = top
            s = max(1, min(partners, m, _ROUND_BUDGET // (m * b)))
            if max_items is not None:
                s = max(1, min(s, max_items // (m * b)))
            part = order[:m][(np.arange(m)[:, None] + np.arange(s)[None, :]) % m]  # [m, s]
        else:
            # Heavy parts among themselves (heaviest with least heavy): parts
            # that all hold one huge item balance their fillers this way.
            half = m // 2
            heavy = top[:half]
            s = 1
            part = top[::-1][:half, None]
        m = heavy.size
        gap = loads[heavy][:, None] - loads[part]  # [m, s]
        a2 = 2 * vals[rows[heavy]]  # [m, B]
        want = (2 * vals[rows[part]] + gap[:, :, None]).reshape(m, s * b)
        # Keys and queries are >= 0 and below 2 max(vals) + max(gap) + 1.
        span = int(2 * vals[-1] + (loads[heavy[0]] - loads[order[0]])) + 1 \
            if vals.dtype.kind == "i" else None
        hi = np.minimum(_search_rows(a2, want, span), b - 1)
        lo = np.maximum(hi - 1, 0)
        ridx = np.arange(m)[:, None]
        err_hi = np.abs(a2[ridx, hi] - want)
        err_lo = np.abs(a2[ridx, lo] - want)
        use_lo = err_lo < err_hi
        err = np.where(use_lo, err_lo, err_hi).reshape(m, s, b)
        # New pair max is (L_h + L_q + err) / 2: rank by L_q + err.
        score = np.where(err < gap[:, :, None], err + loads[part][:, :, None], big)
        best = np.argmin(score.reshape(m, s * b), axis=1)
        hs = np.arange(m)
        ok = score.reshape(m, s * b)[hs, best] != big
        hs, best = hs[ok], best[ok]
        if hs.size == 0:
            idle += 1
            continue
        idle = 0
        si, jb = np.divmod(best, b)
        q = part[hs, si]
        # One swap per light part: the heaviest claimant (smallest hs) wins.
        claim = np.full(w, m)
        np.minimum.at(claim, q, hs)
        first = claim[q] == hs
        hs, si, jb, q = hs[first], si[first], jb[first], q[first]
        flat = si * b + jb
        ia = np.where(use_lo[hs, flat], lo[hs, flat], hi[hs, flat])
        h = heavy[hs]
        ra = rows[h, ia]
        rb = rows[q, jb]
        d = vals[ra] - vals[rb]
        rows[h, ia] = rb
        rows[q, jb] = ra
        rows[h] = np.sort(rows[h], axis=1)
        rows[q] = np.sort(rows[q], axis=1)
        loads[h] -= d
        loads[q] += d
        total += int(h.size)
    return total


def _closest(sorted_vals: np.ndarray, want: np.ndarray, gap: np.ndarray, base: np.ndarray,
             big: Any) -> tuple[int, int, int] | None:
    """The best swap among targets ``want`` [K, M] against ``sorted_vals`` [S].

    Each target is matched to its nearest entry of ``sorted_vals``; a match
    counts when its error is below ``gap[k]`` and scores ``error + base[k]``.

    Returns:
        ``(k, m, index into sorted_vals)`` of the lowest score, or ``None`` when
        no match counts.
    """
    hi = np.minimum(np.searchsorted(sorted_vals, want), sorted_vals.size - 1)
    lo = np.maximum(hi - 1, 0)
    err_hi = np.abs(sorted_vals[hi] - want)
    err_lo = np.abs(sorted_vals[lo] - want)
    use_lo = err_lo < err_hi
    err = np.where(use_lo, err_lo, err_hi)
    score = np.where(err < gap[:, None], err + base[:, None], big)
    k, m = divmod(int(np.argmin(score)), want.shape[1])
    if score[k, m] == big:
        return None
    return k, m, int(lo[k, m] if use_lo[k, m] else hi[k, m])


@functools.lru_cache(maxsize=64)
def _pair_columns(b: int, sample: int) -> tuple[np.ndarray, np.ndarray]:
    """The column pairs ``(ci, cj)``, ``ci < cj``, of :func:`polish_pairs`: every
    ``B // sample``-th column (all for ``B <= sample``). Cached, read-only: building
    them took ~40 us, and :func:`level_others` calls ``polish_pairs`` up to 16 times
    a partition (32x8 uniform: ~0.25 of its 2.4 ms)."""
    cols = np.arange(0, b, max(1, b // sample))
    ii, jj = np.triu_indices(cols.size, 1)
    ci, cj = cols[ii], cols[jj]
    ci.flags.writeable = cj.flags.writeable = False
    return ci, cj


def polish_pairs(vals: np.ndarray, rows: np.ndarray, loads: np.ndarray, target: float,
                 max_steps: int, sample: int = 48) -> int:
    """Like :func:`polish`, trading two items of the heaviest part for two of another.

    Pairs are drawn from every ``B // sample``-th item of each row (all of them
    for ``B <= sample``) and partners are the ``2 * _PARTNERS`` lightest parts,
    so a step costs ``O(_PARTNERS * sample^2)``.

    Returns:
        The number of two-for-two swaps made.
    """
    w, b = rows.shape
    if w < 2 or b < 2:
        return 0
    ci, cj = _pair_columns(b, sample)
    big = np.inf if vals.dtype.kind == "f" else np.iinfo(np.int64).max
    steps = 0
    while steps < max_steps:
        p = int(np.argmax(loads))
        lp = loads[p]
        if lp <= target:
            break
        vp = vals[rows[p]]
        sp = vp[ci] + vp[cj]
        op = np.argsort(sp, kind="stable")
        sp2 = 2 * sp[op]
        others = np.argsort(loads, kind="stable")[: min(w - 1, 2 * _PARTNERS)]
        vq = vals[rows[others]]
        gap = lp - loads[others]
        want = 2 * (vq[:, ci] + vq[:, cj]) + gap[:, None]
        found = _closest(sp2, want, gap, loads[others], big)
        if found is None:
            break
        qi, k, ip = found
        q = int(others[qi])
        kp = int(op[ip])
        pa, pb = int(ci[kp]), int(cj[kp])
        qa, qb = int(ci[k]), int(cj[k])
        d = vp[pa] + vp[pb] - vals[rows[q, qa]] - vals[rows[q, qb]]
        rows[p, pa], rows[q, qa] = rows[q, qa], rows[p, pa]
        rows[p, pb], rows[q, qb] = rows[q, qb], rows[p, pb]
        rows[p].sort()
        rows[q].sort()
        loads[p] -= d
        loads[q] += d
        steps += 1
    return steps


def level_others(vals: np.ndarray, rows: np.ndarray, loads: np.ndarray, target: float,
                 max_steps: int, pair_steps: int, rounds: int, stop_at: float | None = None) -> None:
    """Where polish stopped above ``target``: level the parts other than the heaviest,
    then polish all again, ``rounds`` times while the max load falls.

    Polish only trades with the heaviest part ``p``. Where every trade that
    lowers ``p`` would push its partner over ``p``'s load (two parts tied at
    the top; the part holding the largest item can only take small fillers
    from another heavy part), the max stays. Polishing the others alone (their
    max falls, none goes above it, so none above ``p``) gives ``p`` partners
    with room. ``pair_steps`` two-for-two swaps join both polishes (0: none).
    Updates ``rows`` and ``loads`` in place; never raises the max.
    """
    w = rows.shape[0]
    if w < 3:
        return
    for _ in range(rounds):
        top = loads.max()
        if top <= target or (stop_at is not None and time.perf_counter() >= stop_at):
            return
        keep = np.flatnonzero(np.arange(w) != int(np.argmax(loads)))
        sub_rows, sub_loads = rows[keep], loads[keep]  # copies
        polish(vals, sub_rows, sub_loads, 0, max_steps, stop_at=stop_at)
        if pair_steps:
            polish_pairs(vals, sub_rows, sub_loads, 0, pair_steps)
        rows[keep], loads[keep] = sub_rows, sub_loads
        polish(vals, rows, loads, target, max_steps, stop_at=stop_at)
        if pair_steps and loads.max() > target:
            polish_pairs(vals, rows, loads, target, pair_steps)
        if loads.max() >= top:
            return
