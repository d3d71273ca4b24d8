"""Column re-matching: a global move for few items per part (``B <= 16``).

Two forms: :func:`rematch_columns` moves one column at a time (inputs up to
N = 1,024 with B > 4), :func:`rematch_blocks` blocks of one or two columns
(larger inputs, and B <= 4 at every size; see its docstring). What follows
describes the single-column move.

Swaps trade items between two parts. With few items per part the heaviest
part has few swaps to choose from, and a swap that lowers it usually raises a
partner close to the max: 256x4 uniform ends 5e-3 above the bound after 128
single swaps. This move changes every part at once:

1. take column ``k`` of ``rows`` (one item of every part; the ``k``-th
   smallest on entry, rows being sorted) out of every part; what stays is the
   *remainder* ``loads - vals[col]``;
2. hand the ``W`` column items back, the largest to the part with the
   smallest remainder, the second largest to the second smallest, and so on.

For fixed remainders this pairing minimises the max of ``remainder + item``
(an exchange argument: if a larger remainder held a larger item, swapping the
two items lowers the larger sum and raises the other to at most the old one),
so the move never raises the max load; it is kept only when it lowers it.
Columns are tried in turn until ``_IDLE_MOVES`` in a row (or a whole cycle of
``B``) bring no gain or the caller's move budget is spent. When the budget
covers fewer than two cycles (16 moves at W = 16,384) the cycle runs from the
largest column down: re-matching the largest items moves loads the most, and
the smallest columns rarely help first (16384x16 uniform, 3 seeds: 8.9e-5 to
1.2e-4 -> 1.7e-5 to 2.5e-5 above the bound in the same 16 moves). With more
moves it runs upwards: over many cycles on ``B <= 8`` the downward order ends
worse about as often as better. A move is ~10 numpy
calls on ``W`` items (two sorts of ``W``: ~0.7 ms at W = 16,384).

Measured with ``benchmarks/bench_partition.py --only scale --before e2eddbf``
(``docs/benchmarks_partition.md``, "Few items per part"; max/bound - 1,
median of 2 seeds, and ``balanced_partition`` ms): 256x4 uniform 5.4e-3 ->
2.0e-3 in 5.6 -> 2.1 ms; 128x8 uniform 3.3e-4 -> 2.1e-4 in 3.2 -> 2.0 ms;
8192x8 uniform 4.3e-3 -> 3.1e-4 in 12 -> 20 ms; 16384x16 uniform 4.5e-4 ->
9.5e-5 in 49 -> 55 ms; lognormal, Zipf and padded inputs unchanged or better
in quality (their max is set by a few large items, which swaps handle). From
``B = 32`` on the swaps reach ~1e-5 alone and the moves would only cost time.
"""

from __future__ import annotations

import time

import numpy as np

from balancer.partition._refine import TIMSORT_MIN_PARTS, coarse_keys, order_floats

__all__ = ["rematch_blocks", "rematch_columns"]

# Stop after this many moves in a row that do not lower the max (or a whole cycle
# of B): where the max is pinned (Zipf: many parts hold the same clipped items)
# no column helps, and at W = 16,384 each try costs ~0.7 ms.
_IDLE_MOVES = 4


def rematch_columns(vals: np.ndarray, rows: np.ndarray, loads: np.ndarray, target: float,
                    max_moves: int, stop_at: float | None = None) -> int:
    """Re-match columns of ``rows`` while the max load is above ``target``.

    Args:
        vals: [N] workloads sorted ascending (int64 or float64).
        rows: [W, B] int64 sorted positions per part, each row ascending;
            updated in place (each row ascending again on return).
        loads: [W] part loads ``vals[rows].sum(1)``; updated in place.
        target: stop once the max load is ``<= target``.
        max_moves: moves tried at most (kept or not).
        stop_at: optional ``time.perf_counter()`` deadline, checked between moves.

    Returns:
        The number of moves tried.
    """
    b = rows.shape[1]
    narrow = vals.size <= np.iinfo(np.int32).max
    cur = loads.max()
    idle = 0  # moves in a row that did not lower the max
    tried = kept = 0
    down = max_moves < 2 * b  # short budget: largest column first (module docstring)
    runs = rows.shape[0] >= TIMSORT_MIN_PARTS
    # A move permutes its column's items among the parts, so each column holds
    # the same items until the final row sort: sort them once per column.
    ranked: dict[int, np.ndarray] = {}
    while tried < max_moves and cur > target and idle < min(b, _IDLE_MOVES):
        if stop_at is not None and time.perf_counter() >= stop_at:
            break
        k = b - 1 - tried % b if down else tried % b
        tried += 1
        col = rows[:, k]
        rest = loads - vals[col]
        # Positions are value-ascending, so sorting them sorts the items (as
        # int32 when N allows: numpy's SIMD sort takes ~half the time);
        # order_floats breaks ties by part index, the same on every machine.
        if k not in ranked:
            ranked[k] = np.sort(col.astype(np.int32) if narrow else col)[::-1]
        new = np.empty_like(col)
        new[order_floats(rest, nearly_sorted=runs)] = ranked[k]
        new_loads = rest + vals[new]
        top = new_loads.max()
        if top < cur:
            # Rows are re-sorted once at the end: which item of a part sits in
            # which column only decides the grouping of later moves (sorting
            # after every move gave the same quality on the benchmark shapes
            # at up to 1.4x the time).
            rows[:, k] = new
            loads[:] = new_loads
            cur = top
            idle = 0
            kept += 1
        else:
            idle += 1
    if kept:
        rows.sort(axis=1)
    return tried


