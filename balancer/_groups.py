"""Balancing within groups of ranks re-formed every shuffle (``BatchShuffler(group_size=...)``; numpy only).

Global balancing has every rank gather every rank's per-sample metadata and
partition all ``W * B`` samples: at W = 8192 that is 6-81 MB per rank per step
(B = 32-512) and a partition of up to 4.2M samples (~0.5 s on one core). With
``group_size = G`` a shuffle instead:

1. all-gathers only the header and the total load of every rank (``W * 160``
   bytes per rank);
2. forms ``m = ceil(W / G)`` groups with :func:`form_groups`: ranks sorted by
   load, heaviest first, dealt round-robin, so every group mixes heavy and
   light ranks (groups of consecutive ranks would leave a group of heavy ranks
   with no one to give work to);
3. exchanges the full messages within the group only (point-to-point, ``G - 1``
   peers), partitions the group's ``G * B`` samples, and moves samples within
   the group in phase 2: the usual all-to-all of all W ranks, with nothing
   sent outside the group; a rank whose group moves nothing still takes part,
   with empty buffers, since it cannot know whether other groups move.

What it gives up: a heavy group cannot hand work to a light one. Simulated on
Zipf(1.2) <= 4096 batches with these groups and this partitioner
(``benchmarks/bench_scale.py``), max/mean rank load above global balancing at
B >= 128: 0.5 % at G = 256 and 1.7 % at G = 64 (W = 1024), 3-8 % at G = 16;
nothing at B = 32, where single long samples set the bound either way.

Example (W = 4, G = 2, loads ``[5, 9, 1, 7]``): sorted by load the ranks are
``1, 3, 0, 2``; dealt into 2 groups: group 0 = ranks {1, 0}, group 1 = ranks
{3, 2}; every rank computes the same groups from the same gathered loads.
"""

from __future__ import annotations

import numpy as np

__all__ = ["form_groups", "group_message_words", "members_of", "widen_splits"]


def form_groups(loads: np.ndarray, group_size: int) -> np.ndarray:
    """The group of every rank: ranks by load (heaviest first, ties by rank) dealt round-robin.

    Args:
        loads: [W] each rank's total load (identical on every rank: gathered).
        group_size: G >= 1, the most ranks a group holds.

    Returns:
        [W] int64 group id in ``[0, ceil(W / G))``; group sizes differ by at most one.
    """
    w = loads.size
    m = -(-w // group_size)
    order = np.argsort(-np.asarray(loads, np.float64), kind="stable")
    gid = np.empty(w, np.int64)
    gid[order] = np.arange(w, dtype=np.int64) % m
    return gid


def members_of(gid: np.ndarray, rank: int) -> np.ndarray:
    """The ranks in ``rank``'s group, ascending (the group's rank order)."""
    return np.flatnonzero(gid == gid[rank]).astype(np.int64)


def widen_splits(splits: tuple[int, ...], members: np.ndarray, world_size: int) -> tuple[int, ...]:
    """Per-member byte counts ``[G]`` as per-rank counts ``[W]`` (0 outside the group).

    Members are ascending, so the group's send and receive buffers, ordered
    by member, are already ordered by rank.
    """
    out = [0] * world_size
    for m, n in zip(members.tolist(), splits, strict=True):
        out[m] = int(n)
    return tuple(out)


def group_message_words(world_size: int, group_size: int, header: int, payload: int) -> int:
    """int64 words one rank receives from its peers in phase 1 with groups: every
    other rank's header and load, then the full messages of the (at most
    ``group_size - 1``) other members. Global balancing receives
    ``(world_size - 1) * (header + payload)``."""
    return (world_size - 1) * (header + 1) + (min(group_size, world_size) - 1) * (header + payload)
