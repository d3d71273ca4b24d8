"""How balanced a partition is: :class:`PartitionStats` of given parts, or of no balancing."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from balancer.partition._bound import lower_bound
from balancer.partition._validate import as_workloads

__all__ = ["PartitionStats", "imbalance", "partition_stats"]


@dataclasses.dataclass(frozen=True, eq=False)
class PartitionStats:
    """Balance of one partition. ``loads`` is [W]; the rest are scalars."""

    loads: np.ndarray
    """Sum of workloads per part."""
    max_load: float
    """Largest part load: the step time of the slowest rank."""
    mean_load: float
    """Average part load (``sum / W``): the ideal."""
    max_over_mean: float
    """``max_load / mean_load`` (1.0 is perfect balance; 1.0 when all zero)."""
    bound: float
    """:func:`lower_bound` for the same workloads and ``W``."""
    max_over_bound: float
    """``max_load / bound``: 1.0 means provably optimal."""

    def speedup_over(self, before: PartitionStats) -> float:
        """How much faster the slowest rank gets: ``before.max_load / self.max_load``."""
        return before.max_load / self.max_load if self.max_load > 0 else 1.0


def partition_stats(workloads: Any, parts: Sequence[Sequence[int]]) -> PartitionStats:
    """Loads and balance ratios of ``parts`` (indices into ``workloads``).

    Args:
        workloads: [N] workloads.
        parts: ``W`` sequences of indices covering ``range(N)``, equal sizes.

    Returns:
        A :class:`PartitionStats`.
    """
    w = len(parts)
    x = as_workloads(workloads, max(w, 1))
    loads = np.array([x[np.asarray(p, dtype=np.int64)].sum() for p in parts], dtype=x.dtype)
    bound = lower_bound(x, max(w, 1))
    top = float(loads.max()) if w else 0.0
    mean = float(x.sum()) / max(w, 1)
    return PartitionStats(loads, top, mean, top / mean if mean > 0 else 1.0, bound,
                          top / bound if bound > 0 else 1.0)


def imbalance(workloads: Any, num_parts: int) -> PartitionStats:
    """Stats of "no balancing": contiguous chunks, rank ``r`` keeps ``[rB, (r+1)B)``."""
    x = as_workloads(workloads, num_parts)
    return partition_stats(x, np.arange(x.size).reshape(num_parts, -1).tolist())
