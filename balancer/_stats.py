"""Shuffle metadata: what each rank measures, how ranks agree, what it cost.

* :func:`local_input` -- this rank's workloads and per-sample bytes, validated
  without raising: a problem becomes an error status in the phase-1 header, so
  the rank still joins the all-gather and every rank can raise together.
* :func:`decide` -- reads the gathered phase-1 headers: proceed, re-agree on a
  new batch size / schema, or raise the same error on every rank. Pure: every
  rank takes the same decision from the same headers.
* :class:`ShuffleStats` -- balance before/after, time per phase, traffic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from balancer._comm import Traffic
from balancer._plan import (
    SUPPORTED_ITEMSIZES,
    moved_mask,
    real_mask,
    sample_bytes,
    unsupported_dtypes,
    wire_layout,
)
from balancer.batch import BaseBatch
from balancer.workloads import MAX_COST

__all__ = [
    "HEADER_LEN", "Agreement", "LocalInput", "ShuffleStats", "Status", "Verdict", "build_stats",
    "decide", "format_stats", "local_input",
]

# --------------------------------------------------------------- agreement
HEADER_LEN = 8
"""int64 entries of a phase-1 header: magic, status, batch size, fingerprint,
real samples, detail, payload length, reserved."""
MAGIC = 0x62616C616E6301  # "balanc" + protocol version 1
H_MAGIC, H_STATUS, H_BATCH, H_FP, H_REAL, H_DETAIL, H_SIZE = range(7)


class Status:
    """Bits of a header's status word (0: the rank's input is valid)."""

    BAD_INPUT = 1  # detected on the host: batch type, workload shape/dtype, exception
    NEGATIVE = 2  # a real sample's workload is < 0 (detail: its index)
    NONFINITE = 4  # a real sample's workload is NaN or infinite (detail: its index)
    BAD_REAL = 8  # actual_batch_size outside [0, batch_size]


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What every rank agreed on: the phase-1 payload is sized from it."""

    batch_size: int
    fingerprint: int


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of :func:`decide`; identical on every rank for the same headers.

    ``kind``: ``"ok"`` (payload valid), ``"retry"`` (every rank moved to the same
    new ``agreement``; gather again), ``"error"`` (raise ``message``, naming
    ``offenders``).
    """

    kind: Literal["ok", "retry", "error"]
    agreement: Agreement | None = None
    message: str = ""
    offenders: tuple[int, ...] = ()


def _status_text(r: int, h: np.ndarray) -> str:
    st, detail = int(h[H_STATUS]), int(h[H_DETAIL])
    out = []
    if st & Status.BAD_INPUT:
        out.append(f"rank {r}: invalid batch or workload_fn output (details in rank {r}'s error)")
    if st & Status.BAD_REAL:
        out.append(f"rank {r}: actual_batch_size={int(h[H_REAL])}, expected 0 <= "
                   f"actual_batch_size <= batch_size={int(h[H_BATCH])}")
    if st & Status.NEGATIVE:
        out.append(f"rank {r}: workloads[{detail}] < 0, expected workloads >= 0 for real samples")
    if st & Status.NONFINITE:
        out.append(f"rank {r}: workloads[{detail}] is NaN or infinite, expected finite values")
    return "; ".join(out)


def decide(headers: np.ndarray, agreed: Agreement | None) -> Verdict:
    """Decide from the gathered headers ``[W, HEADER_LEN]`` what every rank does.

    Example (W=2, agreed batch size 4)::

        rank0 header: status 0, batch 4    rank1 header: status 0, batch 4  -> ok
        rank0 header: status 0, batch 6    rank1 header: status 0, batch 6  -> retry(6)
        rank0 header: status 0, batch 4    rank1 header: status 0, batch 6  -> error [1]
        rank0 header: status 0, batch 4    rank1 header: NEGATIVE at 2      -> error [1]

    Args:
        headers: [W, HEADER_LEN] int64, row r from rank r.
        agreed: the agreement the payload was sized from, ``None`` before the
            first one (header-only exchange).

    Returns:
        The :class:`Verdict`.
    """
    w = headers.shape[0]
    bad_magic = [r for r in range(w) if int(headers[r, H_MAGIC]) != MAGIC]
    if bad_magic:
        return Verdict("error", message=f"ranks {bad_magic} sent an unrecognised shuffle header "
                       "(a different balancer version, or shuffles issued in a different order)",
                       offenders=tuple(bad_magic))
    bad = [r for r in range(w) if int(headers[r, H_STATUS]) != 0]
    if bad:
        text = "; ".join(_status_text(r, headers[r]) for r in bad)
        return Verdict("error", message=f"invalid shuffle input on rank(s) {bad}: {text}",
                       offenders=tuple(bad))
    schemas = [Agreement(int(headers[r, H_BATCH]), int(headers[r, H_FP])) for r in range(w)]
    if len(set(schemas)) == 1:
        if schemas[0] == agreed:
            return Verdict("ok", agreed)
        return Verdict("retry", schemas[0])
    expected = agreed if agreed is not None and agreed in schemas else schemas[0]
    off = [r for r in range(w) if schemas[r] != expected]
    parts = []
    for r in off:
        s = schemas[r]
        if s.batch_size != expected.batch_size:
            parts.append(f"rank {r}: batch_size={s.batch_size}, expected {expected.batch_size}")
        else:
            parts.append(f"rank {r}: batch schema fingerprint {s.fingerprint:#x}, expected "
                         f"{expected.fingerprint:#x} (batch class, KJT keys/dtypes or dense "
                         "shapes/dtypes differ)")
    return Verdict("error", message=f"batch mismatch on rank(s) {off}: " + "; ".join(parts),
                   offenders=tuple(off))


@dataclasses.dataclass
class LocalInput:
    """This rank's phase-1 input, validated without raising."""

    header: list[int]
    device: torch.device
    workloads: torch.Tensor | None = None  # [B] int64
    sizes: torch.Tensor | None = None  # [B] int64
    flags: torch.Tensor | None = None  # [2]: device-detected status bits, detail
    error: str = ""
    cause: BaseException | None = None

    def message(self, agreed: Agreement | None) -> torch.Tensor:
        """Header + payload sized from ``agreed``; zeros when this rank's input is
        not usable under ``agreed`` (the size never depends on local data)."""
        size = agreed.batch_size if agreed is not None else 0
        header = list(self.header)
        header[H_SIZE] = size
        msg = torch.zeros(HEADER_LEN + 2 * size, dtype=torch.int64, device=self.device)
        msg[:HEADER_LEN] = torch.tensor(header, dtype=torch.int64)
        if self.flags is not None:
            msg[H_STATUS : H_STATUS + 1].bitwise_or_(self.flags[:1])
            msg[H_DETAIL : H_DETAIL + 1].copy_(self.flags[1:])
        usable = agreed == Agreement(header[H_BATCH], header[H_FP]) and not self.error
        if usable and self.workloads is not None and self.sizes is not None:
            msg[HEADER_LEN : HEADER_LEN + size] = self.workloads
            msg[HEADER_LEN + size :] = self.sizes
        return msg


