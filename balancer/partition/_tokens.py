"""A second per-part cap: compute balanced under a limit on tokens (activation memory).

Balancing compute alone (``L^2 + 256 L`` per sample) leaves the tokens per
rank (``sum L``) at max/mean ~1.05 (W = 8-16, B = 32, Zipf lengths): ranks
with the same compute hold different mixes of long and short sequences. Here
every part must also satisfy ``tokens <= cap``.

A single swap moves compute and tokens together (both grow with length), at
a rate ``dc / dt = L_a + L_b + 256``: low for short items, high for long ones.
So tokens move between two parts at nearly constant compute by a
*two-for-two* swap (two medium items one way, a long and a short one back).
:func:`_best_move` searches both kinds for one pair of parts ``(p, q)``:

* single swaps: the ``B x B`` moves ``(dc, dt)`` inside the allowed windows;
* two-for-two (:func:`_two_for_two`): a pair of ``p``'s items for a pair of
  ``q``'s. Each pair of ``p`` can take the pairs of ``q`` in a range of
  ``q``'s pairs sorted by compute; the ranges whose best candidate could
  score best (most tokens moved in the repair, ``dc`` nearest the level in
  polish) are checked first, up to a budget of candidates.

Two phases on a compute-balanced partition (``rows`` [W, B] of sorted
positions, as ``_solve`` leaves it):

1. repair: while a part has more than ``cap`` tokens, move tokens out of the
   fullest one to one of the parts with most room. The compute of both parts
   may rise to ``max(current max, target)``; when no move fits, that allowance
   grows in steps (``_SLACK``) -- the cap is hard, compute is traded;
2. polish: while the max compute load is above ``target``, the move that
   lowers the heaviest part most among those keeping both parts within ``cap``;
   where there is none, a *relay* through a third part (:func:`_relay`): the
   partner may go over the cap, and passes the excess on to a part with room.
   Where relays stop too, a *wide* single-swap search with every lighter part
   (:func:`_wide_single`, up to ``_WIDE_PARTNERS``), which from then on goes
   first. Polish alone would have stopped there, so the result is never
   worse; past W ~ 32 it is often much better (W = 128, 1.02x: median
   3.9e-3 -> 4.8e-4 above the compute bound, ``bench_partition.py --only tokens``).

If the result is still above ``target`` (up to ``_DEAL_MAX_ITEMS`` items),
both phases run again from a second start, :func:`deal_by_room`, and the
partition with the lower max compute is kept. Where the longest items are
clipped to one length (17 % of the samples at 4096 here), an optimum gives
the parts with fewer of them the next-longest items, and a compute-only start
fills them with many medium ones instead -- too many tokens, which single and
two-for-two swaps rarely undo. Measured (``bench_partition.py --only tokens``,
20 seeds): at a 1.01x cap the median compute gap 2.8e-3 -> 1.8e-3 (W = 8),
5.0e-3 -> 4.0e-3 (12), 2.3e-3 -> 1.9e-3 (16); at 1.02x W = 16 8.4e-4 -> 9.3e-6.
Relays (same benchmark): instances within 1e-4 at 1.01x / 1.02x went from
6 / 10 to 7 / 10 of 20 (W = 8), 3 / 5 to 4 / 7 (12) and 8 / 11 to 9 / 12 (16),
never worse, for 6-56 ms more (median). On W = 8 seed 2 an exact solver finds
9.5e-5, which polish alone missed (4.0e-4) and the relay reaches (6.0e-5).

Above ``_DEAL_MAX_ITEMS`` the deal goes first, in chunks (``open //
_CHUNK_SHARE`` items a step, ~100 numpy steps at B = 32), under a cap
lowered by ``_CHUNK_MARGIN``. From the compute-first start the repair
needs ~150 moves per cap's worth of excess tokens, each ~1 ms at W = 1,024
(W = 1,024: 6-28 caps, 1.3-2.5 thousand moves, 1.4-2.2 s), and ends where
its growing compute allowance left it. The chunked deal needs almost no
repair; the compute-first start is its second try only where its excess is
at most ``_FIRST_EXCESS`` caps. Side by side (``bench_partition.py --only
tokens-scale``, and 4 seeds at W = 256-1,024 and 1.01-1.05x in a
throwaway run): 41 of 48 instances better, 2 worse, the median gap the
same (W = 256 at 1.05x) to 14x lower (W = 512 at 1.05x), 1.4-4x in the
other rows; 0.2-0.4 s instead of 0.9-2.3 s where only the deal runs. Its
limit is the clipped block again: at W = 1,024 and 1.02x the parts with
one more clipped item than the rest all end at the max (376 of 1,024),
and polish lowers one part a step.

Deterministic: stable sorts throughout, ties to the first candidate in search order.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from balancer.partition._bound import as_float, bound_sorted
from balancer.partition._solve import Solved, late, solve

__all__ = ["apply_token_cap", "cap_tokens", "check_tokens_met", "deal_by_room", "polish_capped", "token_cap"]

_TOKEN_SLACK = 0.01  # default max_tokens: (1 + this) * mean tokens per part
Move = tuple[int, int, tuple[int, ...], tuple[int, ...]]  # (p, q, columns in p, columns in q)

_PARTNERS = 6  # partners searched per step: the most token room / least compute
# Two-for-two candidates scored per pair of parts at most (see _two_for_two):
# in polish and relays, and in the repair.
_PAIR_CANDIDATES = 4096
_CLEAR_CANDIDATES = 2048
# Relay (polish stuck): first partners tried (the lightest), and parts with
# the most token room that may take the excess.
_RELAY_PARTNERS = 8
_RELAY_ROOMS = 4
_RELAY_SEARCHES = 256  # pair searches (_best_move calls) for relays per polish, at most
# Wide search (polish stuck after relays, W > _PARTNERS + 1): single swaps with
# up to this many of the lightest parts, all in one numpy search, at most
# _WIDE_SEARCHES times per polish (~0.7 ms each at 128 partners, B = 32).
_WIDE_PARTNERS = 128
_WIDE_SEARCHES = 512
# Repair: compute may rise to max(current max, bound * (1 + s)), smallest s first.
_SLACK = (1e-4, 1e-3, 1e-2, 1.0)
# A second start (deal_by_room, one numpy step per item) when the first misses
# the compute target, up to this many items.
_DEAL_MAX_ITEMS = 4096
# Above it, the chunked deal (open // _CHUNK_SHARE items a step) starts, under a
# cap lowered by _CHUNK_MARGIN so that the repair has little left to move; the
# compute-first start is then a second try where its excess tokens (over all
# parts) are at most _FIRST_EXCESS caps, whose repair is short.
_CHUNK_SHARE = 4
_CHUNK_MARGIN = 0.003
# Where the search misses the cap on at most this many items, every partition is
# tried (15,400 at 4 parts of 3, the most up to here: ~0.1 s, on that path only).
_EXACT_MAX_ITEMS = 12
_FIRST_EXCESS = 2.5


def token_cap(t: np.ndarray, w: int, max_tokens: float | None) -> float:
    """``max_tokens``, or by default ``(1 + _TOKEN_SLACK)`` times the mean per part.

    For integer tokens the cap is the largest integer it allows, kept as a
    Python int: part sums compare with it exactly (as a float, ``2**55 + 5``
    would read as ``2**55 + 8``).
    """
    if max_tokens is None:
        cap: float = (1 + _TOKEN_SLACK) * float(t.sum()) / w
    else:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, float, np.integer, np.floating)) \
                or not max_tokens >= 0 or not math.isfinite(max_tokens):
            raise ValueError(f"max_tokens={max_tokens!r}, expected a finite number >= 0")
        cap = max_tokens
    if t.dtype.kind in "iu":
        # No part holds more than all the tokens: a larger cap (2**63, 1e20)
        # allows the same partitions, and as a wider-than-int64 Python int it
        # overflowed the numpy comparisons (OverflowError).
        whole = math.floor(cap) if isinstance(cap, float) else int(cap)
        return min(whole, int(t.sum()))  # type: ignore[return-value]
    return float(cap)


def apply_token_cap(sol: Solved, t: np.ndarray, w: int, rtol: float,
                    max_tokens: float | None, stop_at: float | None = None) -> np.ndarray:
    """:func:`_search_capped`; where it misses the cap on at most ``_EXACT_MAX_ITEMS``
    items, every partition is tried instead (the search is a heuristic: it missed
    the one partition within the default cap of a 9-item instance)."""
    try:
        return _search_capped(sol, t, w, rtol, max_tokens, stop_at)
    except CapMissed:
        if t.size > _EXACT_MAX_ITEMS:
            raise
    cap = token_cap(t, w, max_tokens)
    tok = t[sol.order]
    best: tuple[Any, ...] | None = None
    for parts in _equal_partitions(tuple(range(t.size)), t.size // w):
        rows = np.array(parts, np.int64)
        if max(part_tokens(tok, rows)) <= cap:
            key = (sol.vals[rows].sum(axis=1).max(), parts)
            best = key if best is None or key < best else best
    if best is None:
        raise ValueError(f"max_tokens={cap!r} cannot be met: no partition into {w} parts of "
                         f"{t.size // w} has at most that many tokens in every part (all were tried)")
    return np.array(best[1], np.int64)


def _equal_partitions(items: tuple[int, ...], b: int) -> Any:
    """Every partition of ``items`` (ascending) into parts of ``b``, each part ascending,
    the parts in order of their first items (each partition once)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, b - 1):
        left = tuple(i for i in rest if i not in others)
        for tail in _equal_partitions(left, b):
            yield [[first, *others], *tail]


