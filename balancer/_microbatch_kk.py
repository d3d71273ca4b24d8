"""Karmarkar-Karp for the micro-batch planners: :func:`kk_labels`.

Largest differencing into ``k`` parts, free sizes (a start of
:func:`~balancer._microbatch_pack.pack_sum`) or equal sizes (the equal split of
:func:`~balancer.dispatch.plan_dispatch`). States merge in O(k) as node ids
(unions recorded as children, labels read back at the end): dense lists up to
``_KK_LIST_K`` parts, arrays or sparse states (only the non-empty parts) above.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Any

import numpy as np

__all__ = ["kk_labels"]

_KK_LIST_K = 32  # kk_labels: dense list states up to this many parts, sparse ones above


def kk_labels(cost: np.ndarray, k: int, equal: bool = False) -> np.ndarray:
    """Karmarkar-Karp into ``k`` parts: part id per unit.

    States are ``k`` (sum, set) pairs sorted by sum; the two states with the
    largest spreads merge largest-with-smallest. Free sizes start from one
    state per unit; ``equal`` (``N`` divisible by ``k``) from rows of ``k``
    consecutive sorted units, one per part, so every part gets ``N / k``
    (verl's equal-size variant).

    A set is a node id: a unit (``< N``), the union of two sets (a new id,
    its children kept in two lists), or ``-1`` (empty), so a merge costs
    ``O(k)`` whatever the sets hold; labels are read back from the final
    state through the unions, newest first. Up to ``_KK_LIST_K`` parts a
    state is two Python lists (a short merge is cheaper without numpy), above
    it two arrays (equal sizes: ``N / k`` states, each full). With free sizes
    and more than ``_KK_LIST_K`` parts most parts of most states are empty (a
    state holds the units merged into it, and one state keeps absorbing single
    units), so a state keeps only its non-empty parts (:func:`_kk_sparse`) and
    a merge costs what the second state holds: the arrays cost ``O(k)`` a
    merge, 0.7 s per call at N = 10,000, k = 5,000 (now ~40 ms).
    """
    n = cost.size
    if n == 0:
        return np.zeros(0, np.int64)
    if k > _KK_LIST_K and not equal:
        return _kk_sparse(cost, k)
    merge = _kk_merge_lists if k <= _KK_LIST_K else _kk_merge_arrays
    if equal:
        nodes = np.argsort(cost, kind="stable").reshape(-1, k)[:, ::-1]  # rows of k, descending
        sums = cost[nodes]
        keys, ticks = (sums[:, -1] - sums[:, 0]).tolist(), range(0, n, k)
    else:
        sums = np.zeros((n, k), cost.dtype)
        sums[:, 0] = cost
        nodes = np.full((n, k), -1, np.int64)
        nodes[:, 0] = np.arange(n)
        keys, ticks = (-cost).tolist(), range(n)
    states = (sums.tolist(), nodes.tolist()) if k <= _KK_LIST_K else (list(sums), list(nodes))
    heap: list[tuple[Any, int, Any, Any]] = list(zip(keys, ticks, *states, strict=True))
    heapq.heapify(heap)
    left: list[int] = []  # children of union n + j
    right: list[int] = []
    tick = n
    while len(heap) > 1:
        _, _, sa, na = heapq.heappop(heap)
        _, _, sb, nb = heapq.heappop(heap)
        sums, nodes = merge(sa, na, sb, nb, n, left, right)
        heapq.heappush(heap, (sums[-1] - sums[0], tick, sums, nodes))
        tick += 1
    label = [-1] * (n + len(left))
    for j, v in enumerate(np.asarray(heap[0][3]).tolist()):
        if v >= 0:
            label[v] = j
    return _kk_read_back(label, n, left, right)


def _kk_read_back(label: list[int], n: int, left: list[int], right: list[int]) -> np.ndarray:
    """Labels of the units from those of the final state's sets, through the unions newest first."""
    for v in range(len(left) - 1, -1, -1):
        label[left[v]] = label[right[v]] = label[n + v]
    return np.asarray(label[:n], np.int64)


def _kk_sparse(cost: np.ndarray, k: int) -> np.ndarray:
    """:func:`kk_labels` with free sizes (the same labels) on states that list only their non-empty parts.

    A state's ``k`` parts, sorted by sum (descending, ties in merge order),
    are its parts of positive sum (``neg``: minus the sums, ascending, and
    their ``nodes``), then a block of zero sum: ``zeros`` maps a position in
    that block to the non-empty set there (a unit of cost 0); every other
    part is empty. Merging ``a`` (popped first) with ``b`` pairs ``a``'s part
    ``x`` with ``b``'s part ``k - 1 - x``, so ``b``'s ``P_b`` positive parts
    meet ``a``'s last ``P_b`` positions: those leave ``a``'s list, take their
    new sums and go back in (by sum, ties after the parts that stayed, whose
    positions are lower); ``b``'s zero-sum sets join ``a``'s part at their
    mirrored position in place (the sum does not change). ``a`` is reused:
    when ``b`` is one unit, or a few parts meeting a full ``a``, a merge costs
    ``O(P_b + |zeros_b|)`` list operations; otherwise one numpy merge of the
    two, ``O(P_a + P_b)`` (:func:`_kk_merge_many`). A state of one unit is
    just its index until it is popped first.
    """
    n = cost.size
    vals = (-cost).tolist()  # minus the costs: exact, and ascending is by sum descending
    dtype = np.float64 if cost.dtype.kind == "f" else np.int64
    empty: dict[int, int] = {}
    heap: list[tuple[Any, int, Any]] = list(zip(vals, range(n), range(n), strict=True))  # key: -cost
    heapq.heapify(heap)
    left: list[int] = []  # children of union n + j
    right: list[int] = []
    tick = n
    pop, push, after = heapq.heappop, heapq.heappush, bisect.bisect_right

    def union(x: int, y: int) -> int:  # y, a set of b, is never empty
        if x < 0:
            return y
        left.append(x)
        right.append(y)
        return n + len(left) - 1

    def state(st: Any) -> list[Any]:
        if isinstance(st, list):
            return st
        return [[vals[st]], [st], empty] if vals[st] < 0 else [[], [], {0: st}]

    while len(heap) > 1:
        a = state(pop(heap)[2])
        b = pop(heap)[2]
        neg, nodes, zeros = a
        if isinstance(b, list):
            nb, vb, zb = b
        else:  # one unit, read in place
            nb, vb, zb = ((vals[b],), (b,), empty) if vals[b] < 0 else ((), (), {0: b})
        pa, pb = len(neg), len(nb)
        lo = k - pb  # a's positions lo..k-1 meet b's positive parts, mirrored
        for off, node in zb.items():  # b's zero-sum sets: position lo - 1 - off of a
            x = lo - 1 - off
            if x < pa:
                nodes[x] = union(nodes[x], node)
            else:
                if zeros is empty:
                    zeros = a[2] = {}
                zeros[x - pa] = union(zeros.get(x - pa, -1), node)
        if pb == 1:  # the usual merge: one part meets a's last position
            if lo < pa:
                new_neg, new_node = neg.pop() + nb[0], union(nodes.pop(), vb[0])
            else:
                new_neg, new_node = nb[0], union(zeros.pop(lo - pa, -1) if zeros else -1, vb[0])
            at = after(neg, new_neg)
            neg.insert(at, new_neg)
            nodes.insert(at, new_node)
        elif pa == k and pb <= _KK_LIST_K and pb * 16 <= k:  # a full, a few of its parts meet b's
            add_neg = [neg[x] + nb[k - 1 - x] for x in range(lo, k)]
            add_nodes = [union(nodes[x], vb[k - 1 - x]) for x in range(lo, k)]
            del neg[lo:], nodes[lo:]
            at = 0
            for r in sorted(range(pb), key=add_neg.__getitem__):  # stable: ties by position
                at = after(neg, add_neg[r], at)
                neg.insert(at, add_neg[r])
                nodes.insert(at, add_nodes[r])
                at += 1
        elif pb:  # many (or a is the small one): numpy, O(P_a + P_b) in C
            a[0], a[1] = _kk_merge_many(neg, nodes, zeros, nb, vb, k, union, left, right, n, dtype)
            neg = a[0]
        key = (neg[0] - neg[-1] if len(neg) == k else neg[0]) if neg else 0
        push(heap, (key, tick, a))
        tick += 1
    neg, nodes, zeros = state(heap[0][2])
    label = [-1] * (n + len(left))
    for j, v in enumerate(nodes):
        label[v] = j
    for off, v in zeros.items():
        label[v] = len(nodes) + off
    return _kk_read_back(label, n, left, right)


def _kk_merge_many(neg: list[Any], nodes: list[int], zeros: dict[int, int], nb: Any, vb: Any, k: int,
                   union: Any, left: list[int], right: list[int], n: int, dtype: Any) -> tuple[list[Any], list[int]]:
    """:func:`_kk_sparse`'s merge of ``b``'s positive parts into ``a`` on arrays: the new
    positive parts of ``a`` (minus the sums, nodes), sorted; ``zeros`` updated in place."""
    pa, pb = len(neg), len(nb)
    lo = k - pb
    keep = min(lo, pa)
    a_neg, a_nodes = np.array(neg, dtype), np.array(nodes, np.int64)  # dtype: an empty list is no float
    add_neg, add_nodes = np.array(nb[::-1], dtype), np.array(vb[::-1], np.int64)  # a's positions lo..k-1
    both = pa - keep  # a's positive parts that meet one of b's
    if both:
        add_neg[:both] += a_neg[keep:]
        left.extend(nodes[keep:])
        right.extend(add_nodes[:both].tolist())
        add_nodes[:both] = np.arange(n + len(left) - both, n + len(left))
    if zeros:  # a's zero-sum sets that meet one of b's parts
        first = max(lo, pa) - pa
        for off in sorted(o for o in zeros if o >= first):
            at = pa + off - lo
            add_nodes[at] = union(zeros.pop(off), int(add_nodes[at]))
    all_neg = np.concatenate([a_neg[:keep], add_neg])
    order = np.argsort(all_neg, kind="stable")  # ties: a's parts that stayed, then by position
    return all_neg[order].tolist(), np.concatenate([a_nodes[:keep], add_nodes])[order].tolist()


def _kk_merge_lists(sa: list[Any], na: list[int], sb: list[Any], nb: list[int], n: int,
                    left: list[int], right: list[int]) -> tuple[Any, Any]:
    """One KK merge of list states: part ``j`` of one with part ``k-1-j`` of the other."""
    k = len(sa)
    pairs = []
    for j in range(k):
        a, b = na[j], nb[k - 1 - j]
        if a >= 0 and b >= 0:
            left.append(a)
            right.append(b)
            a = n + len(left) - 1
        elif a < 0:
            a = b
        pairs.append((sa[j] + sb[k - 1 - j], a))
    pairs.sort(key=lambda t: -t[0])  # stable: ties keep their part order
    return [t[0] for t in pairs], [t[1] for t in pairs]


def _kk_merge_arrays(sa: np.ndarray, na: np.ndarray, sb: np.ndarray, nb: np.ndarray, n: int,
                     left: list[int], right: list[int]) -> tuple[Any, Any]:
    """:func:`_kk_merge_lists` on arrays (the same result)."""
    sums, rb = sa + sb[::-1], nb[::-1]
    both = (na >= 0) & (rb >= 0)
    nodes = np.where(na >= 0, na, rb)
    m = int(both.sum())
    if m:
        nodes[both] = np.arange(n + len(left), n + len(left) + m)
        left.extend(na[both].tolist())
        right.extend(rb[both].tolist())
    order = np.argsort(-sums, kind="stable")
    sums = sums[order]
    return sums, nodes[order]
