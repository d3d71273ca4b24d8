"""Pure, rank-local planning of a shuffle: wire layout, partition, redistribution.

Nothing here communicates. Every function is deterministic in its arguments, so
a test can run it for every rank in one process, and every rank that sees the
same gathered metadata takes the same decision -- the property that keeps the
collectives of :mod:`balancer._comm` matched across ranks.

* :class:`WireLayout` -- how a batch's tensors travel (per-sample lengths and
  segments), a fingerprint of the schema that every rank must share, and the
  size and jagged-gather helpers derived from it.
* :func:`plan_rank` -- from a partition, what this rank sends where, how much it
  receives from whom, and in which order the output lists its samples.
* :func:`partition_task` -- partition, locality refinement and plan: the work of
  the shuffler's background thread (numpy only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any, Literal

import numpy as np
import torch
from torch.profiler import record_function

from balancer.batch import BaseBatch

logger = logging.getLogger(__name__)

__all__ = [
    "Outcome", "PartitionFn", "RankPlan", "Section", "WireLayout", "destinations", "gather_segments",
    "lengths_matrix", "moved_mask", "opaque", "partition_task", "plan_rank", "real_mask", "sample_bytes",
    "section_elements", "section_elements_by_run", "section_tensor", "simple_lower_bound",
    "SUPPORTED_ITEMSIZES", "unsupported_dtypes", "validate_partition", "wire_layout",
]

PartitionFn = Callable[[np.ndarray, int], Sequence[Sequence[int]]]
"""``(workloads [N], num_parts) -> num_parts`` lists of ``N / num_parts`` global
indices; must be deterministic: every rank runs it on identical input."""

# ------------------------------------------------------------------ layout
_OPAQUE = {8: torch.int64, 4: torch.int32, 2: torch.float16, 1: torch.uint8}
"""Per item size, the dtype whose bits the jagged gather copies (see :func:`opaque`)."""

SUPPORTED_ITEMSIZES = frozenset(_OPAQUE)
"""Element sizes (bytes) of the tensors a shuffle can carry."""


def unsupported_dtypes(batch: BaseBatch) -> list[str]:
    """``field[.part]: dtype`` of every tensor whose element size the wire
    format cannot carry (e.g. complex128); checked in phase 1, before any
    data moves."""
    bad = []
    for name, kjt in batch.kjt_fields().items():
        w = kjt.weights_or_none()
        for part, t in (("values", kjt.values()), ("weights", w)):
            if t is not None and t.element_size() not in _OPAQUE:
                bad.append(f"{name}.{part}: {t.dtype}")
    for name, t in batch.dense_fields().items():
        if t.element_size() not in _OPAQUE:
            bad.append(f"{name}: {t.dtype}")
    return bad


@dataclasses.dataclass(frozen=True)
class KJTSpec:
    """One KJT field: ``keys`` own rows ``[row, row + len(keys))`` of the
    fused ``[K_total, B]`` lengths matrix."""

    name: str
    keys: tuple[str, ...]
    row: int
    lengths_dtype: torch.dtype
    values_dtype: torch.dtype
    weights_dtype: torch.dtype | None


@dataclasses.dataclass(frozen=True)
class DenseSpec:
    """One dense field ``[B, *shape]``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Section:
    """One tensor of the batch on the wire: a KJT field's values or weights
    (``count`` keys, lengths rows ``[row, row + count)``; ``width == 0``) or a
    dense field (``width`` elements per sample; ``count == 1``, ``row == -1``)."""

    field: str
    kind: Literal["values", "weights", "dense"]
    dtype: torch.dtype
    itemsize: int
    count: int
    row: int
    width: int


