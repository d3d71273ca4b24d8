"""Cutting one rank's samples into ``k`` micro-batches: the two objectives.

Units are samples, or groups of samples that must stay together.

* **Summed cost** (:func:`pack_sum`): a micro-batch costs the sum of its
  units' costs (packed sequences, variable-length attention). Minimise the
  slowest micro-batch subject to a hard token cap. Starts: LPT by cost under
  the cap (``balancer/partition/_free.py``) and Karmarkar-Karp by cost (when it
  fits the cap; :func:`kk_labels`, on sparse states above 32 parts); if
  neither fits, a token-balanced partition (the best packing check we have:
  it minimises the largest token sum), and when that breaks the cap too, for
  up to ``_EXACT_UNITS`` units, an exhaustive search for any packing
  (:func:`fit_tokens`). Each start is refined by cost without breaking the
  cap; the best one is kept.
* **Padded cost** (:func:`segment_padded`): a micro-batch is padded to its
  longest unit, so it costs ``rows x cost(longest)`` and holds ``rows x
  longest`` tokens. The rank's time is the *sum* over its micro-batches. An
  optimal cut puts length-sorted units in contiguous runs (swapping a shorter
  unit of a longer run with a longer unit of a shorter run never raises either
  run's longest). Small cases (``U^2 k <= 2^20``, ~10 ms) get the exact dynamic program
  over run boundaries; larger ones a heuristic: splitting a run never costs
  more, so it starts from the fewest runs the caps allow (greedy), splits the
  run whose best split saves most until there are ``k``, then moves each
  boundary to its best position while that helps. Contiguous runs are optimal
  only while every unit is one row: a group of several samples takes rows of
  a run it does not set the length of. With such groups
  (:func:`pack_padded_groups`) first-fit decreasing by length is tried next to
  the runs, and the cheaper cut kept.
"""

from __future__ import annotations

import heapq

import numpy as np

from balancer._microbatch_kk import kk_labels
from balancer.partition._free import free_assign
from balancer.partition._refine import sort_order

__all__ = ["first_fit_padded", "fit_tokens", "kk_labels", "max_ends", "min_segments", "pack_padded_groups",
           "pack_sum", "segment_padded"]

_POLISH_SWEEPS = 8
_DP_CELLS = 1 << 20  # exact dynamic program when U * U * k is at most this (~10 ms)
# pack_sum: when every start breaks the cap, search all packings of up to this
# many units, visiting at most _EXACT_NODES partial packings (~0.5 s at most)
_EXACT_UNITS = 24
_EXACT_NODES = 200_000