# rematch_blocks: stop after this many blocks in a row that do not lower the max
# (within one cycle of blocks). Measured with blocks at every N: 4 left one of
# the quality guard's 256x4 uniform seeds at 3.4e-3 (10: 5.9e-4) and 1024x8 at
# 2.4-4.2e-5 above the bound (10: 1.4-1.8e-5).
_IDLE_BLOCKS = 10
# _order: exact (stable argsort) orders up to this many parts, where the coarse
# keys' extra numpy calls cost more than they save (256 keys: 4.0 against 6.8 us
# per order; 512: 9.1 against 8.5). Shapes with N > 1,024 and W <= 256 (128x16 and
# 256x16 Zipf, 256x8 uniform and lognormal) keep their quality (throwaway A/B,
# 8-16 seeds).
_EXACT_MAX_PARTS = 256


def rematch_blocks(vals: np.ndarray, rows: np.ndarray, loads: np.ndarray, target: float,
                   max_moves: int, stop_at: float | None = None) -> int:
    """Like :func:`rematch_columns`, with blocks of one or two columns.

    A move takes a *block* out of every part -- one column, or two, whose
    items travel together -- and hands the ``W`` blocks back, the largest sum
    to the smallest remainder. For fixed remainders that pairing minimises the
    max (the exchange argument of the module docstring, with block sums as
    items), so the move never raises the max; it is kept only when it lowers
    it. The blocks come in turn, largest items first: column ``i`` alone, then
    ``i`` with every smaller column, for ``i = B - 1, B - 2, ...`` (from the
    smallest columns up, the first moves barely change a load: 32768x8
    lognormal took 45 ms instead of 37, Zipf 16384x16 ended 1.1e-2 above the
    bound instead of 8.3e-3). Two columns re-pair the parts' halves in ways
    one column cannot: from the KK start, 32768x8 uniform ends within 5e-5
    of the bound in 16 moves, where single columns end 4-7.7e-4 above it.

    Integer keys are ordered by their top 16 bits (:func:`coarse_keys`, one
    radix pass: remainders ascending, block sums descending, ties by part
    index); floats by :func:`order_floats`. A pairing off by one bucket is
    still a partition, and the move is kept only when it lowers the max: at
    W = 32,768 that halves the two sorts of a move (two radix passes each on
    25-bit keys) and leaves the quality as it was (32768x8 uniform 1.25x;
    ``docs/benchmarks_partition.md``, "coarse orders").
    Columns are held column-major with their values, so a move reads no item
    through a random gather (~1.5 ms at W = 32,768 on the CI box).

    Args and returns: as :func:`rematch_columns`.
    """
    b = rows.shape[1]
    cur = loads.max()
    if cur <= target:
        return 0  # before the column-major copies (~2.6 ms at 32768x8 on the CI box)
    idle = 0  # moves in a row that did not lower the max
    tried = kept = 0
    blocks = _blocks(b)
    rw = np.ascontiguousarray(rows.T)
    cv = vals[rw]
    perm = np.empty(rw.shape[1], np.int64)
    while tried < max_moves and cur > target and idle < min(len(blocks), _IDLE_BLOCKS):
        if stop_at is not None and time.perf_counter() >= stop_at:
            break
        cols = blocks[tried % len(blocks)]
        tried += 1
        block = cv[cols[0]] if len(cols) == 1 else cv[cols[0]] + cv[cols[1]]
        rest = loads - block
        give = _order(block, descending=True)
        take = _order(rest)
        new_loads = rest[take] + block[give]
        top = new_loads.max()
        if top < cur:
            # Part take[i] gets block give[i]: one scatter for the permutation,
            # then a gather per column (one scatter and gather per column: 2.4x the time).
            perm[take] = give
            for c in cols:
                rw[c] = rw[c, perm]
                cv[c] = cv[c, perm]
            loads[take] = new_loads
            cur = top
            idle = 0
            kept += 1
        else:
            idle += 1
    if kept:
        rows[:] = rw.T
        rows.sort(axis=1)
    return tried


def _blocks(b: int) -> list[tuple[int, ...]]:
    """The blocks of :func:`rematch_blocks`, in turn, largest items first: column ``i``
    alone, then ``i`` with every smaller column, for ``i = B - 1, B - 2, ...``."""
    out: list[tuple[int, ...]] = []
    for i in range(b - 1, -1, -1):
        out.append((i,))
        out += [(i, j) for j in range(i - 1, -1, -1)]
    return out


def _order(keys: np.ndarray, descending: bool = False) -> np.ndarray:
    """Ascending (or descending) order of ``keys``, ties by index, the same on every machine:
    integer keys by :func:`coarse_keys` of ``keys - min`` (or ``max - keys``) from
    ``_EXACT_MAX_PARTS`` keys on, exactly below; floats exactly."""
    if keys.dtype.kind == "i" and keys.size <= _EXACT_MAX_PARTS:
        return np.argsort(-keys if descending else keys, kind="stable")
    if keys.dtype.kind == "i":
        lo, hi = int(keys.min()), int(keys.max())
        return np.argsort(coarse_keys(hi - keys if descending else keys - lo, hi - lo), kind="stable")
    return order_floats(-keys if descending else keys)