@dataclasses.dataclass(frozen=True)
class WireLayout:
    """How a batch travels, and the schema fingerprint every rank must share.

    A sample is its ``num_lengths`` int64 lengths (every key of every KJT field)
    plus, per section, its elements: ``lengths[k, i]`` per key for KJT
    sections, ``width`` for dense ones.

    Attributes:
        batch_size: samples per batch, B.
        kjts: KJT fields in declaration order.
        dense: dense fields in declaration order.
        sections: every tensor, KJT fields first (values, then weights).
        num_lengths: K_total, rows of the fused lengths matrix.
        fingerprint: int64 hash of the schema.
    """

    batch_size: int
    kjts: tuple[KJTSpec, ...]
    dense: tuple[DenseSpec, ...]
    sections: tuple[Section, ...]
    num_lengths: int
    fingerprint: int


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def wire_layout(batch: BaseBatch) -> WireLayout:
    """The wire layout and schema fingerprint of ``batch``.

    The fingerprint covers the batch class, batch size, every KJT field's name,
    keys, lengths/values/weights dtypes, and every dense field's name, dtype and
    per-sample shape: two ranks whose batches could not be merged sample by
    sample have different fingerprints.
    """
    kjts: list[KJTSpec] = []
    sections: list[Section] = []
    row = 0
    for name, kjt in batch.kjt_fields().items():
        w = kjt.weights_or_none()
        spec = KJTSpec(name, tuple(kjt.keys()), row, kjt.lengths().dtype, kjt.values().dtype,
                       None if w is None else w.dtype)
        kjts.append(spec)
        for kind, dtype in (("values", spec.values_dtype), ("weights", spec.weights_dtype)):
            if dtype is not None:
                sections.append(Section(name, kind, dtype, _itemsize(dtype), len(spec.keys), row, 0))  # type: ignore[arg-type]
        row += len(spec.keys)
    dense = [DenseSpec(n, t.dtype, tuple(t.shape[1:])) for n, t in batch.dense_fields().items()]
    for d in dense:
        width = int(np.prod(d.shape, dtype=np.int64))
        sections.append(Section(d.name, "dense", d.dtype, _itemsize(d.dtype), 1, -1, width))
    schema = repr((type(batch).__module__, type(batch).__qualname__, batch.batch_size,
                   [(s.name, s.keys, str(s.lengths_dtype), str(s.values_dtype), str(s.weights_dtype))
                    for s in kjts],
                   [(d.name, str(d.dtype), d.shape) for d in dense]))
    fp = int.from_bytes(hashlib.blake2b(schema.encode(), digest_size=8).digest(), "little", signed=True)
    return WireLayout(batch.batch_size, tuple(kjts), tuple(dense), tuple(sections), row, fp)


def lengths_matrix(batch: BaseBatch, layout: WireLayout) -> torch.Tensor:
    """[K_total, B] int64 lengths of every KJT field, stacked."""
    kjts, b = batch.kjt_fields(), layout.batch_size
    rows = [kjts[s.name].lengths().view(len(s.keys), b).to(torch.int64) for s in layout.kjts]
    return torch.cat(rows) if rows else torch.zeros(0, b, dtype=torch.int64, device=batch.device)


def sample_bytes(batch: BaseBatch, layout: WireLayout) -> torch.Tensor:
    """[B] int64 bytes each sample occupies on the wire (lengths and payload)."""
    lengths = lengths_matrix(batch, layout)
    out = torch.full((layout.batch_size,), 8 * layout.num_lengths, dtype=torch.int64, device=batch.device)
    for s in layout.sections:
        out += s.width * s.itemsize if s.kind == "dense" else lengths[s.row : s.row + s.count].sum(0) * s.itemsize
    return out


def section_elements(layout: WireLayout, lengths_mk: np.ndarray) -> np.ndarray:
    """[S, K] elements each section holds for samples with lengths [M, K_total]
    (host), per key (dense sections: column 0); K = the most keys of a section."""
    return section_elements_by_run(layout, lengths_mk, np.array([0, lengths_mk.shape[0]]))[0]


