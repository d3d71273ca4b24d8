"""The rank plan: from every sample's destination to what this rank sends and receives.

Pure and rank-local (numpy only): nothing here communicates or reads a device
tensor, and every function is deterministic in its arguments, so a test can
run it for every rank in one process, and every rank that saw the same
gathered metadata takes the same decision -- the property that keeps phase 2's
collective matched across ranks.

* :class:`Gathered` -- what phase 1 gave every rank: workloads, lengths and
  real-sample counts of every rank's batch;
* :func:`plan_rank` -- from the destinations (:mod:`balancer._destinations`),
  what this rank sends where, how much it receives from whom, and in which
  order its output lists samples (:mod:`balancer._exchange` then plans every
  byte of it);
* :func:`plan_digest` -- a hash of the destinations that ranks compare.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

__all__ = ["Gathered", "RankPlan", "moved_mask", "plan_digest", "plan_rank", "real_mask"]


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Phase 1's result, identical on every rank.

    Attributes:
        workloads: [W * B] float64 by global index ``g = rank * B + i``; 0 for padding.
        lengths: [W, K_total, B] int64 lengths of every rank's batch.
        real: [W] real samples per rank (the first ``real[r]`` of rank r).
        pad_len: [W] padded length L of every rank's padded token batch (0 otherwise).
    """

    workloads: np.ndarray
    lengths: np.ndarray
    real: np.ndarray
    pad_len: np.ndarray | None = None

    @property
    def world_size(self) -> int:
        return int(self.real.size)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[2])


def real_mask(real: np.ndarray, batch_size: int) -> np.ndarray:
    """[W * B] bool: whether global sample ``g = r * B + i`` is real (``i < real[r]``)."""
    return (np.arange(batch_size) < np.asarray(real)[:, None]).reshape(-1)


def moved_mask(dest: np.ndarray, batch_size: int) -> np.ndarray:
    """[W * B] bool: whether global sample ``g`` leaves its rank (``dest[g] != g // B``)."""
    w = dest.size // batch_size
    return (dest.reshape(w, batch_size) != np.arange(w)[:, None]).reshape(-1)


def plan_digest(dest: np.ndarray) -> int:
    """int64 hash of the destinations; ranks compare it to detect diverging plans."""
    raw = np.ascontiguousarray(dest, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """What one rank does in phase 2.

    Attributes:
        rank: this rank.
        send_order: [sum(send_counts)] local indices of this rank's real samples,
            grouped by destination rank (ascending; this rank's own group, the
            samples that stay, at position ``rank``), ascending within a group.
        send_counts: [W] samples per destination, ``send_counts[rank]`` stay.
        recv_counts: [W] samples per source, ``recv_counts[rank]`` stayed.
        sources: [M] global indices of the real samples of the output, in
            output order (ascending: by source rank, then local index).
    """

    rank: int
    send_order: np.ndarray
    send_counts: np.ndarray
    recv_counts: np.ndarray
    sources: np.ndarray

    @property
    def num_out(self) -> int:
        """Real samples in this rank's output."""
        return int(self.sources.size)


def plan_rank(dest: np.ndarray, batch_size: int, real: np.ndarray, rank: int) -> RankPlan:
    """Plan phase 2 for ``rank``; padding is never sent.

    Example (W=2, B=3, ``real = [3, 2]``, so global sample 5 is padding;
    ``dest = [0, 1, 1, 0, 0, 1]``)::

        rank0: send_order [0, 1, 2]  send_counts [1, 2]  recv_counts [1, 2]  sources [0, 3, 4]
        rank1: send_order [0, 1]     send_counts [2, 0]  recv_counts [2, 0]  sources [1, 2]

    Rank 0 keeps sample 0 and sends its samples 1, 2 to rank 1; rank 1 sends
    its samples 0, 1 (global 3, 4) to rank 0. What r sends to d always equals
    what d expects from r.

    Args:
        dest: [W * B] destination rank of every global sample.
        batch_size: B.
        real: [W] real samples per rank (the first ``real[r]`` of rank r).
        rank: the rank to plan for.
    """
    w = real.size
    mine = dest[rank * batch_size : rank * batch_size + int(real[rank])]
    send_order = np.argsort(mine, kind="stable").astype(np.int64)
    send_counts = np.bincount(mine, minlength=w).astype(np.int64)
    sources = np.flatnonzero(real_mask(real, batch_size) & (dest == rank)).astype(np.int64)
    recv_counts = np.bincount(sources // batch_size, minlength=w).astype(np.int64)
    return RankPlan(rank, send_order, send_counts, recv_counts, sources)
