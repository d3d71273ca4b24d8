"""Pure, rank-local planning: from phase 1's gathered metadata to who sends what where.

Nothing here communicates or reads a device tensor. Every function is
deterministic in its arguments, so a test can run it for every rank in one
process, and every rank that saw the same gathered metadata takes the same
decision -- the property that keeps phase 2's collective matched across ranks.

* :class:`PlanLayout` -- the numpy view of a batch's wire layout (this module
  and everything it plans with import no torch: they run in the torch-free
  planner process).
* :class:`Gathered` -- what phase 1 gave every rank: workloads, lengths and
  real-sample counts of every rank's batch.
* :func:`partition` -- the partition (child process, thread or a custom
  function), locality refinement and the never-worse guard, on scale-free
  integer workloads (:mod:`balancer._quantize`).
* :func:`plan_rank` -- from the destinations, what this rank sends where, how
  much it receives from whom, and in which order its output lists samples.
* :func:`plan_digest` -- a hash of the destinations that ranks compare.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import numpy as np

from balancer._quantize import quantize
from balancer.partition._balanced import solve_rows
from balancer.partition._worker import PartitionWorker

__all__ = [
    "Gathered", "KJTPlan", "PartitionFn", "PartitionResult", "PlanLayout", "RankPlan", "SectionPlan",
    "destinations", "moved_mask", "partition", "partition_free", "plan_digest", "plan_rank", "real_mask",
    "sample_bytes", "validate_partition",
]

PartitionFn = Callable[[np.ndarray, int], Sequence[Sequence[int]]]
"""``(workloads [N], num_parts) -> num_parts`` lists of ``N / num_parts`` global
indices; must be deterministic: every rank runs it on identical input. The
shuffler passes scale-free int64 workloads (:func:`balancer._quantize.quantize`)."""


@dataclasses.dataclass(frozen=True)
class SectionPlan:
    """A wire section as the planner sees it (see :class:`balancer._layout.Section`)."""

    jagged: bool  # elements per sample follow the lengths (KJT values/weights, tokens); else dense
    row: int  # first row of its keys in the lengths matrix (-1 for dense)
    count: int  # keys (1 for dense)
    itemsize: int  # bytes per element
    width: int  # jagged: elements per length unit; dense: elements per sample
    stride: int = 0  # jagged: elements per sample slot (padded tokens); 0: back to back


@dataclasses.dataclass(frozen=True)
class KJTPlan:
    """A KJT field as the planner sees it: its rows of the lengths matrix."""

    row: int
    num_keys: int
    int32: bool  # lengths dtype int32 (else int64)


@dataclasses.dataclass(frozen=True)
class PlanLayout:
    """The numpy view of a :class:`balancer._layout.WireLayout`: what planning needs."""

    batch_size: int
    num_lengths: int
    sections: tuple[SectionPlan, ...]
    kjts: tuple[KJTPlan, ...]  # the fields whose output lengths are rebuilt (a TokenBatch: seq_lens)
    pad_multiple: int = 1  # padded token fields: output length rounded up to this


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


def sample_bytes(layout: PlanLayout, lengths: np.ndarray) -> np.ndarray:
    """[W * B] bytes each sample occupies in phase 2's payload (lengths [W, K, B])."""
    w, _, b = lengths.shape
    out = np.zeros((w, b), np.int64)
    for s in layout.sections:
        if s.jagged:
            out += lengths[:, s.row : s.row + s.count].sum(axis=1) * s.width * s.itemsize
        else:
            out += s.width * s.itemsize
    return out.reshape(-1)


# ---------------------------------------------------------------- partition
def validate_partition(parts: Any, num_parts: int, batch_size: int) -> np.ndarray:
    """Check that ``parts`` splits ``range(num_parts * batch_size)`` into
    ``num_parts`` parts of exactly ``batch_size`` indices.

    Returns:
        The parts as an int64 array ``[num_parts, batch_size]``.

    Raises:
        ValueError: naming the offending part and the expectation.
    """
    n = num_parts * batch_size
    if len(parts) != num_parts:
        raise ValueError(f"partition returned {len(parts)} parts, expected num_parts={num_parts}")
    out = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]
    for r, p in enumerate(out):
        if p.size != batch_size:
            raise ValueError(f"partition part {r} has {p.size} indices, expected batch_size={batch_size}")
    flat = np.concatenate(out) if out else np.empty(0, np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= n):
        raise ValueError(f"partition indices span [{flat.min()}, {flat.max()}], expected [0, {n})")
    if np.bincount(flat, minlength=n).max(initial=1) != 1:
        raise ValueError(f"partition is not a permutation of range({n}): an index repeats")
    return flat.reshape(num_parts, batch_size)


def destinations(parts: np.ndarray, n: int) -> np.ndarray:
    """``dest[g]``: the rank that gets global sample ``g`` (``parts[r]`` goes to rank r)."""
    dest = np.empty(n, dtype=np.int64)
    for r, p in enumerate(parts):
        dest[p] = r
    return dest


def _max_load(rows: np.ndarray, q: np.ndarray) -> int:
    return int(q[rows].sum(axis=1).max(initial=0)) if rows.size else 0


@dataclasses.dataclass(frozen=True)
class PartitionResult:
    """Destinations of one shuffle and how they were found (host data only)."""

    dest: np.ndarray  # [W * B] destination rank per global sample
    lower_bound: float  # in workload units
    seconds: float  # partition compute time (child or thread), not waiting