def section_elements_by_run(layout: WireLayout, lengths_mk: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """[R, S, K] :func:`section_elements` of each run of samples
    ``lengths_mk[starts[r] : starts[r + 1]]`` (e.g. one run per source rank),
    with one reduction over every key instead of one per (run, section);
    ``starts`` is ascending, from 0 to M."""
    counts = np.diff(starts)
    per_run = np.zeros((counts.size, lengths_mk.shape[1]), np.int64)  # [R, K_total]
    full = counts > 0
    if full.any() and lengths_mk.shape[1]:
        # Empty runs are left out: reduceat would give them one row, not 0.
        per_run[full] = np.add.reduceat(lengths_mk, starts[:-1][full], axis=0)
    k = max((s.count for s in layout.sections), default=0)
    out = np.zeros((counts.size, len(layout.sections), k), np.int64)
    for j, s in enumerate(layout.sections):
        if s.kind == "dense":
            out[:, j, 0] = counts * s.width
        else:
            out[:, j, : s.count] = per_run[:, s.row : s.row + s.count]
    return out


def section_tensor(batch: BaseBatch, s: Section) -> torch.Tensor:
    """The tensor behind section ``s`` of ``batch``."""
    if s.kind == "dense":
        return batch.dense_fields()[s.field]
    kjt = batch.kjt_fields()[s.field]
    return kjt.values() if s.kind == "values" else kjt.weights()


def opaque(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened and viewed as the same-size dtype that the jagged gather
    copies (int64, int32, float16, uint8): bits are moved, never computed on."""
    flat = t.contiguous().reshape(-1)
    return flat.view(_OPAQUE[flat.element_size()])


def gather_segments(buf: torch.Tensor, seg_lengths: torch.Tensor, seg_ids: torch.Tensor,
                    total: int) -> torch.Tensor:
    """Concatenate segments ``seg_ids`` of ``buf`` (segment j: ``seg_lengths[j]``
    elements, segments stored back to back); ``total`` is the result's size."""
    if seg_ids.numel() == 0 or total == 0:
        return buf.new_empty(total)
    if buf.dtype != torch.uint8 and hasattr(torch.ops.fbgemm, "permute_1D_sparse_data"):
        try:
            # permuted_lengths_sum spares the kernel a device-to-host sync on CUDA.
            _, out, _ = torch.ops.fbgemm.permute_1D_sparse_data(
                seg_ids.to(torch.int32), seg_lengths, buf, None, total)
            return out
        except (NotImplementedError, RuntimeError):  # a build without this dtype/device
            logger.debug("fbgemm permute_1D_sparse_data failed for %s; using torch", buf.dtype)
    offsets = torch.zeros(seg_lengths.numel() + 1, dtype=torch.int64, device=buf.device)
    torch.cumsum(seg_lengths, 0, out=offsets[1:])
    sel = seg_lengths[seg_ids]
    out_seg = torch.repeat_interleave(torch.arange(seg_ids.numel(), device=buf.device), sel,
                                      output_size=total)
    out_start = torch.cumsum(sel, 0) - sel
    idx = offsets[seg_ids][out_seg] + torch.arange(total, device=buf.device) - out_start[out_seg]
    return buf[idx]


# ---------------------------------------------------------- redistribution
def validate_partition(
    parts: Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray, num_parts: int, batch_size: int
) -> list[np.ndarray]:
    """Check that ``parts`` splits ``range(num_parts * batch_size)`` into
    ``num_parts`` parts of exactly ``batch_size`` indices.

    Returns:
        The parts as int64 arrays.

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
    return out


def real_mask(real: np.ndarray, batch_size: int) -> np.ndarray:
    """[W * B] bool: whether global sample ``g = r * B + i`` is real (``i < real[r]``)."""
    return (np.arange(batch_size) < np.asarray(real)[:, None]).reshape(-1)


def moved_mask(dest: np.ndarray, batch_size: int) -> np.ndarray:
    """[W * B] bool: whether global sample ``g`` leaves its rank (``dest[g] != g // B``)."""
    w = dest.size // batch_size
    return (dest.reshape(w, batch_size) != np.arange(w)[:, None]).reshape(-1)


def destinations(parts: Sequence[np.ndarray], n: int) -> np.ndarray:
    """``dest[g]``: the rank that gets global sample ``g`` (``g = rank * B + i``)."""
    dest = np.empty(n, dtype=np.int64)
    for r, p in enumerate(parts):
        dest[p] = r
    return dest


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """What one rank does in phase 2.

    Attributes:
        rank: this rank.
        send_order: [sum(send_counts)] local indices of this rank's real samples,
            grouped by destination rank (ascending; this rank's own group,
            the samples that stay, at position ``rank``), ascending within a
            group.
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


# ------------------------------------------------------------ partition task
@dataclasses.dataclass(frozen=True)
class Outcome:
    """Result of the partition thread (host data only)."""

    dest: np.ndarray  # [W * B] destination rank per global sample
    plan: RankPlan
    lower_bound: float
    seconds: float
    moves: bool  # some real sample changes rank (the same on every rank)


def simple_lower_bound(workloads: np.ndarray, num_parts: int) -> float:
    """``max(mean load, largest workload)``: no partition does better."""
    return float(max(workloads.sum() / num_parts, workloads.max(initial=0)))


def _max_load(parts: list[np.ndarray], workloads: np.ndarray) -> int:
    """Largest part load; parts are validated, so all have the same size."""
    if not parts:
        return 0
    return int(workloads[np.concatenate(parts)].reshape(len(parts), -1).sum(1).max(initial=0))


def partition_task(workloads: np.ndarray, sizes: np.ndarray, real: np.ndarray, rank: int,
                   partition: PartitionFn, localize: Callable[..., Any] | None,
                   bound: Callable[[np.ndarray, int], float]) -> Outcome:
    """Partition, refine for locality, plan ``rank``'s phase 2.

    Runs in the shuffler's thread: numpy in, numpy out, no device memory.

    Args:
        workloads: [W * B] by global index, 0 for padding.
        sizes: [W * B] bytes by global index, 0 for padding.
        real: [W] real samples per rank.
        rank: this rank.
        partition: the partitioner.
        localize: ``balancer.partition.localize`` or ``None`` (placement-blind).
        bound: lower bound of the max load.
    """
    with record_function("## balancer.shuffle.partition ##"):
        t0 = perf_counter()
        w = real.size
        b = workloads.size // w
        parts = validate_partition(partition(workloads, w), w, b)
        if localize is not None:
            home = np.arange(workloads.size, dtype=np.int64) // b
            moved = localize(np.stack(parts), workloads, home, sizes)
            local = validate_partition(moved, w, b)
            if _max_load(local, workloads) <= _max_load(parts, workloads):
                parts = local
            else:
                logger.warning("localize raised the max load; keeping the partition as returned")
        return plan_outcome(parts, workloads, real, rank, bound, t0)


def plan_outcome(parts: list[np.ndarray], workloads: np.ndarray, real: np.ndarray, rank: int,
                 bound: Callable[[np.ndarray, int], float], t0: float) -> Outcome:
    """From validated parts to ``rank``'s phase-2 plan: the never-worse guard,
    destinations, the plan, the lower bound; ``t0`` is when partitioning began."""
    w = real.size
    b = workloads.size // w
    if _max_load(parts, workloads) > int(workloads.reshape(w, b).sum(1).max(initial=0)):
        # Never worsen the max load: then nothing moves.
        parts = [np.arange(r * b, (r + 1) * b, dtype=np.int64) for r in range(w)]
    dest = destinations(parts, workloads.size)
    plan = plan_rank(dest, b, real, rank)
    lb = float(bound(workloads, w))
    moves = bool((moved_mask(dest, b) & real_mask(real, b)).any())
    return Outcome(dest, plan, lb, perf_counter() - t0, moves)


# Leaves room so that sums of partition loads (and doubled sums inside the
# partitioner, which accepts totals below 2**61) never overflow int64.
_MAX_TOTAL = 1 << 60


def fit_total(workloads: np.ndarray) -> np.ndarray:
    """Workloads scaled down by a power of two so their total is below 2**60.

    Balancing depends only on ratios, so a right shift (which keeps order and
    zeros) changes nothing but the resolution of huge costs, e.g. a few
    saturated ``MAX_COST`` samples. Returns ``workloads`` itself when it fits.
    """
    total = float(workloads.sum(dtype=np.float64))
    if total < _MAX_TOTAL:
        return workloads
    shift = int(np.ceil(np.log2(total / _MAX_TOTAL))) + 1
    return np.right_shift(workloads, shift)
