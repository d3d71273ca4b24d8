"""The ``balanced_partition`` pipeline on validated workloads: sort, bound, start, refine.

1. :func:`sort_values` (stable: radix or tie-free keys) and prefix sums, shared by the bound
   and the start;
2. :func:`bound_sorted`: the target is ``bound * (1 + rtol)``; with two items
   a part the largest-with-smallest pairing is optimal and is returned at
   once (131072x2 Zipf: 168 -> 9 ms);
3. the start: capped LPT (``lpt``: a heap loop, or vectorised over parts for
   W >= 40) up to N = 8192, where it is the cheaper start and refinement
   closes the rest; the projected-load greedy :func:`fill` at scale
   (cardinality-aware, ``O(B / rows_per_step)`` numpy steps). If the start
   misses the target and the input is small, equal-size Karmarkar-Karp is
   tried too (it starts ~10x closer on smooth inputs). With ``B <= 8`` at
   scale, where re-matching has a short budget (W > 4096 at B = 8), KK is
   the start and ``fill`` only its fallback (KK gives up on heavy tails at
   once). Where the top tie block crowds full parts (Zipf lengths clipped at
   a maximum, :mod:`balancer.partition._crowded_start`), the crowded start:
   first above N = 16,384 with B <= 16 (the regular path is then its second
   try), otherwise a second try; a second try runs when the result ends
   more than 1e-3 above the bound, and the better one is kept (from N =
   1,025 also with one big item per part, as uniform B = 4 has);
4. for ``B <= 16``, re-matching (:mod:`balancer.partition._rematch`): single
   columns up to N = 1,024 with B > 4, else blocks of one or two columns; above N =
   16,384 only until within ``_REMATCH_RTOL`` (5e-5) of the bound, and the
   swaps are skipped when it gets there;
5. swap refinement under a *work budget*: parallel rounds (from N = 1,025 on),
   single best swaps for the heaviest part, two-for-two swaps for few parts;
   where those stop far above target with few parts (a tie at the top), the
   other parts levelled and the swaps run again (``level_others``). Every
   swap keeps the item counts and never raises the max, so stopping early is
   always safe.

Work is bounded by step counts derived from ``(W, B)`` alone, so the result
is a deterministic function of the input. An optional deadline (a
``time.perf_counter()`` value) is checked between steps as a safety net; a
deadline makes the result depend on the machine's speed.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from balancer.partition._bound import bound_sorted, prefix_sums
from balancer.partition._crowded_start import MISS as CROWDED_MISS
from balancer.partition._crowded_start import OTHER_GOALS, crowded_start
from balancer.partition._fill import fill
from balancer.partition._kk import kk_equal, kk_rows
from balancer.partition._lpt import lpt
from balancer.partition._refine import level_others, polish, polish_pairs, sort_values, swap_rounds
from balancer.partition._rematch import rematch_blocks, rematch_columns

__all__ = ["Solved", "equal_labels", "late", "solve"]

_LPT_MAX_ITEMS = 8192  # capped LPT (heap, or vectorised over parts for W >= 40) up to here
_KK_MAX_ITEMS = 16384  # try equal-size KK as a second start up to here
# fill deals ~B / _FILL_ROWS rows per step (~64 steps; ~32 from B = 256 on, where
# the parts are few and the items many, so coarser steps lose nothing measurable)
_FILL_ROWS = 64
# ... and 2 rows a step up to B = _FILL_TWO_ROWS_MAX_B, its full rounds alternating
# direction (the many-parts shapes; measured on fill alone while tuning: 8192x32
# fill 14 -> 12 ms, same quality; without alternating 8192x32 uniform ends 1.0e-4
# above the bound instead of 5e-5; two rows at B = 64 cost lognormal 2x in quality,
# and alternating at B >= 128 was mixed: 2048x128 uniform 2.8e-6 -> 5.5e-6,
# lognormal 2.8e-5 -> 1.5e-5, for 3-8 % more time)
_FILL_TWO_ROWS_MAX_B = 32
_ROUNDS = (8, 3)  # parallel swap rounds, N <= _LARGE and N > _LARGE
# Work budget (partner items searched): per parallel round, and for the whole
# single-swap polish. Large inputs get less: their start is already within
# ~1e-4 of the bound, and a polish step costs more there (it sorts W loads).
_ROUND_ITEMS: tuple[int | None, int | None] = (None, 1 << 14)
_POLISH_ITEMS: tuple[int | None, int | None] = (1 << 18, 1 << 12)
_POLISH_STEPS = 128  # single swaps at most (and 4W + 32): each costs ~15 numpy calls
_LARGE = 1 << 14
# N <= _LARGE: parallel rounds only while at least this many parts are above
# target. A round costs ~60 numpy calls whatever the number of heavy parts; with
# fewer it fixes at most 3 parts, where polish (all parts partners, ~12 calls a
# swap) is 2-4x cheaper per swap (measured when rounds still ran at N = 1,024:
# 8x128 lognormal 1.5 -> 1.0 ms, 16x64 lognormal 2.7 -> 1.8 ms; no config's
# quality worse). Below _ROUNDS_MIN_ITEMS there are no rounds at all.
_ROUND_MIN_HEAVY = (4, 1)
# Few items per part: column re-matching (``_rematch``) before the swaps, at most
# 8 cycles over the columns, _REMATCH_MOVES moves, and _REMATCH_ITEMS items in all
# (a move costs two sorts of W: 16 moves at W = 16,384, ~0.7 ms each)
_REMATCH_MAX_B = 16
_BLOCKS_MIN_ITEMS = 1025  # re-matching by blocks of two columns from here (rematch_blocks)
# ... and at every N for B <= _BLOCKS_MAX_B: four columns give 10 blocks, and the
# six pairs re-pair the parts' halves where single columns stall. Small shapes
# of bench_partition, 8 seeds, side by side: 256x4 uniform 1.9e-3 | 3.3e-3 ->
# 4.0e-4 | 6.1e-4 above the bound (median | worst) in 0.80 -> 1.11-1.14 ms; every
# other configuration identical (B = 8 at 128x8 was 2.3x slower for 2.8x better
# quality, so it keeps single columns below N = 1,025).
_BLOCKS_MAX_B = 4
_REMATCH_MOVES = 64
_REMATCH_ITEMS = 1 << 18
# ... but at least _REMATCH_MIN_MOVES (within 8 cycles and _REMATCH_MOVES): from
# W = 16,384 on, 16 moves cover fewer than two cycles of B = 4's 10 blocks, and
# uniform B = 4 ended 1.2-1.6e-4 above the bound in the median (16384x4 to
# 65536x4, 4 seeds), which the crowded second try then chased for up to 200 ms.
# With 32: 4.4-4.6e-5, and per-seed medians 1.3x slower (16384x4, 32768x4) or
# 2.8x faster (65536x4); every other distribution and B = 8, 16 unchanged
# (bench_partition.py --only scale --before e7d0b56 --seeds 4 --shapes ...).
_REMATCH_MIN_MOVES = 32
# At scale (N > _LARGE) re-matching stops within _REMATCH_RTOL of the bound (half
# the 1e-4), and the swaps go on towards rtol under their own budgets.
# The last moves to 1e-5 cost ~1 ms each at W = 16,384 and bought quality no
# target asks for. Side by side with the previous commit (partition_rows, median
# of 9 alternating calls, seed 0, slow CI box): 16384x16 lognormal 47.3 ->
# 29.7 ms, uniform 46.8 -> 37.3 ms, 8192x8 lognormal 20.0 -> 12.6 ms; 3 seeds
# (bench_partition.py --only scale --before 11c8634): 16384x16 uniform 1.8e-5 ->
# 4.5e-5 above the bound, lognormal 1.1e-5 -> 3.3e-5, B = 8 lognormal 1.4e-5 ->
# 2.9-3.5e-5; uniform B = 8 (never within 5e-5) unchanged. Once re-matching is
# by blocks (which takes uniform B = 8 there too) the swaps are skipped as well
# when it ends within _REMATCH_RTOL: 32768x8 uniform 60 -> 51 ms, lognormal
# 46 -> 40 ms and 3.3e-5 -> 4.7e-5 above the bound (throwaway A/B, 3 seeds).
_REMATCH_RTOL = 5e-5
# B <= _KK_FIRST_MAX_B at scale, where re-matching gets less than its full 8
# cycles (W > 4096 at B = 8): equal-size KK (B - 1 merges of W items) starts
# there, fill only where it gives up (heavy tails). Re-matching then ends ~2x
# closer (32768x8 uniform, 3 seeds: 1.1e-3 -> 5.0e-4 above the bound, median;
# 8192x8 3.1e-4 -> 2.2e-4; lognormal, Zipf and padded unchanged: KK gives up).
# With the full budget the fill start re-matches further (4096x8 uniform:
# 8.9e-5 against 1.3e-4 from KK), and at B = 16 too (16384x16 uniform 1.8e-5
# against 2.6e-5), so fill stays there. B = 4 always gets its full 8 cycles
# (32 moves, _REMATCH_MIN_MOVES), so fill starts it (uniform 16384x4 to
# 65536x4 end 4.4-4.6e-5 from fill, 4.5-4.8e-5 from KK; throwaway A/B, 4 seeds).
_KK_FIRST_MAX_B = 8
# After re-matching at scale, more than W / _PLATEAU_PARTS parts above target
# means the max is a plateau that many parts share (uniform B <= 8: 29-59 % of
# the parts): a swap lowers one part of it, and the rounds' and polish's budgets
# reach a few thousand. Measured after re-matching on 7 shapes (32768x8 ...
# 1024x16) x 3 distributions x 2 seeds: in the 7 instances past that line (all
# uniform B <= 8) they lowered the max by at most 1 % of its gap (8192x8:
# 2.66e-4 -> 2.63e-4 above the bound) for 2-16 ms; below it (Zipf, lognormal,
# B = 16 mostly) they can do more, and stay.
_PLATEAU_PARTS = 4
# The crowded start (_crowded_start) goes first above this many items (B <= 16),
# where a top tie block crowds the parts (Zipf B = 16): the regular path lost
# there on most seeds (16384x16: 8 of 8, 7e-3 to 2.4e-2 against 3.6e-5 to
# 1.4e-4; 8192x16: 16 of 16 above 1e-3) and both paths would run. Where the
# crowded start still misses 1e-3 the regular path is its second try. From
# 2048x16 (N = 32,768) to 8192x16 that is the same quality or better on 16
# seeds of bench_partition (2048x16 worst 5.0e-4 -> 3.0e-4) and 1.4-1.8x
# faster per call; 4096x16 is slower on seeds where the regular path alone
# was enough (seed 0: 6.8 -> 11.7 ms) and faster in the median over seeds.
# Below it, at 1024x16, crowded first lost quality (median 1.8e-4 -> 2.1e-4),
# so the crowded start is a second try there, where the regular result
# misses 1e-3 (the cheaper regular path is often close). After the crowded
# start the swaps run only up to N = 16,384: at 16384x16 they found nothing
# to trade (throwaway runs, 3 seeds, both versions of the cores), below they
# helped (1024x16 seed 2: 1.3e-4 -> 1.4e-5, first version). The second try
# also takes one big item per part (c = 1: uniform B = 4, whose length-4096
# samples cannot share a part): 65536x4 uniform 1.6e-3..4.6e-3 ->
# 0.9e-4..1.4e-4 above the bound (tests' generator, 4 seeds), at 2-3x the
# time of those calls (85-125 -> 245-285 ms as partition_rows on the slow CI
# box). Not below N = 1,025, where it would cost the 1 ms target (256x4
# uniform 1.0 -> 3.6 ms, quality unchanged).
_CROWDED_FIRST_ITEMS = 1 << 14
_TAIL_RTOL = 1e-4  # the crowded start's tail (equal_labels): same quality as 1e-5 on Zipf 16384x16 (8 seeds)
_PAIR_STEPS = 3  # two-for-two swaps when single swaps are stuck above target
_PAIR_MAX_PARTS = 32  # ... only for few parts: the step costs O(W) pair tables
# Up to N = 1,024 the refinement is all call overhead (a round ~60 numpy calls,
# a polish swap ~12, a two-for-two step ~50 us): swap rounds are skipped there,
# the polish gets more swaps and the two-for-two swaps (the way out of the
# polish's local optima) more steps. Measured side by side while tuning, on the
# small shapes of bench_partition (N <= 1,024, 4 distributions, 3 seeds):
# 256x4 uniform 0.98 -> 0.63 ms, 32x8 uniform 1.07 -> 0.67 ms, 64x16 uniform
# 1.22 -> 0.74 ms; quality within 1.2x or better (uniform 16x16 2.6e-5 ->
# 1.5e-5 above the bound, 64x16 2.9e-5 -> 3.4e-5).
_ROUNDS_MIN_ITEMS = 1025
# Below N = _SMALL_TRIES the second try is the crowded start with its own goal
# alone, for two or more big items per part (Zipf): one big item per part
# (uniform B = 4) changed no quality there for 3.6 ms at 256x4 (twelfth pass,
# see above), and the other goals for the cores changed no seed of 16x16 to
# 64x16 and 32x32 Zipf (16 seeds of bench_partition, throwaway A/B), for up to
# 3.6 ms more on a seed (64x16's slowest: 3.1 -> 6.7 ms).
_SMALL_TRIES = 1025
# Up to N = _LARGE with at most _PAIR_MAX_PARTS parts, where the swaps stop
# more than _LEVEL_ABOVE above target (the quality target's median): level the
# other parts and polish again (``level_others``), at most _LEVEL_ROUNDS
# rounds; then with two-for-two swaps as well where still as far. Elsewhere it
# seldom paid (bench_partition --only small, 8 seeds): closer than that,
# uniform 64x16 3.2e-5 -> 2.9e-5 in the median for 1.3x the time; with more
# parts, nothing at 128x8 and 256x4 uniform or 64x16 Zipf, for 1.1x.
_LEVEL_ROUNDS = 4
_LEVEL_ABOVE = 1e-4
_POLISH_STEPS_SMALL = 256
_PAIR_STEPS_SMALL = 6


@dataclasses.dataclass
class Solved:
    """A partition in sorted-position space."""

    order: np.ndarray
    """[N] original index of each sorted position."""
    vals: np.ndarray
    """[N] workloads sorted ascending."""
    rows: np.ndarray
    """[W, B] sorted positions per part, each row ascending."""
    loads: np.ndarray
    """[W] part loads (exact for integer workloads)."""
    bound: int | float
    """``lower_bound`` of the workloads (exact int for integer input); at two
    items a part the optimum itself."""


def solve(x: np.ndarray, num_parts: int, rtol: float, stop_at: float | None = None) -> Solved:
    """Partition validated workloads ``x`` [N] into ``num_parts`` parts of ``N / W``.

    Args:
        x: [N] int64 or float64 workloads (validated), N divisible by W, B >= 2, W >= 2.
        num_parts: W.
        rtol: refine until the max load is within ``rtol`` of the bound.
        stop_at: optional ``time.perf_counter()`` deadline for the refinement.
    """
    n, w = x.size, num_parts
    b = n // w
    order, v = sort_values(x)
    if b == 2:
        # Two items a part: the largest with the smallest, the second largest
        # with the second smallest, ... is optimal (if a part held the largest
        # item with anything but the smallest, swapping those two partners
        # lowers that part and raises the other to at most the same max).
        # The fill start took 170 ms for this at 131072x2 Zipf. Being optimal,
        # its max is the tightest lower bound, with no bound to compute.
        pairs = np.arange(w, dtype=np.int64)
        rows = np.stack([pairs, n - 1 - pairs], axis=1)
        loads = v[pairs] + v[n - 1 - pairs]
        return Solved(order, v, rows, loads, loads.max().item())
    prefix = prefix_sums(v)
    bound = bound_sorted(v, w, prefix=prefix)
    target = bound * (1 + rtol) if rtol > 0 else bound
    if v.dtype.kind == "i":
        target = int(target)
    alternate = b <= _FILL_TWO_ROWS_MAX_B
    # At scale re-matching stops once within _REMATCH_RTOL (the swaps go on to ``target``).
    loose = bound * (1 + _REMATCH_RTOL) if n > _LARGE else target
    loose = max(target, int(loose) if v.dtype.kind == "i" else loose)

    def crowded_with(min_big: int, goals: tuple[int, ...] = (0,)) -> tuple[np.ndarray, np.ndarray] | None:
        """The crowded start (None where the top tie block does not crowd the parts), refined."""
        got = crowded_start(v, w, prefix, target, bound, _fill_rows(b), alternate, equal_labels,
                            min_big=min_big, goals=goals)
        if got is not None and got[1].max() > target:
            refine(v, got[0], got[1], target, stop_at, loose, swaps=n <= _LARGE)
        return got

    # Above _CROWDED_FIRST_ITEMS at B <= 16, a top tie block that crowds the
    # parts gets the crowded start first; elsewhere it is a second try where
    # the regular path ends far above the bound.
    crowded = crowded_with(2) if n > _CROWDED_FIRST_ITEMS and b <= _REMATCH_MAX_B else None
    if crowded is not None:
        rows, loads = crowded
    else:
        rows, loads = _regular(v, w, prefix, target, stop_at, loose, alternate)
    if loads.max() > bound * (1 + CROWDED_MISS) and not late(stop_at):
        # Far above the bound: the other path, then the crowded start with the
        # best packing of its other goals for the cores; the best partition is
        # kept. From N = 1,025 the crowded start here also takes one big item
        # per part, and packs the cores by its other goals (_SMALL_TRIES).
        small = n < _SMALL_TRIES
        min_big = 2 if small else 1

        def other() -> tuple[np.ndarray, np.ndarray] | None:
            if crowded is not None:
                return _regular(v, w, prefix, target, stop_at, loose, alternate)
            return crowded_with(min_big)

        for attempt in (other,) if small else (other, lambda: crowded_with(min_big, OTHER_GOALS)):
            got = attempt()
            if got is None:
                break
            if got[1].max() < loads.max():
                rows, loads = got
            if loads.max() <= bound * (1 + CROWDED_MISS) or late(stop_at):
                break
    return Solved(order, v, rows, loads, bound)


def _regular(v: np.ndarray, w: int, prefix: np.ndarray, target: int | float, stop_at: float | None,
             loose: int | float, alternate: bool) -> tuple[np.ndarray, np.ndarray]:
    """The regular path of :func:`solve`: LPT, fill or KK as the start, then :func:`refine`."""
    n = v.size
    b = n // w
    # B <= 8 at scale with a short re-matching budget: KK first (_KK_FIRST_MAX_B).
    kk_first = n > _LPT_MAX_ITEMS and b <= _KK_FIRST_MAX_B and _rematch_moves(w, b) < 8 * b
    started = _kk_start(v, w) if kk_first else None
    if started is not None:
        rows, loads = started
    elif n <= _LPT_MAX_ITEMS:
        rows = lpt(v, w)
        loads = v[rows].sum(axis=1)
    else:
        rows, loads = fill(v, w, prefix, _fill_rows(b), alternate)
    if loads.max() > target and n <= _KK_MAX_ITEMS and not kk_first:
        # Smooth inputs: KK starts far closer than LPT. Heavy tails turn KK into
        # a long chain of single merges, visible in its first round.
        started = _kk_start(v, w)
        if started is not None and started[1].max() < loads.max():
            rows, loads = started
    if loads.max() > target:
        refine(v, rows, loads, target, stop_at, loose)
    return rows, loads


def equal_labels(x: np.ndarray, parts: int) -> np.ndarray:
    """Part (``0..parts-1``) of every item of ``x`` in :func:`solve`'s partition into
    ``parts`` equal counts (``parts >= 2``, ``x.size / parts >= 2``): the crowded
    start's tail."""
    sol = solve(x, parts, _TAIL_RTOL)
    out = np.empty(x.size, np.int64)
    out[sol.order[sol.rows].ravel()] = np.repeat(np.arange(parts), x.size // parts)
    return out


def _fill_rows(b: int) -> int:
    """``fill``'s rows per step at ``B`` items per part (and ``alternate`` from 2 on)."""
    return 2 if b <= _FILL_TWO_ROWS_MAX_B else max(1, b // (_FILL_ROWS if b < 256 else _FILL_ROWS // 2))


def _rematch_moves(w: int, b: int) -> int:
    """Column re-matching's move budget: 8 cycles of ``B``, within the caps."""
    return min(8 * b, _REMATCH_MOVES, max(_REMATCH_MIN_MOVES, _REMATCH_ITEMS // w))


def _kk_start(v: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Equal-size KK's rows (each ascending) and loads, or None where it gives up."""
    part = kk_equal(v, w, give_up=True, coarse=True)
    if part is None:
        return None
    rows = kk_rows(part, w)
    return rows, v[rows].sum(axis=1)


def refine(v: np.ndarray, rows: np.ndarray, loads: np.ndarray, target: int | float,
           stop_at: float | None = None, rematch_target: int | float | None = None,
           swaps: bool = True) -> None:
    """Column re-matching (``B <= 16``; until ``rematch_target``, default ``target``), then swap
    refinement (unless ``swaps`` is false and re-matching ran), of ``rows``/``loads`` in place,
    under the work budget."""
    w, b = rows.shape
    large = int(v.size > _LARGE)
    if b <= _REMATCH_MAX_B:
        # Blocks of two columns above N = 1,024 and at B <= 4; single columns
        # otherwise, where the blocks' extra moves would cost the 1 ms target
        # (_BLOCKS_MIN_ITEMS, _BLOCKS_MAX_B).
        rematch = rematch_blocks if v.size >= _BLOCKS_MIN_ITEMS or b <= _BLOCKS_MAX_B else rematch_columns
        rematch(v, rows, loads, target if rematch_target is None else rematch_target,
                _rematch_moves(w, b), stop_at)
        if loads.max() <= target or late(stop_at) or not swaps:
            return
        if large and np.count_nonzero(loads > target) > w // _PLATEAU_PARTS:
            return
        if large and rematch_target is not None and loads.max() <= rematch_target:
            return  # within _REMATCH_RTOL at scale: the swaps' last step costs 5-10 ms
    steps, pair_steps = min(4 * w + 32, _POLISH_STEPS), _PAIR_STEPS
    if v.size >= _ROUNDS_MIN_ITEMS:
        swap_rounds(v, rows, loads, target, _ROUNDS[large], max(1, 256 // b), _ROUND_ITEMS[large],
                    stop_at, _ROUND_MIN_HEAVY[large])
    else:
        steps, pair_steps = _POLISH_STEPS_SMALL, _PAIR_STEPS_SMALL
    if loads.max() > target and not late(stop_at):
        polish(v, rows, loads, target, steps, _POLISH_ITEMS[large], stop_at)
    if loads.max() > target and w <= _PAIR_MAX_PARTS and not late(stop_at):
        polish_pairs(v, rows, loads, target, pair_steps)
    if loads.max() > target * (1 + _LEVEL_ABOVE) and w <= _PAIR_MAX_PARTS and not large and not late(stop_at):
        # Stuck far above target, e.g. at a tie at the top: level the others
        # (_LEVEL_ROUNDS), then with two-for-two swaps too where still as far.
        level_others(v, rows, loads, target, steps, 0, _LEVEL_ROUNDS, stop_at)
        if loads.max() > target * (1 + _LEVEL_ABOVE) and not late(stop_at):
            level_others(v, rows, loads, target, steps, pair_steps, _LEVEL_ROUNDS, stop_at)


def late(stop_at: float | None) -> bool:
    """Whether the optional ``time.perf_counter()`` deadline ``stop_at`` has passed."""
    return stop_at is not None and time.perf_counter() >= stop_at