def _default_device(pg: Any) -> torch.device:
    if pg is not None and dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_input(batch: Any, workload_fn: Callable[[Any], Any], rank: int, pg: Any) -> LocalInput:
    """Validate ``batch`` and its workloads; errors go into the header."""
    if not isinstance(batch, BaseBatch):
        msg = f"batch is a {type(batch).__name__}, expected a BaseBatch (rank {rank})"
        return LocalInput([MAGIC, Status.BAD_INPUT, -1, 0, 0, -1, 0, 0], _default_device(pg), error=msg)
    b, real = batch.batch_size, int(batch.actual_batch_size or 0)
    layout = wire_layout(batch)
    local = LocalInput([MAGIC, 0, b, layout.fingerprint, real, -1, 0, 0], batch.device)
    if not 0 <= real <= b:
        local.header[H_STATUS] |= Status.BAD_REAL
        local.error = f"actual_batch_size={real}, expected 0 <= actual_batch_size <= {b} (rank {rank})"
        return local
    try:
        w = torch.as_tensor(workload_fn(batch))
    except Exception as e:  # reported on every rank, re-raised here as the cause
        local.header[H_STATUS] |= Status.BAD_INPUT
        local.error, local.cause = f"workload_fn raised {type(e).__name__}: {e} (rank {rank})", e
        return local
    if w.dim() != 1 or w.numel() != b or w.is_complex() or w.dtype == torch.bool:
        local.header[H_STATUS] |= Status.BAD_INPUT
        local.error = (f"workloads has shape {tuple(w.shape)} and dtype {w.dtype}, expected "
                       f"[batch_size={b}] of an integer or floating dtype (rank {rank})")
        return local
    bad_dtypes = unsupported_dtypes(batch)
    if bad_dtypes:
        local.header[H_STATUS] |= Status.BAD_INPUT
        local.error = (f"fields {bad_dtypes} have an element size the wire format cannot carry; "
                       f"expected one of {sorted(SUPPORTED_ITEMSIZES)} bytes (rank {rank})")
        return local
    if batch.device.type == "cpu":  # free to check on the host, a sync on CUDA
        for name, kjt in batch.kjt_fields().items():
            n, wt = int(kjt.lengths().sum()), kjt.weights_or_none()
            if kjt.values().numel() != n or (wt is not None and wt.numel() != n):
                local.header[H_STATUS] |= Status.BAD_INPUT
                local.error = f"{name}: values/weights size != sum(lengths)={n} (rank {rank})"
                return local
    w = w.to(batch.device)[:real]
    bad_neg = w < 0
    bad_nan = ~torch.isfinite(w) if w.is_floating_point() else torch.zeros_like(bad_neg)
    bad = bad_neg | bad_nan
    status = bad_neg.any().long() * Status.NEGATIVE + bad_nan.any().long() * Status.NONFINITE
    first = torch.where(bad.any(), bad.long().argmax() if real else bad.new_zeros((), dtype=torch.long), -1)
    local.flags = torch.stack([status, first])
    clean = torch.where(bad, torch.zeros_like(w), w)
    local.workloads = torch.zeros(b, dtype=torch.int64, device=batch.device)
    # float -> int64 of a value >= 2**63 is undefined: clamp like the estimators do.
    local.workloads[:real] = (
        clean.round().clamp(0.0, float(MAX_COST)).long() if clean.is_floating_point() else clean.long()
    )
    local.sizes = sample_bytes(batch, layout)
    return local