def partition(g: Gathered, layout: PlanLayout, *, fn: PartitionFn | None, worker: PartitionWorker | None,
              locality: bool, localize: Callable[..., Any], lower_bound: Callable[..., float],
              capacity: int | None = None) -> PartitionResult:
    """Partition the gathered workloads into W parts of B (background thread).

    ``worker`` (the torch-free child) runs ``balanced_partition`` (+ locality)
    when given; if it died, the same :func:`balancer.partition._balanced.solve_rows`
    runs here, giving the rows every other rank's child gives. Otherwise ``fn``
    runs here, then ``localize``. The result is never worse than not moving.

    With ``capacity`` the parts are free in size, up to ``capacity`` real
    samples each (:func:`balancer.partition.free_partition`); see
    :func:`partition_free`.
    """
    if capacity is not None:
        return partition_free(g, layout, capacity, locality)
    w, b = g.world_size, g.batch_size
    x = g.workloads
    home = np.arange(x.size, dtype=np.int64) // b if locality else None
    sizes = sample_bytes(layout, g.lengths).astype(np.float64) if locality else None
    q = quantize(x)
    if fn is None:
        rows = None
        if worker is not None:
            try:
                pending = worker.submit(x, w, home, sizes, quantized=True)
                rows, seconds, bound = pending.wait_rows(), pending.seconds, pending.lower_bound
            except (EOFError, OSError):  # the child is gone: same computation here
                rows = None
        if rows is None:
            rows, seconds, bound = solve_rows(x, w, home, sizes, quantized=True)
        rows = validate_partition(rows, w, b)
    else:
        t0 = perf_counter()
        rows = validate_partition(fn(q, w), w, b)
        if locality:
            moved = validate_partition(localize(rows.tolist(), q, home, sizes), w, b)
            rows = moved if _max_load(moved, q) <= _max_load(rows, q) else rows
        seconds = perf_counter() - t0
        top = float(x.max(initial=0.0))
        bound = float(lower_bound(x / top, w)) * top if top > 0 else 0.0
    if _max_load(rows, q) > _max_load(np.arange(w * b).reshape(w, b), q):
        rows = np.arange(w * b, dtype=np.int64).reshape(w, b)  # never worse than staying
    return PartitionResult(destinations(rows, w * b), bound, seconds)


def partition_free(g: Gathered, layout: PlanLayout, capacity: int, locality: bool) -> PartitionResult:
    """Real samples into W parts of at most ``capacity`` each, smallest max load.

    Padding samples stay home (they are never sent). With ``locality`` whole
    parts go to the ranks that already hold most of their bytes (greedy on the
    W x W overlap); items are not traded. Never worse than equal counts
    (``balanced_partition`` is tried too), nor than not moving.
    """
    from balancer.partition._bound import bound_sorted
    from balancer.partition._free import free_assign

    w, b = g.world_size, g.batch_size
    idx = np.flatnonzero(real_mask(g.real, b))
    home = idx // b
    dest = np.arange(w * b, dtype=np.int64) // b
    x = g.workloads[idx]
    q = quantize(x)
    t0 = perf_counter()
    labels = free_assign(q, w, 0, capacity) if idx.size else np.zeros(0, np.int64)
    if labels is None:  # the greedy could not place every item under the cap: stay
        labels = home.copy()
    labels = np.asarray(labels, np.int64)
    sizes = sample_bytes(layout, g.lengths).astype(np.float64)
    if locality and idx.size:
        labels = _assign_parts(labels, home, sizes[idx], w)
    # Equal counts are one answer the free problem allows: keep whichever of
    # the two has the smaller max load (the free heuristic is not always better).
    rows, _, _ = solve_rows(g.workloads, w, dest if locality else None, sizes if locality else None, quantized=True)
    equal = destinations(rows, w * b)[idx]
    load = lambda lab: np.bincount(lab, weights=q, minlength=w).max(initial=0)  # noqa: E731
    if load(equal) < load(labels):
        labels = equal
    if load(labels) > load(home):
        labels = home  # never worse than staying
    dest[idx] = labels
    seconds = perf_counter() - t0
    top = float(x.max(initial=0.0))
    bound = float(bound_sorted(np.sort(x / top), w, equal_size=False, max_size=capacity)) * top if top > 0 else 0.0
    return PartitionResult(dest, bound * (1 - 8 * x.size * np.finfo(np.float64).eps), seconds)


def _assign_parts(labels: np.ndarray, home: np.ndarray, sizes: np.ndarray, w: int) -> np.ndarray:
    """Relabel parts so each goes to the rank holding most of its bytes (greedy, deterministic)."""
    overlap = np.zeros((w, w))
    np.add.at(overlap, (labels, home), sizes)
    to_rank = np.full(w, -1, np.int64)
    taken = np.zeros(w, bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        p, r = divmod(int(flat), w)
        if to_rank[p] < 0 and not taken[r]:
            to_rank[p], taken[r] = r, True
    return to_rank[labels]


def plan_digest(dest: np.ndarray) -> int:
    """int64 hash of the destinations; ranks compare it to detect diverging plans."""
    raw = np.ascontiguousarray(dest, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)


# --------------------------------------------------------------------- plan
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
