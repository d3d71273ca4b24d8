"""The cardinality-aware lower bound on the max part load (see ``lower_bound``).

Works on workloads sorted ascending and their prefix sums ``S`` (``S[j]`` = sum
of the ``j`` smallest). Three terms, the bound is their maximum:

* mean and max item;
* pigeonhole: of the ``k`` largest some part holds ``c = ceil(k / W)``;
* grouped: the ``k < W`` largest lie in ``m`` parts, ``ceil(k / B) <= m <=
  k``, which hold at least ``top_k + S(mB - k)``; one of them carries the
  average ``g_k(m) = (top_k + S(mB - k)) / m``. The bound uses ``min_m g_k(m)``
  for every ``k``.

``g_k`` is unimodal in ``m``: going from ``m`` to ``m + 1`` parts adds the next
``B`` fillers ``chunk(m) = S((m+1)B - k) - S(mB - k)``, so ``g_k(m + 1) <
g_k(m)`` iff ``chunk(m) < g_k(m)``, and once ``chunk(m) >= g_k(m)`` it stays so
(``g_k(m + 1)`` lies between ``g_k(m)`` and ``chunk(m)``, and chunks grow with
``m``). The minimum is therefore at the first ``m`` with ``chunk(m) >=
g_k(m)``: a binary search, vectorised over all ``k``. For integers the test
``chunk >= ceil(num / m)`` is exact (``chunk`` is an integer), so the bound is
exact; only ``k`` whose best case (``m = k``) can beat the running maximum are
searched.
"""

from __future__ import annotations

import numpy as np

__all__ = ["bound_sorted", "prefix_sums"]


def prefix_sums(v: np.ndarray) -> np.ndarray:
    """[N + 1] prefix sums of ``v`` in its own dtype (exact for int64)."""
    prefix = np.zeros(v.size + 1, v.dtype)
    np.cumsum(v, out=prefix[1:])
    return prefix


def bound_sorted(v: np.ndarray, num_parts: int, prefix: np.ndarray | None = None) -> int | float:
    """``lower_bound`` on ascending ``v`` (an exact int for int64 input, else a float).

    Args:
        v: [N] workloads sorted ascending, N divisible by ``num_parts``.
        num_parts: W.
        prefix: optional :func:`prefix_sums` of ``v`` (computed if omitted).
    """
    n, w = v.size, num_parts
    if n == 0:
        return 0
    b = n // w
    is_int = v.dtype.kind == "i"
    if prefix is None:
        prefix = prefix_sums(v)
    total = prefix[n]
    best = max(-(-int(total) // w) if is_int else float(total) / w, v[n - 1].item())
    # Pigeonhole: some part holds c = ceil(k/W) of the k largest. Within a block
    # of equal c the bound grows as k shrinks, so k = (c-1)W + 1 suffices.
    c = np.arange(1, b + 1)
    k = (c - 1) * w + 1
    pig = prefix[n - k + c] - prefix[n - k] + prefix[b - c]
    best = max(best, pig.max().item())
    if w < 2:
        return best
    # Grouped, for every k < W whose best case (each of the k alone with the
    # smallest fillers, m = k) beats the running maximum.
    k = np.arange(1, w, dtype=np.int64)
    top = total - prefix[n - k]
    alone = top + prefix[k * (b - 1)]
    # The filter may keep a few too many (float), never too few.
    useful = alone / k > float(best) * (1.0 - 1e-9)
    k, top = k[useful], top[useful]
    if k.size == 0:
        return best
    lo = -(-k // b)  # the first m with P(m) lies in [lo, k]; P(k) holds by convention
    hi = k.copy()
    while True:
        act = lo < hi
        if not act.any():
            break
        mid = (lo + hi) // 2
        start = prefix[mid * b - k]
        chunk = prefix[(mid + 1) * b - k] - start
        num = top + start
        found = chunk >= (-(-num // mid) if is_int else num / mid)
        hi = np.where(act & found, mid, hi)
        lo = np.where(act & ~found, mid + 1, lo)
    num = top + prefix[lo * b - k]
    f = -(-num // lo) if is_int else num / lo
    return max(best, f.max().item())