@dataclasses.dataclass(frozen=True)
class ShuffleStats:
    """Statistics of one finished shuffle, seen from one rank.

    Loads are sums of real samples' workloads (padding counts 0). Balance
    numbers are global (equal on every rank); traffic is this rank's.

    Attributes:
        seq: the handle's sequence number on this shuffler.
        world_size: W.
        rank: this rank.
        comm: ``"all2all"``, ``"allgather"`` or ``"identity"``.
        load_before: [W] per-rank load of the input batches.
        load_after: [W] per-rank load of the output batches.
        max_before: ``max(load_before)``.
        mean_before: ``mean(load_before)``.
        max_after: ``max(load_after)``.
        mean_after: ``mean(load_after)`` (equal to ``mean_before``).
        lower_bound: no partition with B samples per rank has a smaller max load.
        partition_s: seconds the partition (and locality refinement) took in
            the background thread.
        phase1_s: wall seconds of phase 1 (workloads, all-gather, submit).
        phase2_s: wall seconds of phase 2 (wait for partition, redistribute).
        wait_s: part of ``phase2_s`` spent waiting for the partition; near 0
            when enough work overlaps the background partition.
        samples_sent: real samples this rank sent to other ranks.
        samples_received: real samples this rank received from other ranks.
        bytes_sent: bytes this rank sent to other ranks.
        bytes_received: bytes this rank received from other ranks.
        moved_fraction: fraction of all ranks' real samples that changed rank
            (0 when there are none).
    """

    seq: int
    world_size: int
    rank: int
    comm: str
    load_before: list[int]
    load_after: list[int]
    max_before: float
    mean_before: float
    max_after: float
    mean_after: float
    lower_bound: float
    partition_s: float
    phase1_s: float
    phase2_s: float
    wait_s: float
    samples_sent: int
    samples_received: int
    bytes_sent: int
    bytes_received: int
    moved_fraction: float

    @property
    def imbalance_before(self) -> float:
        """``max_before / mean_before`` (1.0 is perfect; 1.0 when idle)."""
        return self.max_before / self.mean_before if self.mean_before else 1.0

    @property
    def imbalance_after(self) -> float:
        """``max_after / mean_after`` (1.0 is perfect; 1.0 when idle)."""
        return self.max_after / self.mean_after if self.mean_after else 1.0


