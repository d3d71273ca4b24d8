"""Largest differencing method (Karmarkar-Karp) for ``W`` parts, vectorised.

A *state* is ``W`` partial part sums kept sorted descending; its *spread* is
``max - min``. KK repeatedly takes the two states with the largest spreads and
merges them largest-with-smallest (``a + b[::-1]``), which cancels most of both
spreads. With the equal-size constraint the initial states are the sorted items
cut into rows of ``W`` consecutive values, one item per part, so every part
ends with exactly one item per row.

:func:`kk_equal` computes exactly the textbook result but in *rounds*: the
states are sorted by spread once per round and the leading pairs
``(1st, 2nd), (3rd, 4th), ...`` are merged together in one batch of numpy
calls. Pair ``i`` is what the heap algorithm would pop next as long as its
smaller spread is still at least every spread produced earlier in the round, so
the round keeps the longest such prefix and the rest waits. Smooth inputs need
``O(log B)`` rounds; heavy-tailed ones degrade to a chain of single merges
(the heavy state keeps the largest spread), where the batch window shrinks to
one or two pairs. Membership is kept as merge records (which rows, which slot
permutation) and replayed backwards at the end, instead of moving item lists.

:func:`kk_free` is the unconstrained variant (``equal_size=False``): a heap of
states that start as single items. It is ``O(N)`` merges and only offered for
drop-in compatibility. :func:`karmarkar_karp` is the public entry to both.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from balancer.partition._refine import coarse_keys, sort_order
from balancer.partition._validate import as_workloads, check_num_parts

__all__ = ["karmarkar_karp", "kk_equal", "kk_free", "kk_rows"]


def karmarkar_karp(workloads: Any, num_parts: int, equal_size: bool = True) -> list[list[int]]:
    """Largest differencing method (Karmarkar-Karp) into ``num_parts`` parts.

    Drop-in for the function of the same name in NVIDIA recsys-examples and
    verl: same arguments, same result type, the same partitions up to ties.
    ``equal_size=True`` (rows of ``W`` sorted items as initial states) gives
    every part exactly ``N / W`` items; ``equal_size=False`` is plain KK
    (``O(N)`` heap merges, compatibility only). :func:`balanced_partition` is
    better on every benchmark input; see ``docs/benchmarks_partition.md``.

    Args:
        workloads: [N] non-negative workloads (list, ndarray or CPU tensor).
        num_parts: W.
        equal_size: require exactly ``N / W`` items per part.

    Returns:
        ``W`` lists of sample indices (each ascending).

    Raises:
        ValueError: see :func:`balanced_partition` (N must be divisible by
            ``num_parts`` only when ``equal_size``).
    """
    check_num_parts(num_parts)
    x = as_workloads(workloads, num_parts if equal_size else 1)
    order = sort_order(x)
    v = x[order]
    if not equal_size:
        free = kk_free(v, num_parts)
        return [np.sort(order[free == j]).tolist() for j in range(num_parts)]
    part = kk_equal(v, num_parts)
    assert part is not None, "kk_equal only gives up when asked to"
    return _to_lists(order, kk_rows(part, num_parts))


def _to_lists(order: np.ndarray, rows: np.ndarray) -> list[list[int]]:
    out: list[list[int]] = np.sort(order[rows], axis=1).tolist()
    return out


def kk_equal(vals: np.ndarray, num_parts: int, give_up: bool = False,
             coarse: bool = False) -> np.ndarray | None:
    """Equal-size KK on ascending ``vals``.

    Args:
        vals: [N] workloads sorted ascending, N divisible by ``num_parts``.
        num_parts: W.
        give_up: return ``None`` without merging when one row's spread
            exceeds the other rows' spreads combined (no sequence of merges
            can cancel it, so KK ends a chain of single merges behind the
            heavy state), or if the first round merges fewer than 1/16 of the
            pairs: the same chain seen later. That is slow and is exactly
            when KK's result is poor (heavy tails). Measured while tuning on
            17 shapes of ``bench_partition``'s workloads (N <= 8,192, 4
            distributions, 3 seeds) where LPT missed the target: KK beat
            LPT only where that ratio was <= 0.65 and lost wherever it was
            >= 1.4; with B <= 16 the first-round test never fires.
        coarse: order each merged state by :func:`coarse_keys` (integer
            workloads): one radix pass per row; the partition's start, not
            the public ``karmarkar_karp``, whose states are ordered exactly.

    Returns:
        [N] int64 part id in ``[0, W)`` per sorted position; each part gets
        exactly one position from every row ``vals[r * W:(r + 1) * W]``.
    """
    w = num_parts
    rows = vals.size // w
    if rows == 0:
        return np.zeros(0, np.int64)
    sums = vals.reshape(rows, w)[:, ::-1].copy()  # [R, W], each row descending
    spread = sums[:, 0] - sums[:, -1]
    if give_up and 2 * spread.max() > spread.sum():
        return None
    alive = np.ones(rows, bool)
    live = np.arange(rows, dtype=np.int64)
    records: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    window = rows // 2
    while live.size > 1:
        order = live[np.argsort(-spread[live], kind="stable")]
        win = min(live.size // 2, max(window, 1))
        ra = order[0 : 2 * win : 2]
        rb = order[1 : 2 * win : 2]
        merged = sums[ra] + sums[rb][:, ::-1]
        top = merged.max(axis=1, keepdims=True)
        bottom = merged.min(axis=1, keepdims=True)
        if coarse and merged.dtype.kind == "i":
            perm = np.argsort(coarse_keys(top - merged, int((top - bottom).max())), axis=1, kind="stable")
        else:
            perm = np.argsort(-merged, axis=1, kind="stable")
        merged = np.take_along_axis(merged, perm, axis=1)
        new_spread = (top - bottom)[:, 0]  # the same in either order
        acc = win
        if win > 1:
            # Pair i is the heap's next pop only if its smaller spread is not
            # below a spread this round already produced.
            late = np.flatnonzero(spread[rb[1:]] < np.maximum.accumulate(new_spread)[:-1])
            if late.size:
                acc = int(late[0]) + 1
        if give_up and not records and 16 * acc < live.size:
            return None
        window = 2 * acc if acc == win else acc
        ra, rb, perm = ra[:acc], rb[:acc], perm[:acc]
        sums[ra] = merged[:acc]
        spread[ra] = new_spread[:acc]
        alive[rb] = False
        live = np.flatnonzero(alive)
        records.append((ra, rb, perm))
    # Replay the merges backwards: labels[r, k] = final part of slot k of row r.
    labels = np.empty((rows, w), np.int64)
    labels[live[0]] = np.arange(w)
    flip = w - 1
    for ra, rb, perm in reversed(records):
        merged_labels = labels[ra]
        labels[ra[:, None], perm] = merged_labels
        labels[rb[:, None], flip - perm] = merged_labels
    out = np.empty(vals.size, np.int64)
    out.reshape(rows, w)[:, ::-1] = labels
    return out


def kk_rows(part: np.ndarray, num_parts: int) -> np.ndarray:
    """[W, N / W] sorted positions per part, each row ascending, from :func:`kk_equal`'s labels.

    Every part holds exactly one position of every row of ``W``, so one scatter
    places them all: the same array as a stable argsort of ``part``, without
    the sort (32768x8: 1.0 ms against 4.8 ms on the CI box).
    """
    rows = part.size // num_parts
    out = np.empty((num_parts, rows), np.int64)
    out[part.reshape(rows, num_parts), np.arange(rows)[:, None]] = np.arange(part.size).reshape(rows, num_parts)
    return out


def kk_free(vals: np.ndarray, num_parts: int) -> np.ndarray:
    """Unconstrained KK (part sizes free) on ascending ``vals``.

    Returns:
        [N] int64 part id per sorted position.
    """
    n = vals.size
    w = num_parts
    if n == 0:
        return np.zeros(0, np.int64)
    # Nodes of a merge forest: leaves 0..n-1 are items; a merge of two
    # non-empty slots creates node n + k with children left[k], right[k].
    left: list[int] = []
    right: list[int] = []
    states: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    heap: list[tuple[float, int]] = []
    for i in range(n - 1, -1, -1):
        s = np.zeros(w, vals.dtype)
        s[0] = vals[i]
        nodes = np.full(w, -1, np.int64)
        nodes[0] = i
        states[i] = (s, nodes)
        heap.append((-float(vals[i]), i))
    heapq.heapify(heap)
    next_id = n
    while len(heap) > 1:
        _, ia = heapq.heappop(heap)
        _, ib = heapq.heappop(heap)
        sa, na = states.pop(ia)
        sb, nb = states.pop(ib)
        merged = sa + sb[::-1]
        nb_rev = nb[::-1]
        nodes = np.where(na < 0, nb_rev, na)
        both = np.flatnonzero((na >= 0) & (nb_rev >= 0))
        for k in both.tolist():
            left.append(int(na[k]))
            right.append(int(nb_rev[k]))
            nodes[k] = n + len(left) - 1
        perm = np.argsort(-merged, kind="stable")
        merged = merged[perm]
        states[next_id] = (merged, nodes[perm])
        heapq.heappush(heap, (-float(merged[0] - merged[-1]), next_id))
        next_id += 1
    _, roots = states[heap[0][1]]
    out = np.empty(n, np.int64)
    for part, root in enumerate(roots.tolist()):
        stack = [root] if root >= 0 else []
        while stack:
            node = stack.pop()
            if node < n:
                out[node] = part
            else:
                stack.append(left[node - n])
                stack.append(right[node - n])
    return out