def _search_capped(sol: Solved, t: np.ndarray, w: int, rtol: float,
                   max_tokens: float | None, stop_at: float | None = None) -> np.ndarray:
    """``sol.rows`` changed so that every part has at most the token cap (or raise).

    ``stop_at`` (a ``time.perf_counter()`` deadline) ends the compute polish
    and skips the second start; the repair always runs to the end, as the
    cap is hard.

    Raises:
        ValueError: the cap is below ``lower_bound(tokens)`` (no partition meets
            it), or neither the repaired partition nor the one that balances
            tokens alone meets it.
    """
    cap = token_cap(t, w, max_tokens)
    floor = _token_floor(t, w)
    if cap < floor:
        raise _cannot_meet(cap, w, t.size // w, floor)
    v = sol.vals
    target = sol.bound * (1 + rtol) if rtol > 0 else sol.bound
    tok = t[sol.order]
    steps = 4 * w + 64
    tries: list[tuple[np.ndarray, np.ndarray]] = []  # capped and polished (rows, loads)
    excess = float(np.maximum(tok[sol.rows].sum(axis=1) - cap, 0).sum())
    if v.size > _DEAL_MAX_ITEMS and excess > 0:
        # At scale the chunked deal starts: it repairs with few moves, where the
        # compute-first start needs ~2 per cap's worth of excess tokens (see the
        # module's docstring).
        rows = deal_by_room(v, tok, w, cap * (1 - _CHUNK_MARGIN), _CHUNK_SHARE)
        loads = v[rows].sum(axis=1)
        if cap_tokens(v, tok, rows, loads, cap, sol.bound, steps):
            polish_capped(v, tok, rows, loads, cap, target, steps, stop_at)
            tries.append((rows, loads))
    if not tries or (tries[0][1].max() > target and excess <= _FIRST_EXCESS * cap and not late(stop_at)):
        rows, loads = sol.rows.copy(), sol.loads.copy()
        if not cap_tokens(v, tok, rows, loads, cap, sol.bound, steps):
            # Start from the partition that balances tokens alone instead.
            alt = solve(t, w, 1e-5)
            rank = np.empty(t.size, np.int64)
            rank[sol.order] = np.arange(t.size)
            rows = np.sort(rank[alt.order[alt.rows]], axis=1)
            check_tokens_met(tok, rows, cap, w, floor)
            loads = v[rows].sum(axis=1)
        polish_capped(v, tok, rows, loads, cap, target, steps, stop_at)
        tries.append((rows, loads))
    if min(got[1].max() for got in tries) > target and v.size <= _DEAL_MAX_ITEMS and not late(stop_at):
        # Second start, dealt with both sums in view.
        rows = deal_by_room(v, tok, w, cap)
        loads = v[rows].sum(axis=1)
        if cap_tokens(v, tok, rows, loads, cap, sol.bound, steps):
            polish_capped(v, tok, rows, loads, cap, target, steps, stop_at)
            tries.append((rows, loads))
    rows = min(tries, key=lambda got: got[1].max())[0]  # the first of equals
    check_tokens_met(tok, rows, cap, w, floor)  # exact sums: the search's running float sums may be an ulp off
    return rows


def deal_by_room(vals: np.ndarray, tok: np.ndarray, w: int, cap: float, share: int | None = None) -> np.ndarray:
    """A start that deals items largest first with compute and tokens in view: rows [W, B].

    Each item goes to the open part with the largest compute still missing
    (to the mean) per token of room left under ``cap``, among the parts that
    can take it and still fill their other slots with the smallest tokens.
    Long items (the most compute per token) thus go where compute is short
    and tokens are scarce -- the parts with fewer of the very longest items,
    which a compute-only start fills with many medium ones instead.

    ``share``: one item a step (``None``), or the next ``open // share`` items
    a step (at least one), largest to the part with the largest key, on to
    the ``m``-th: ~``share * B`` numpy steps instead of ``N``.
    """
    n = vals.size
    b = n // w
    mean = float(vals.sum()) / w
    comp = np.zeros(w)
    toks = np.zeros(w)
    count = np.zeros(w, np.int64)
    rows = np.empty((w, b), np.int64)
    least = float(tok.min()) if n else 0.0
    i = n  # the items below i are still to deal
    while i > 0:
        open_ = count < b
        m = 1 if share is None else min(i, max(1, int(open_.sum()) // share))
        room = cap - toks
        # The chunk's largest item decides which parts can take one of it.
        fits = open_ & (room - tok[i - 1] - (b - count - 1) * least >= 0)
        if np.count_nonzero(fits) < m:
            fits = open_
        key = np.where(fits, (mean - comp) / np.maximum(room, 1.0), -np.inf)
        # The largest key (ties to the lowest part) takes the largest item.
        parts = np.array([int(np.argmax(key))]) if m == 1 else np.argsort(-key, kind="stable")[:m]
        items = np.arange(i - 1, i - 1 - m, -1)
        rows[parts, b - 1 - count[parts]] = items
        comp[parts] += vals[items]
        toks[parts] += tok[items]
        count[parts] += 1
        i -= m
    if share is not None:
        rows.sort(axis=1)  # a part's items came in falling order, but not every step
    return rows


def _token_floor(t: np.ndarray, w: int) -> int | float:
    """What every partition's fullest part holds at least: exact for integer
    tokens, lowered as :func:`~balancer.partition.lower_bound` for floats."""
    floor = bound_sorted(np.sort(t), w)
    return floor if t.dtype.kind in "iu" else as_float(floor, t.size)


def part_tokens(tok: np.ndarray, rows: np.ndarray) -> list[int] | list[float]:
    """Tokens per part of ``rows``: exact int sums, or correctly rounded float
    sums (``math.fsum``: independent of the order the items are added in)."""
    if tok.dtype.kind in "iu":
        return [int(v) for v in tok[rows].sum(axis=1)]
    return [math.fsum(r) for r in tok[rows].tolist()]


class CapMissed(ValueError):
    """The search found no partition within a cap at or above the proven minimum
    (one may exist): a ``ValueError`` to the caller."""


def _cannot_meet(cap: float, w: int, b: int, floor: int | float) -> ValueError:
    """The error for a cap below what any partition into ``w`` parts of ``b`` meets."""
    return ValueError(f"max_tokens={cap!r} cannot be met: every partition into {w} parts of "
                      f"{b} has a part with >= {floor} tokens (lower_bound of tokens)")


def check_tokens_met(tok: np.ndarray, rows: np.ndarray, cap: float, w: int,
                     floor: int | float | None) -> None:
    """Raise ``ValueError`` (cap, best found, proven minimum) if a part of ``rows`` exceeds ``cap``."""
    best = max(part_tokens(tok, rows))
    if best > cap:
        if floor is None:
            floor = _token_floor(tok, w)
        if floor >= best:  # the best found is the minimum (one item or one part a part: forced)
            raise _cannot_meet(cap, w, tok.size // w, floor)
        # The cap is at or above the proven minimum here: the search missed
        # it (a cap below the minimum is refused before the search).
        raise CapMissed(f"max_tokens={cap!r} was not met: the best partition found has {best} "
                         f"tokens in a part and no partition has fewer than {floor}; one within "
                         "the cap may exist that the search missed")


def cap_tokens(vals: np.ndarray, tok: np.ndarray, rows: np.ndarray, loads: np.ndarray,
               cap: float, bound: float, max_steps: int) -> bool:
    """Repair ``rows``/``loads`` in place until every part has ``<= cap`` tokens.

    Args:
        vals: [N] compute workloads sorted ascending.
        tok: [N] tokens of the same (sorted) positions.
        rows: [W, B] sorted positions per part; updated in place.
        loads: [W] compute loads; updated in place.
        cap: the token cap per part.
        bound: the compute lower bound (compute may rise to ``bound * (1 + s)``
            for the smallest ``s`` in ``_SLACK`` that admits a move).
        max_steps: at most this many moves.

    Returns:
        Whether every part ends at ``<= cap`` tokens.
    """
    tsum = tok[rows].sum(axis=1)
    level = 0  # the compute allowance that last admitted a move: start one below it
    for _ in range(max_steps):
        p = int(np.argmax(tsum))
        excess = float(tsum[p] - cap)
        if excess <= 0:
            return True
        partners = _partners(tsum, p)
        move = None
        for lev in range(max(0, level - 1), len(_SLACK)):
            level = lev
            allowed = max(float(loads.max()), float(bound) * (1 + _SLACK[lev]))
            for q in partners:
                room = float(cap - tsum[q])
                if room <= 0:
                    continue
                # Out of p: tokens in (0, room], both compute loads <= allowed;
                # the most tokens (up to the excess) first, then the lower pair.
                found = _best_move(vals, tok, rows, p, q,
                                   (float(loads[p]) - allowed, allowed - float(loads[q])),
                                   (1e-9, room), loads, clear=excess)
                if found is not None and (move is None or found[0] < move[0]):
                    move = found
            if move is not None:
                break
        if move is None:
            return False
        _apply(vals, tok, rows, loads, tsum, move[1])
    return bool(tsum.max() <= cap)


def polish_capped(vals: np.ndarray, tok: np.ndarray, rows: np.ndarray, loads: np.ndarray,
                  cap: float, target: float, max_steps: int, stop_at: float | None = None) -> None:
    """Lower the max compute load towards ``target``, every part staying ``<= cap`` tokens
    (until ``stop_at``, a ``time.perf_counter()`` deadline, if given)."""
    tsum = tok[rows].sum(axis=1)
    one = 1.0 if vals.dtype.kind != "f" else float(np.spacing(loads.max()))  # float: the least change that counts
    budget = [_RELAY_SEARCHES]
    ascending = tok.dtype.kind in "iu" and bool(np.all(tok[1:] >= tok[:-1]))  # see _wide_single
    # Wide searches so far. The first runs where polish and relays stall, and
    # polish goes on only if it found a move; from then on it goes first.
    searches = 0
    for _ in range(max_steps):
        p = int(np.argmax(loads))
        if loads[p] <= target or late(stop_at):
            return
        move = None
        if 0 < searches < _WIDE_SEARCHES:
            searches += 1
            move = _wide_single(vals, tok, rows, loads, tsum, cap, p, one, ascending)
        for q in ([] if move is not None else _partners(loads, p)):
            gap = float(loads[p] - loads[q])
            if gap <= one:
                continue
            found = _best_move(vals, tok, rows, p, q, (one, gap - one),
                               (float(tsum[p] - cap), float(cap - tsum[q])), loads)
            if found is not None and (move is None or found[0] < move[0]):
                move = found
        if move is None:
            if _relay(vals, tok, rows, loads, tsum, cap, p, one, budget):
                continue
            if searches or not _WIDE_SEARCHES or rows.shape[0] <= _PARTNERS + 1:
                return
            searches += 1
            move = _wide_single(vals, tok, rows, loads, tsum, cap, p, one, ascending)
            if move is None:
                return
        _apply(vals, tok, rows, loads, tsum, move[1])


def _relay(vals: np.ndarray, tok: np.ndarray, rows: np.ndarray, loads: np.ndarray, tsum: np.ndarray,
           cap: float, p: int, one: float, budget: list[int]) -> bool:
    """Lower the heaviest part ``p`` through a third part; whether a relay was applied.

    Polish stops where every swap that lowers ``p`` would push its partner
    over the cap: the parts with compute to spare are full of tokens, the
    parts with token room are heavy too. A relay lets the partner ``q`` take
    up to the largest token room of any part beyond the cap, then passes that
    excess on from ``q`` to a part ``r`` with room. Both swaps keep the parts
    they touch below ``p``'s old load, so the max never rises; polish runs on
    from the result, so a partition is never worse than where polish alone
    would have stopped. Among the ``_RELAY_PARTNERS`` lightest partners and
    the ``_RELAY_ROOMS`` parts with the most room, the relay whose first swap
    gives the lowest pair max wins. Each pair search spends one unit of
    ``budget`` (shared by one polish), which bounds the cost at large W.
    """
    lp = float(loads[p])
    others = [int(q) for q in np.argsort(loads, kind="stable") if q != p]
    rooms = [r for r in sorted(others, key=lambda r: (float(tsum[r]), r)) if tsum[r] < cap][:_RELAY_ROOMS]
    if not rooms:
        return False
    spare = float(cap - tsum[rooms[0]])
    limit = lp - one  # every part touched ends at most this
    best: tuple[float, Move, Move | None] | None = None
    for q in others[:_RELAY_PARTNERS]:
        gap = lp - float(loads[q])
        if gap <= one:
            continue
        if budget[0] <= 0:
            break
        budget[0] -= 1
        found = _best_move(vals, tok, rows, p, q, (one, gap - one),
                           (float(tsum[p] - cap), float(cap - tsum[q]) + spare), loads)
        if found is None or (best is not None and found[0] >= best[0]):
            continue
        saved = rows[[p, q]].copy(), loads.copy(), tsum.copy()
        _apply(vals, tok, rows, loads, tsum, found[1])
        excess = float(tsum[q] - cap)
        fix: tuple[float, Move] | None = None
        if excess > 0:
            for r in rooms:
                room = float(cap - tsum[r])
                if r == q or room < excess:
                    continue
                budget[0] -= 1
                f = _best_move(vals, tok, rows, q, r, (float(loads[q]) - limit, limit - float(loads[r])),
                               (excess, room), loads)
                if f is not None and (fix is None or f[0] < fix[0]):
                    fix = f
        if excess <= 0 or fix is not None:
            best = (found[0], found[1], None if fix is None else fix[1])
        rows[[p, q]], loads[:], tsum[:] = saved
    if best is None:
        return False
    _apply(vals, tok, rows, loads, tsum, best[1])
    if best[2] is not None:
        _apply(vals, tok, rows, loads, tsum, best[2])
    return True


def _wide_single(vals: np.ndarray, tok: np.ndarray, rows: np.ndarray, loads: np.ndarray, tsum: np.ndarray,
                 cap: float, p: int, one: float, ascending: bool = False) -> tuple[float, Move] | None:
    """The single swap of ``p`` with any lighter part (up to ``_WIDE_PARTNERS``, the
    lightest) that lowers the pair's max most, both parts staying ``<= cap``.

    Polish searches ~6 partners per step, single and two-for-two swaps; past
    W ~ 32 the partner that has a fitting swap is often further down the
    loads (in a full search at W = 64, the partners used sat at load rank 3
    to 15 in the median, up to 50). Here all of them at once, single swaps
    only: for item ``i`` of ``p`` and part ``q`` the compute window is a range
    of ``q``'s sorted row, found for every ``(q, i)`` with one
    ``searchsorted`` over the rows laid end to end (each offset past the one
    before), so the work is the candidates in the window, not ``W x B^2``.
    Ties go to the first candidate: partners by index, then items of ``p``,
    then items of the partner.

    ``ascending``: the (integer) tokens never fall along the sorted positions,
    as when cost grows with length. Then the token window is a range of each
    row too, and only the candidates in both ranges are listed: ~5,000
    instead of ~29,000 in the median at W = 128 (1.01-1.05x caps), the same
    swaps.
    """
    b = rows.shape[1]
    lp = float(loads[p])
    q = np.flatnonzero(loads < lp - one)
    if q.size > _WIDE_PARTNERS:
        q = np.sort(q[np.argsort(loads[q], kind="stable")[:_WIDE_PARTNERS]])
    if q.size == 0:
        return None
    k = q.size
    cp, tp = vals[rows[p]].astype(np.float64), tok[rows[p]].astype(np.float64)
    cq, lq = vals[rows[q]].astype(np.float64), loads[q].astype(np.float64)
    # cq[j] in [cp[i] - (lp - lq) + one, cp[i] - one]: dc >= one, lq + dc <= lp - one.
    lo, hi = _row_ranges(cq, cp[None, :] - (lp - lq)[:, None] + one, cp[None, :] - one)
    if ascending:
        # dt in [tsum[p] - cap, cap - tsum[q]]: tq[j] in [tp[i] - room, tp[i] - out], a range of the row.
        room = (cap - tsum[q]).astype(np.float64)[:, None]
        lo_t, hi_t = _row_ranges(tok[rows[q]].astype(np.float64), tp[None, :] - room, tp[None, :] - float(tsum[p] - cap))
        lo, hi = np.maximum(lo, lo_t), np.minimum(hi, hi_t)
    cnt = np.maximum(hi - lo, 0)
    total = int(cnt.sum())
    if total == 0:
        return None
    src = np.repeat(np.arange(k * b), cnt)  # (part, item of p), flat
    j = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt) + lo[src]  # into cq, flat
    kq, i = src // b, src % b
    dc = cp[i] - cq.ravel()[j]
    dt = tp[i] - tok[rows[q].ravel()[j]].astype(np.float64)
    # Re-checked exactly: with float costs the offsets can blur a window's ends
    # (a swap right at an end may be missed; none outside is taken).
    ok = ((dc >= one) & (lq[kq] + dc <= lp - one) & (dt >= float(tsum[p] - cap))
          & (dt <= (cap - tsum[q]).astype(np.float64)[kq]))
    if not ok.any():
        return None
    s = np.where(ok, np.maximum(lp - dc, lq[kq] + dc), np.inf)
    x = int(np.argmin(s))
    return float(s[x]), (p, int(q[kq[x]]), (int(i[x]),), (int(j[x] - kq[x] * b),))


def _row_ranges(keys: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every row ``r`` of ``keys`` [k, b] (each ascending) and query ``c``:
    the flat range ``[lo, hi)`` of ``keys.ravel()`` whose keys lie in
    ``[low[r, c], high[r, c]]`` (``low``/``high`` broadcast to [k, Q]).

    One ``searchsorted`` over the rows laid end to end, each offset past the
    one before; the bounds are clipped to just outside the keys' span first,
    so no range leaves its row. With float keys the offsets can blur a bound
    that falls right at a key: callers re-check what they take.
    """
    k = keys.shape[0]
    lo_v, hi_v = float(keys[:, 0].min()), float(keys[:, -1].max())
    off = (np.arange(k, dtype=np.float64) * (hi_v - lo_v + 4.0))[:, None]
    flat = (keys + off).ravel()
    # np.minimum(np.maximum(...)) is np.clip without its per-call dtype checks.
    lo = np.searchsorted(flat, (np.minimum(np.maximum(low, lo_v - 1), hi_v + 1) + off).ravel(), side="left")
    hi = np.searchsorted(flat, (np.minimum(np.maximum(high, lo_v - 1), hi_v + 1) + off).ravel(), side="right")
    return lo, hi


def _partners(key: np.ndarray, p: int) -> list[int]:
    """The ``_PARTNERS`` parts other than ``p`` with the smallest ``key`` (ties by
    index): token sums in repair (most room), compute loads in polish."""
    order = np.argsort(key, kind="stable")
    out: list[int] = [int(q) for q in order[: _PARTNERS + 1] if q != p][:_PARTNERS]
    return out


def _best_move(vals: np.ndarray, tok: np.ndarray, rows: np.ndarray, p: int, q: int,
               win_c: tuple[float, float], win_t: tuple[float, float], loads: np.ndarray,
               clear: float | None = None) -> tuple[float, Move] | None:
    """Best single or two-for-two swap p <-> q moving ``(dc, dt)`` (out of p) in the windows.

    Scored by the pair's new compute max; with ``clear`` a move that moves at
    least ``clear`` tokens beats every one that does not.
    """
    b = rows.shape[1]
    cp, tp = vals[rows[p]].astype(np.float64), tok[rows[p]].astype(np.float64)
    cq, tq = vals[rows[q]].astype(np.float64), tok[rows[q]].astype(np.float64)
    dc = (cp[:, None] - cq[None, :]).ravel()
    dt = (tp[:, None] - tq[None, :]).ravel()
    lp, lq = float(loads[p]), float(loads[q])

    def score(c: np.ndarray, t: np.ndarray) -> np.ndarray:
        s: np.ndarray = np.maximum(lp - c, lq + c)
        if clear is not None:
            # The tokens still in excess afterwards first (as a fraction, so any
            # token beats any compute), then the pair's compute.
            s = (1.0 - np.minimum(t, clear) / clear) + 1e-6 * s / max(lp, lq, 1.0)
        return s

    ok = (dc >= win_c[0]) & (dc <= win_c[1]) & (dt >= win_t[0]) & (dt <= win_t[1])
    best: tuple[float, Move] | None = None
    if ok.any():
        s = np.where(ok, score(dc, dt), np.inf)
        i = int(np.argmin(s))
        best = (float(s[i]), (p, q, (i // b,), (i % b,)))
        if clear is None or dt[i] >= clear:
            return best  # a single swap that does it all: no pair search
    pair = _two_for_two(cp, tp, cq, tq, win_c, win_t, score, (lp - lq) / 2, clear)
    if pair is not None and (best is None or pair[0] < best[0]):
        best = (pair[0], (p, q, pair[1], pair[2]))
    return best


def _two_for_two(cp: np.ndarray, tp: np.ndarray, cq: np.ndarray, tq: np.ndarray,
                 win_c: tuple[float, float], win_t: tuple[float, float],
                 score: Callable[[np.ndarray, np.ndarray], np.ndarray],
                 middle: float, clear: float | None) -> tuple[float, tuple[int, int], tuple[int, int]] | None:
    """The best two-for-two swap found: ``(score, items of p, items of q)``, or None.

    A two-for-two swap trades a pair of ``p``'s items for a pair of ``q``'s:
    ``dc = cP - cQ`` and ``dt = tP - tQ`` over the ``B (B - 1) / 2`` pairs of
    each side (distinct items by construction). With ``q``'s pairs sorted by
    ``cQ``, the compute window leaves each pair of ``p`` a range of them.
    At B = 32 some 125,000 candidates lie in the compute window on average
    (the recorded searches below), too many to score at every step; the
    ranges are ranked by what their best candidate could reach and scored
    in full, best first, until the budget is spent:

    * repair (``clear``): by the most tokens the pair of ``p`` can move,
      ``tP`` minus the least ``tQ`` in its range (a sparse-table range
      minimum; the token room aside), up to ``clear``; ``_CLEAR_CANDIDATES``;
    * polish (no ``clear``): by how close ``dc`` can come to ``middle``, the
      value that levels both parts (the nearest ``cQ`` in the range, tokens
      aside), among the ranges whose least and most ``tQ`` do not rule the
      token window out; ``_PAIR_CANDIDATES``.

    Recorded on five benchmark instances (W = 16-128, caps 1.01-1.02x) and
    checked against every candidate, the search that took candidates in
    ``dc`` order up to 8,192 found the best repair move in 27 % of 4,126
    searches and the best polish move in 65 % of 812 (those with any move);
    this finds them in 96 % and 97 %, in 0.6x and 0.9x the time.
    """
    ia, ka = _triu(cp.size)
    c_p, t_p = cp[ia] + cp[ka], tp[ia] + tp[ka]
    c_q, t_q = cq[ia] + cq[ka], tq[ia] + tq[ka]
    oq = np.argsort(c_q, kind="stable")
    c_q, t_q = c_q[oq], t_q[oq]
    lo = np.searchsorted(c_q, c_p - win_c[1], side="left")
    hi = np.searchsorted(c_q, c_p - win_c[0], side="right")
    cnt = np.maximum(hi - lo, 0)
    if clear is not None:
        least = _range_min(t_q[None, :], lo, hi)[0]  # inf where the range is empty
        most = np.minimum(t_p - least, clear)
        rank = np.where(most >= win_t[0], -most, np.inf)
        budget = _CLEAR_CANDIDATES
    else:
        least, neg_most = _range_min(np.stack([t_q, -t_q]), lo, hi)
        fits = (t_p - least >= win_t[0]) & (t_p + neg_most <= win_t[1])
        n = c_q.size
        at = np.searchsorted(c_q, c_p - middle)  # nearest cQ: at or just below, clipped to the range
        top = np.minimum(hi - 1, n - 1)
        near = np.minimum(np.abs(c_p - middle - c_q[np.maximum(np.minimum(np.maximum(at, lo), top), 0)]),
                          np.abs(c_p - middle - c_q[np.maximum(np.minimum(np.maximum(at - 1, lo), top), 0)]))
        rank = np.where(fits, near, np.inf)
        budget = _PAIR_CANDIDATES
    order = np.argsort(rank, kind="stable")
    cnt_o = cnt[order]
    take = order[(rank[order] < np.inf) & (np.cumsum(cnt_o) - cnt_o < budget)]
    if take.size == 0:
        return None
    k = cnt[take]
    first = np.repeat(take, k)
    second = np.arange(int(k.sum())) + np.repeat(lo[take] - (np.cumsum(k) - k), k)
    c2, t2 = c_p[first] - c_q[second], t_p[first] - t_q[second]
    # The compute window again: the ranges came from shifted bounds, which can round.
    ok = (c2 >= win_c[0]) & (c2 <= win_c[1]) & (t2 >= win_t[0]) & (t2 <= win_t[1])
    if not ok.any():
        return None
    s = np.where(ok, score(c2, t2), np.inf)
    x = int(np.argmin(s))
    f, g = int(first[x]), int(oq[second[x]])
    return float(s[x]), (int(ia[f]), int(ka[f])), (int(ia[g]), int(ka[g]))


@functools.lru_cache(maxsize=8)
def _triu(b: int) -> tuple[np.ndarray, np.ndarray]:
    """The index pairs ``i < k`` of ``b`` items."""
    ia, ka = np.triu_indices(b, 1)
    return ia, ka


def _range_min(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``x[r, lo:hi].min()`` for every row ``r`` of ``x`` [m, n] and query (``inf`` where
    ``lo >= hi``), by one sparse table for all rows: [m, Q]."""
    m, n = x.shape
    cnt = hi - lo
    widest = int(cnt.max()) if cnt.size else 0
    if widest <= 0:
        return np.full((m, cnt.size), np.inf)
    table = np.empty((widest.bit_length(), m, n))  # level k: minima of 2**k items from each start
    table[0] = x
    span = 1
    for k in range(1, table.shape[0]):
        np.minimum(table[k - 1, :, : n - 2 * span + 1], table[k - 1, :, span: n - span + 1],
                   out=table[k, :, : n - 2 * span + 1])
        span *= 2
    k = np.frexp(np.maximum(cnt, 1))[1] - 1  # floor(log2(cnt))
    a = table[k, :, np.minimum(lo, n - 1)]  # [Q, m]
    b = table[k, :, np.minimum(np.maximum(hi - (1 << k), 0), n - 1)]
    return np.where(cnt > 0, np.minimum(a, b).T, np.inf)


def _apply(vals: np.ndarray, tok: np.ndarray, rows: np.ndarray, loads: np.ndarray,
           tsum: np.ndarray, move: Move) -> None:
    """Swap items ``rows[p, ia]`` with ``rows[q, jb]``; update loads and token sums."""
    p, q, ia, jb = move
    a = rows[p, list(ia)].copy()
    bb = rows[q, list(jb)].copy()
    dc = vals[a].sum() - vals[bb].sum()
    dt = tok[a].sum() - tok[bb].sum()
    rows[p, list(ia)] = bb
    rows[q, list(jb)] = a
    rows[p].sort()
    rows[q].sort()
    loads[p] -= dc
    loads[q] += dc
    tsum[p] -= dt
    tsum[q] += dt
