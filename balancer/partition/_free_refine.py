"""Refinement of a free-size partition: moves and swaps that lower the heaviest part.

A move of item ``a`` from part ``p`` to ``q`` (or a swap of ``a`` for ``b`` in
``q``) leaves the pair's maximum at ``(L_p + L_q + |2 (a - b) - (L_p - L_q)|) / 2``;
it helps iff that is below ``L_p``. Two drivers, both respecting the count
bounds and the optional capacity on a second quantity:

* :func:`rounds` -- every part above the target meets one light part at once
  (one batch of numpy calls per round, however many parts it fixes);
* :func:`steps` -- the heaviest part against all (or many) partners, one move
  or swap per step, for what the rounds leave.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from balancer.partition._free_state import FreeState

__all__ = ["rounds", "steps"]

_PARTNERS = 8  # steps: swap partners searched per step when W is large


def rounds(st: FreeState, target: Any, lo: int, hi: int, cap: Any, max_rounds: int) -> None:
    """Parallel rounds: every part above ``target`` meets one light part at once.

    The ``m <= W / 2`` parts above target, heaviest first, are paired with
    the ``m`` lightest, lightest first; each pair makes its best move or
    swap (lowest pair maximum, as in :meth:`refine`). Pairs are disjoint,
    so a round is one batch of ~30 numpy calls however many parts it
    fixes. Items are located in their part with one flat ``searchsorted``
    on integer keys ``pair * (N + 1) + sorted position``: a value's global
    rank stands in for the value, which keeps float inputs exact too.
    """
    v, w, s, n = st.v, st.w, st.s, st.v.size
    v2 = 2 * v
    stride = n + 1
    for _ in range(max_rounds):
        order = np.argsort(st.loads, kind="stable")
        heavy = order[::-1][: w // 2]
        heavy = heavy[st.loads[heavy] > target]
        m = heavy.size
        light = order[:m]
        gap = st.loads[heavy] - st.loads[light]
        keep = gap > 0
        heavy, light, gap = heavy[keep], light[keep], gap[keep]
        m = heavy.size
        if m == 0:
            return
        by_part = np.argsort(st.part, kind="stable")
        starts = np.cumsum(st.counts) - st.counts
        pos_h, seg_h = _gather(by_part, starts, st.counts, heavy)
        pos_l, seg_l = _gather(by_part, starts, st.counts, light)
        key_h = seg_h * stride + pos_h
        segs = np.arange(m)
        # Candidates: (pair, heavy item, light item or -1, error).
        q_seg = np.concatenate([segs, seg_l])
        q_val = np.concatenate([gap, v2[pos_l] + gap[seg_l]])
        q_b = np.concatenate([np.full(m, -1), pos_l])
        rank = np.searchsorted(v2, q_val)
        at = np.searchsorted(key_h, q_seg * stride + rank)
        cand_j = np.concatenate([at - 1, at])
        cand_seg = np.concatenate([q_seg, q_seg])
        cand_val = np.concatenate([q_val, q_val])
        cand_b = np.concatenate([q_b, q_b])
        inside = (cand_j >= 0) & (cand_j < pos_h.size)
        cand_j = np.where(inside, cand_j, 0)
        inside &= seg_h[cand_j] == cand_seg
        a = pos_h[cand_j]
        err = np.abs(v2[a] - cand_val)
        ok = inside & (err < gap[cand_seg])
        is_move = cand_b < 0
        hs, ls = heavy[cand_seg], light[cand_seg]
        ok &= ~is_move | ((st.counts[hs] > lo) & (st.counts[ls] < hi))
        if s is not None:
            assert st.toks is not None, "toks come with sizes"
            d = s[a] - np.where(is_move, 0, s[np.maximum(cand_b, 0)])
            ok &= (st.toks[ls] + d <= cap) & (st.toks[hs] - d <= cap)
        idx = np.flatnonzero(ok)
        if idx.size == 0:
            return
        pick = idx[np.lexsort((err[idx], cand_seg[idx]))]
        first = np.ones(pick.size, bool)
        first[1:] = cand_seg[pick][1:] != cand_seg[pick][:-1]
        pick = pick[first]
        st.shift_many(a[pick], hs[pick], ls[pick])
        swaps = pick[~is_move[pick]]
        st.shift_many(cand_b[swaps], ls[swaps], hs[swaps])


def steps(st: FreeState, target: Any, lo: int, hi: int, cap: Any, max_steps: int) -> None:
    """Moves and swaps out of the heaviest part while they lower the pair's maximum.

    A move of item ``a`` from the heaviest part ``p`` to ``q`` (or a swap
    of ``a`` for ``b`` in ``q``) leaves the pair's maximum at
    ``(L_p + L_q + |2 (a - b) - (L_p - L_q)|) / 2``; the step takes the
    candidate with the lowest one, if it is below ``L_p``. Swap partners
    are all parts when ``W`` is small, else the ``_PARTNERS`` lightest and
    heaviest ones. Members are kept as one ascending position array per
    part, so a step touches ``O(items of p and partners)`` elements.
    """
    v, w, s = st.v, st.w, st.s
    big = np.inf if v.dtype.kind == "f" else np.iinfo(np.int64).max
    v2 = 2 * v
    by_part = np.argsort(st.part, kind="stable")
    members = np.split(by_part, np.cumsum(st.counts)[:-1])
    for _ in range(max_steps):
        loads = st.loads
        p = int(np.argmax(loads))
        lp = loads[p]
        if lp <= target:
            return
        in_p = members[p]  # ascending positions = ascending values
        if in_p.size == 0:
            return
        a2 = v2[in_p]
        gap = lp - loads  # [W]; want 2 a = gap (move) or 2 (a - b) = gap (swap)
        best_score, best = big, None
        if st.counts[p] > lo:
            qs = np.flatnonzero((st.counts < hi) & (gap > 0))
            if qs.size:
                ia = _nearest(a2, gap[qs])
                err = np.abs(a2[ia] - gap[qs])
                ok = err < gap[qs]
                if s is not None:
                    ok &= st.toks[qs] + s[in_p[ia]] <= cap  # type: ignore[index]
                score = np.where(ok, err + loads[qs], big)
                j = int(np.argmin(score))
                if score[j] < best_score:
                    best_score, best = score[j], (int(ia[j]), -1, int(qs[j]))
        if w > 3 * _PARTNERS:
            order = np.argsort(loads, kind="stable")
            cand = np.concatenate([order[:_PARTNERS], order[-_PARTNERS - 1 :]])
        else:
            cand = np.arange(w)
        cand = cand[(cand != p) & (gap[cand] > 0)]
        if cand.size:
            out = np.concatenate([members[q] for q in cand.tolist()])
            qb = np.repeat(cand, st.counts[cand])
            want = v2[out] + gap[qb]
            ia = _nearest(a2, want)
            err = np.abs(a2[ia] - want)
            ok = err < gap[qb]
            if s is not None:
                d = s[in_p[ia]] - s[out]
                ok &= (st.toks[qb] + d <= cap) & (st.toks[p] - d <= cap)  # type: ignore[index]
            score = np.where(ok, err + loads[qb], big)
            j = int(np.argmin(score)) if score.size else 0
            if score.size and score[j] < best_score:
                best_score, best = score[j], (int(ia[j]), int(out[j]), int(qb[j]))
        if best is None:
            return
        ia_, ib_, q = best
        a = int(in_p[ia_])
        members[p] = np.delete(in_p, ia_)
        st.shift_many(np.array([a]), np.array([p]), np.array([q]))
        members[q] = np.insert(members[q], np.searchsorted(members[q], a), a)
        if ib_ >= 0:
            members[q] = np.delete(members[q], np.searchsorted(members[q], ib_))
            st.shift_many(np.array([ib_]), np.array([q]), np.array([p]))
            members[p] = np.insert(members[p], np.searchsorted(members[p], ib_), ib_)


def _gather(by_part: np.ndarray, starts: np.ndarray, counts: np.ndarray,
            parts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Members of ``parts`` (ascending within each) and the index of their part in ``parts``."""
    c = counts[parts]
    seg = np.repeat(np.arange(parts.size), c)
    offset = np.arange(seg.size) - np.repeat(np.cumsum(c) - c, c)
    return by_part[starts[parts][seg] + offset], seg


def _nearest(sorted_vals: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Index of the entry of ascending ``sorted_vals`` nearest to each ``want``."""
    hi = np.minimum(np.searchsorted(sorted_vals, want), sorted_vals.size - 1)
    lo = np.maximum(hi - 1, 0)
    return np.where(np.abs(sorted_vals[lo] - want) <= np.abs(sorted_vals[hi] - want), lo, hi)