def bins_bound(tokens: np.ndarray, cap: int) -> int:
    """A lower bound on how many parts of at most ``cap`` tokens hold ``tokens``
    (each unit ``<= cap``): the best of three classic bin-packing bounds.

    - tokens: ``ceil(sum / cap)``;
    - counts: a part holds at most ``m`` units, ``m`` the most of the smallest
      units that fit together, so ``ceil(U / m)`` (all units 4096 tokens under
      a budget of 12287: two a part, not the three the token count suggests);
    - Martello and Toth's L2: for each threshold ``a <= cap / 2``, units above
      ``cap - a`` sit alone, units in ``(cap / 2, cap - a]`` need a part each,
      and the units in ``[a, cap / 2]`` fill what those parts leave, then more.
    """
    t = np.sort(tokens.astype(np.int64))
    n = t.size
    if n == 0:
        return 0
    prefix = np.concatenate([[0], np.cumsum(t)])
    best = -(-int(prefix[-1]) // cap)
    fit = int(np.searchsorted(prefix, cap, side="right")) - 1  # the most of the smallest units in one part
    if fit >= 1:
        best = max(best, -(-n // fit))
    a = np.unique(np.concatenate([[0], t[2 * t <= cap]]))  # thresholds: 0 and every small size
    big = np.searchsorted(t, cap - a, side="right")  # first index of J1 (t > cap - a)
    half = np.searchsorted(t, cap // 2, side="right")  # first index above cap / 2
    small = np.searchsorted(t, a, side="left")  # first index of J3 (t >= a)
    n1, n2 = n - big, np.maximum(big - half, 0)
    s2 = prefix[big] - prefix[np.minimum(half, big)]
    s3 = prefix[half] - prefix[np.minimum(small, half)]
    room = n2 * cap - s2
    extra = np.maximum(0, -(-(s3 - room) // cap))
    return max(best, int((n1 + n2 + extra).max()))


def pack_sum(cost: np.ndarray, tokens: np.ndarray, k: int, cap: int | None) -> np.ndarray | None:
    """Micro-batch id per unit: ``k`` non-empty parts, token sums ``<= cap``, small max cost.

    Up to three starts, each refined by cost under the cap, the best kept:
    LPT by cost under the cap, Karmarkar-Karp by cost (when it fits the cap;
    it is what verl uses, so the result is never worse than verl's at the
    same ``k``), and, when neither fits, a token-balanced partition.

    Two shortcuts return what the full search would: ``k == U`` has one cut,
    every unit alone (labelled as LPT labels it); and when capped LPT's
    slowest micro-batch costs no more than the costliest unit, which no cut
    goes below, Karmarkar-Karp cannot beat it and is not run. Both matter for
    budgets near the longest sample (one or two samples a micro-batch), where
    each of the search's probes took seconds at N = 10,000.

    Args:
        cost: [U] per-unit cost (int64 or float64, >= 0).
        tokens: [U] int64 tokens per unit.
        k: micro-batches, ``1 <= k <= U``.
        cap: token budget per micro-batch, or ``None``.

    Returns:
        [U] int64 ids in ``[0, k)``, or ``None`` if no packing was found.
    """
    u = cost.size
    if k == u:  # LPT's cut: costliest unit first, each into the next empty part
        if cap is not None and u and int(tokens.max()) > cap:
            return None
        labels = np.empty(u, np.int64)
        labels[sort_order(cost)[::-1]] = np.arange(u)
        return labels
    sizes = None if cap is None else tokens
    found = []
    lpt = free_assign(cost, k, 1, sizes=sizes, cap=cap, rtol=0.0)
    if lpt is not None:
        found.append(lpt)
        if np.bincount(lpt, weights=cost, minlength=k).max() <= cost.max():
            return lpt  # at the costliest unit: nothing beats it, and ties keep LPT
    kk = kk_labels(cost, k)
    if np.bincount(kk, minlength=k).min() >= 1 and (
            cap is None or np.bincount(kk, weights=tokens, minlength=k).max() <= cap):
        found.append(_refined(cost, k, sizes, cap, kk))
    if not found:
        assert cap is not None, "without a cap LPT always succeeds"
        by_tokens: np.ndarray | None = free_assign(tokens, k, 1)
        assert by_tokens is not None, "no cap, always placed"
        if np.bincount(by_tokens, weights=tokens, minlength=k).max() > cap:
            by_tokens = fit_tokens(tokens, k, cap) if tokens.size <= _EXACT_UNITS else None
            if by_tokens is None:
                return None
        found.append(_refined(cost, k, tokens, cap, by_tokens))
    tops = [np.bincount(f, weights=cost, minlength=k).max() for f in found]
    return found[int(np.argmin(tops))]


def fit_tokens(tokens: np.ndarray, k: int, cap: int) -> np.ndarray | None:
    """Any packing of the units into ``k`` non-empty parts of at most ``cap`` tokens:
    part id per unit, or ``None`` if there is none (or none within ``_EXACT_NODES``).

    Depth-first, largest unit first; a unit tries only one part of each load
    (parts of equal load are interchangeable), and a branch ends where the
    tokens left exceed the room left or the units left cannot fill the empty
    parts. E.g. ``[15, 15, 14, 11, 8, 8, 6, 5, 5]`` into 3 parts of 29:
    ``[15, 14]``, ``[15, 8, 6]``, ``[11, 8, 5, 5]``, which first-fit
    decreasing (4 parts) and a token-balanced partition miss.
    """
    order = np.argsort(-tokens, kind="stable")
    t = [int(v) for v in tokens[order]]
    n = len(t)
    after = [0] * (n + 1)  # tokens of units i.. in that order
    for i in range(n - 1, -1, -1):
        after[i] = after[i + 1] + t[i]
    if after[0] > k * cap or n < k:
        return None
    load = [0] * k
    count = [0] * k
    place = [-1] * n
    nodes = 0

    def go(i: int) -> bool:
        nonlocal nodes
        if i == n:
            return True
        nodes += 1
        if nodes > _EXACT_NODES or after[i] > k * cap - sum(load) or n - i < count.count(0):
            return False
        tried = set()
        for j in range(k):
            if load[j] + t[i] > cap or load[j] in tried:
                continue
            tried.add(load[j])
            load[j] += t[i]
            count[j] += 1
            place[i] = j
            if go(i + 1):
                return True
            load[j] -= t[i]
            count[j] -= 1
        return False

    if not go(0):
        return None
    labels = np.empty(n, np.int64)
    labels[order] = place
    return labels


def first_fit_padded(head: np.ndarray, rows: np.ndarray, cap: int | None, max_rows: int | None) -> list[list[int]]:
    """First-fit decreasing by length: micro-batches (lists of unit indices) within the caps.

    Units are taken longest first, of equal length the most rows first
    (first-fit decreasing within a length: by index, rows ``[1, 1, 2, 2]``
    under 3 rows took three micro-batches), then by index; each goes to the
    first micro-batch that stays within ``cap`` (rows x its first, longest
    unit) and ``max_rows``, or opens a new one. So every list is in that
    order too: longest first.

    A micro-batch's length is set by its first unit, so it has room for
    ``min(cap // length, max_rows) - rows`` more rows; a tree of the largest
    room over index ranges finds the first with enough in ``O(log U)``
    (scanning every open micro-batch for every unit took seconds at U = 5,000).
    """
    u = head.size
    order = np.lexsort((np.arange(u), -rows, -head)).tolist()
    big = int(rows.sum()) + 1  # more rows than any micro-batch can want
    size = 1 << max(0, (u - 1).bit_length())
    room = [-1] * (2 * size)  # leaves size..: room per micro-batch (-1: not open); above: max of children
    out: list[list[int]] = []
    for unit, r, h in zip(order, rows[order].tolist(), head[order].tolist(), strict=True):
        if room[1] >= r:
            node = 1
            while node < size:
                node = 2 * node if room[2 * node] >= r else 2 * node + 1
            m = node - size
            out[m].append(unit)
            left = room[node] - r
        else:
            m = len(out)
            node = m + size
            out.append([unit])
            limit = big if cap is None or h == 0 else cap // h
            left = min(limit, big if max_rows is None else max_rows) - r
        room[node] = left
        node //= 2
        while node:
            top = max(room[2 * node], room[2 * node + 1])
            if room[node] == top:
                break
            room[node] = top
            node //= 2
    return out


def pack_padded_groups(head: np.ndarray, rows: np.ndarray, c: np.ndarray, cap: int | None,
                       max_rows: int | None, k: int) -> list[list[int]] | None:
    """``k`` padded micro-batches (lists of unit indices), the cheaper of contiguous
    length runs (:func:`segment_padded`) and first-fit decreasing split up to
    ``k``; ``None`` if neither fits ``k``.

    Splitting a micro-batch never costs more (each half's longest is at most
    the whole's), so first-fit's micro-batches are split, the split that saves
    most first (a micro-batch's shortest units moved out), until there are ``k``.
    Each micro-batch's best split is kept in a heap (ties: the first
    micro-batch, then the first position), so a split recomputes only its two
    halves (rescanning every micro-batch for every split took 41 s at N = 10,000).
    Every micro-batch returned lists its units longest first (ties by index).

    Args:
        head: [U] longest length per unit; rows: [U] rows per unit; c: [U]
            per-row cost at ``head``; cap, max_rows: the budgets; ``1 <= k <= U``.
    """
    order = np.lexsort((np.arange(head.size), -head))
    ends = max_ends(head[order], rows[order], cap, max_rows)
    cands: list[list[list[int]]] = []
    cuts = segment_padded(c[order], rows[order], ends, k)
    if cuts is not None:
        cands.append([order[a:b].tolist() for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
    ffd = first_fit_padded(head, rows, cap, max_rows)
    if len(ffd) <= k:
        heap: list[tuple[float, int, int]] = []

        def push(m: int) -> None:
            # Moving the units after position t out saves rows(after) x (c(first) - c(t)).
            units = ffd[m]
            if len(units) >= 2:
                idx = np.asarray(units)
                after = np.cumsum(rows[idx][::-1])[::-1][1:].astype(np.float64)
                gain = after * (c[idx[0]] - c[idx[1:]])
                t = int(np.argmax(gain))
                heapq.heappush(heap, (-float(gain[t]), m, t + 1))

        for m in range(len(ffd)):
            push(m)
        while len(ffd) < k:
            assert heap, "k <= U leaves a micro-batch to split"
            _, m, t = heapq.heappop(heap)
            ffd.append(ffd[m][t:])
            ffd[m] = ffd[m][:t]
            push(m)
            push(len(ffd) - 1)
        cands.append(ffd)
    if not cands:
        return None

    def total(mbs: list[list[int]]) -> float:
        firsts = np.array([m[0] for m in mbs])  # m[0]: the longest
        sizes = np.add.reduceat(rows[np.concatenate(mbs)], np.cumsum([0] + [len(m) for m in mbs[:-1]]))
        return sum((sizes.astype(np.float64) * c[firsts].astype(np.float64)).tolist())

    return min(cands, key=total)


def _refined(cost: np.ndarray, k: int, sizes: np.ndarray | None, cap: int | None,
             start: np.ndarray) -> np.ndarray:
    out = free_assign(cost, k, 1, sizes=sizes, cap=cap, rtol=0.0, start=start)
    assert out is not None, "refining a feasible start keeps it feasible"
    return out


def max_ends(head: np.ndarray, rows: np.ndarray, cap: int | None, max_rows: int | None) -> np.ndarray:
    """For each start ``s``, the largest end ``e`` with run ``[s, e)`` within the caps.

    ``head`` [U] is the units' longest length, non-increasing; a run
    ``[s, e)`` holds ``R[e] - R[s]`` rows (``R`` the prefix sum of ``rows``) of
    length ``head[s]``. Returns [U] int64 ends (``e > s`` unless unit ``s``
    alone breaks a cap).
    """
    prefix = np.concatenate([[0], np.cumsum(rows)])
    limit = np.full(head.size, np.iinfo(np.int64).max // 4, np.int64)
    if cap is not None:
        limit = np.where(head > 0, cap // np.maximum(head, 1), limit)
    if max_rows is not None:
        limit = np.minimum(limit, max_rows)
    return np.searchsorted(prefix, prefix[:-1] + limit, side="right") - 1


def min_segments(ends: np.ndarray) -> list[int]:
    """The fewest runs: greedy longest runs from the start. Returns the boundaries."""
    bounds = [0]
    while bounds[-1] < ends.size:
        nxt = int(ends[bounds[-1]])
        assert nxt > bounds[-1], "every unit fits alone (checked by the caller)"
        bounds.append(nxt)
    return bounds


def _run_cost(prefix: np.ndarray, c: np.ndarray, s: int, e: int) -> float:
    return float((prefix[e] - prefix[s]) * c[s])


def _exact(c: np.ndarray, prefix: np.ndarray, ends: np.ndarray, k: int) -> list[int]:
    """Dynamic program: best[j][e] = cheapest cut of units ``[0, e)`` into ``j + 1`` runs."""
    u = c.size
    s = np.arange(u)[:, None]
    e = np.arange(u + 1)[None, :]
    run = np.where((e > s) & (e <= ends[:, None]), (prefix[e] - prefix[s]) * c[:, None], np.inf)
    best = np.full(u + 1, np.inf)
    best[0] = 0.0
    back = np.empty((k, u + 1), np.int64)
    cols = np.arange(u + 1)
    for j in range(k):
        total = best[:u, None] + run  # [start, end]
        back[j] = np.argmin(total, axis=0)
        best = total[back[j], cols]
    assert np.isfinite(best[u]), "k is at least the greedy run count, so a cut exists"
    out = [u]
    for j in range(k - 1, -1, -1):
        out.append(int(back[j, out[-1]]))
    return out[::-1]


def segment_padded(c: np.ndarray, rows: np.ndarray, ends: np.ndarray, k: int) -> list[int] | None:
    """Cut length-sorted units into ``k`` contiguous runs with a small summed padded cost.

    Args:
        c: [U] per-row cost at each unit's longest length, non-increasing.
        rows: [U] rows per unit.
        ends: [U] from :func:`max_ends`.
        k: number of runs, ``1 <= k <= U``.

    Returns:
        ``k + 1`` boundaries ``0 = b_0 < ... < b_k = U``, or ``None`` when the
        caps need more than ``k`` runs.
    """
    u = c.size
    bounds = min_segments(ends)
    if len(bounds) - 1 > k:
        return None
    prefix = np.concatenate([[0.0], np.cumsum(rows, dtype=np.float64)])
    if u * u * k <= _DP_CELLS:
        return _exact(c, prefix, ends, k)
    # Greedy splits: splitting [s, e) at t saves (R[e] - R[t]) (c[s] - c[t]).
    heap: list[tuple[float, int, int, int]] = []

    def push(s: int, e: int) -> None:
        if e - s >= 2:
            t = np.arange(s + 1, e)
            gain = (prefix[e] - prefix[t]) * (c[s] - c[t])
            i = int(np.argmax(gain))
            heapq.heappush(heap, (-float(gain[i]), s, e, int(t[i])))

    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        push(s, e)
    cuts = set(bounds)
    while len(cuts) - 1 < k:
        assert heap, "k <= U leaves a run to split"
        _, s, e, t = heapq.heappop(heap)
        cuts.add(t)
        push(s, t)
        push(t, e)
    out = sorted(cuts)
    # Boundary polish: each inner boundary to its best position between its
    # neighbours, keeping both runs within the caps.
    for _ in range(_POLISH_SWEEPS):
        moved = False
        for i in range(1, k):
            a, b, z = out[i - 1], out[i], out[i + 1]
            pos = np.arange(a + 1, z)
            ok = (pos <= ends[a]) & (ends[pos] >= z)
            if not ok.any():
                continue
            total = (prefix[pos] - prefix[a]) * c[a] + (prefix[z] - prefix[pos]) * c[pos]
            total = np.where(ok, total, np.inf)
            j = int(np.argmin(total))
            if total[j] < _run_cost(prefix, c, a, b) + _run_cost(prefix, c, b, z) and int(pos[j]) != b:
                out[i] = int(pos[j])
                moved = True
        if not moved:
            break
    assert out[0] == 0 and out[-1] == u and len(out) == k + 1, "k runs covering every unit"
    return out
