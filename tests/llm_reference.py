"""Reference LLM dispatch and micro-batching schemes, written from their published behaviour.

Independent of balancer (pure Python + numpy); used by the tests and by
``benchmarks/bench_llm.py`` as the baselines balancer is compared against.

* verl (RL post-training, single controller): the global batch is split
  across DP ranks by equal-size Karmarkar-Karp on ``seqlen**2 + 24576 *
  seqlen``; each rank's share is cut into micro-batches by unconstrained
  Karmarkar-Karp into ``ceil(total_tokens / max_tokens)`` parts (made equal
  across ranks by a MAX), which can overflow the budget; the later fix retries
  with one more micro-batch until every micro-batch fits.
* torchspec (single controller): samples are dealt round-robin; micro-batches
  of ``mbs`` rows are padded to their longest sample. A proposed improvement
  deals longest-first to the least-loaded rank (greedy).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

VERL_CONSTANT = 24576


def verl_workload(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """verl's hard-coded per-sample workload ``L**2 + 24576 L`` (float64)."""
    x = np.asarray(lengths, dtype=np.float64)
    return x * x + VERL_CONSTANT * x


def kk_free(values: Sequence[float], k: int) -> list[list[int]]:
    """Textbook Karmarkar-Karp into ``k`` parts of free size (heap of k-tuples)."""
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for i, v in enumerate(values):
        sums = [float(v)] + [0.0] * (k - 1)
        heapq.heappush(heap, (-float(v), i, sums, [[i]] + [[] for _ in range(k - 1)]))
    tick = len(values)
    while len(heap) > 1:
        _, _, sa, pa = heapq.heappop(heap)
        _, _, sb, pb = heapq.heappop(heap)
        merged = sorted(((sa[j] + sb[k - 1 - j], pa[j] + pb[k - 1 - j]) for j in range(k)),
                        key=lambda t: -t[0])
        sums = [m[0] for m in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tick, sums, [m[1] for m in merged]))
        tick += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(p) for p in heap[0][3]]


def kk_equal(values: Sequence[float], k: int) -> list[list[int]]:
    """Textbook equal-size Karmarkar-Karp (len(values) divisible by k)."""
    items = sorted(range(len(values)), key=lambda i: (values[i], i))
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for r in range(0, len(items), k):
        row = items[r : r + k][::-1]
        sums = [float(values[i]) for i in row]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), r, sums, [[i] for i in row]))
    tick = len(values)
    while len(heap) > 1:
        _, _, sa, pa = heapq.heappop(heap)
        _, _, sb, pb = heapq.heappop(heap)
        merged = sorted(((sa[j] + sb[k - 1 - j], pa[j] + pb[k - 1 - j]) for j in range(k)),
                        key=lambda t: -t[0])
        sums = [m[0] for m in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tick, sums, [m[1] for m in merged]))
        tick += 1
    return [sorted(p) for p in heap[0][3]] if heap else [[] for _ in range(k)]


def verl_dispatch(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """verl's DP split: equal-size KK on ``L**2 + 24576 L``."""
    return kk_equal(verl_workload(lengths).tolist(), world_size)


def verl_micro_batches(lengths: Sequence[int], max_tokens: int, workloads: Sequence[float] | None = None,
                       num_micro_batches: int | None = None, retry: bool = True) -> list[list[int]]:
    """verl's ``rearrange_micro_batches``: KK into ``ceil(total / max_tokens)`` parts.

    ``retry=False`` is the original behaviour (a part may exceed the budget);
    ``retry=True`` the later fix (one more micro-batch until all fit).
    ``num_micro_batches`` overrides the count (the MAX over DP ranks).
    """
    lens = [int(x) for x in lengths]
    w = list(workloads) if workloads is not None else [float(x) for x in lens]
    k = num_micro_batches or max(1, math.ceil(sum(lens) / max_tokens))
    k = min(k, len(lens))
    while True:
        parts = kk_free(w, k)
        if not retry or all(sum(lens[i] for i in p) <= max_tokens for p in parts) or k >= len(lens):
            return parts
        k += 1


def round_robin(n: int, world_size: int) -> list[list[int]]:
    """torchspec's dispatch: sample ``i`` to rank ``i % W``."""
    return [list(range(r, n, world_size)) for r in range(world_size)]


def greedy_longest_first(costs: Sequence[float], world_size: int, equal_count: bool = True) -> list[list[int]]:
    """Proposed torchspec fix: longest first to the least-loaded rank (with room)."""
    n = len(costs)
    cap = math.ceil(n / world_size) if equal_count else n
    parts: list[list[int]] = [[] for _ in range(world_size)]
    heap = [(0.0, r) for r in range(world_size)]
    for i in sorted(range(n), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        parts[r].append(i)
        if len(parts[r]) < cap:
            heapq.heappush(heap, (load + costs[i], r))
    return [sorted(p) for p in parts]


def padded_cost(lengths: Sequence[int], batch: Sequence[int], mbs: int,
                row_cost: object = None) -> float:
    """Cost of one rank's samples cut into micro-batches of ``mbs`` rows in the given order.

    Each micro-batch costs ``rows x cost(longest)`` (``cost(L) = L`` by default).
    """
    f = row_cost if callable(row_cost) else (lambda x: float(x))
    total = 0.0
    for s in range(0, len(batch), mbs):
        chunk = [lengths[i] for i in batch[s : s + mbs]]
        total += len(chunk) * f(max(chunk))
    return total