def build_stats(
    *,
    seq: int,
    rank: int,
    comm: str,
    workloads: np.ndarray,
    dest: np.ndarray,
    real: np.ndarray,
    lower_bound: float,
    partition_s: float,
    phase1_s: float,
    phase2_s: float,
    wait_s: float,
    traffic: Traffic,
) -> ShuffleStats:
    """Assemble :class:`ShuffleStats`.

    Args:
        workloads: [W * B] workloads by global index, 0 for padding.
        dest: [W * B] destination rank by global index.
        real: [W] real samples per rank.
    """
    w = real.size
    b = workloads.size // w if w else 0
    before = workloads.reshape(w, b).sum(axis=1) if b else np.zeros(w, np.int64)
    after = np.zeros(w, dtype=np.int64)
    np.add.at(after, dest, workloads)
    is_real = real_mask(real, b) if b else np.zeros(0, bool)
    total_real = int(is_real.sum())
    moved = int((is_real & moved_mask(dest, b)).sum()) if b else 0
    return ShuffleStats(
        seq=seq,
        world_size=int(w),
        rank=rank,
        comm=comm,
        load_before=[int(x) for x in before],
        load_after=[int(x) for x in after],
        max_before=float(before.max(initial=0)),
        mean_before=float(before.mean()) if w else 0.0,
        max_after=float(after.max(initial=0)),
        mean_after=float(after.mean()) if w else 0.0,
        lower_bound=float(lower_bound),
        partition_s=partition_s,
        phase1_s=phase1_s,
        phase2_s=phase2_s,
        wait_s=wait_s,
        samples_sent=traffic.samples_sent,
        samples_received=traffic.samples_received,
        bytes_sent=traffic.bytes_sent,
        bytes_received=traffic.bytes_received,
        moved_fraction=moved / total_real if total_real else 0.0,
    )


def format_stats(s: ShuffleStats) -> str:
    """One log line for ``s``."""
    return (
        f"shuffle #{s.seq} ({s.comm}, W={s.world_size}): max/mean load "
        f"{s.max_before:.4g}/{s.mean_before:.4g} -> {s.max_after:.4g}/{s.mean_after:.4g} "
        f"(imbalance {s.imbalance_before:.3f} -> {s.imbalance_after:.3f}, lower bound "
        f"{s.lower_bound:.4g}); moved {100 * s.moved_fraction:.1f}% of samples; rank {s.rank} "
        f"sent {s.samples_sent} samples / {s.bytes_sent} B, received {s.samples_received} / "
        f"{s.bytes_received} B; phase1 {1e3 * s.phase1_s:.2f} ms, partition "
        f"{1e3 * s.partition_s:.2f} ms, phase2 {1e3 * s.phase2_s:.2f} ms (waited {1e3 * s.wait_s:.2f} ms)"
    )
