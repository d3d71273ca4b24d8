"""The collectives of a shuffle, and the packing around them.

This is the only module of balancer that issues collectives. All of them run on
the calling thread and, for NCCL, are ordered after the work already queued on
the current stream. Every size passed to a collective is either fixed by the
agreement of phase 1 or derived from data that every rank has seen identically
(the gathered headers, or lengths received in the same shuffle): a rank never
sizes a message from data the other ranks have not validated.

Wire format: a batch is a grid of byte segments, one row per sample and one
column per KJT key's values, per KJT key's weights and per dense field (see
:class:`balancer._plan.WireLayout`). A batch's tensors, concatenated, are that
grid column by column; a packed send buffer is the grid row by row (sample by
sample) for the samples in send order. One jagged gather converts between the
two, at memcpy speed on CPU (fbgemm) and CUDA.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer._plan import RankPlan, WireLayout
from balancer.batch import BaseBatch, pad_batch

logger = logging.getLogger(__name__)

__all__ = [
    "Traffic",
    "all_gather_fixed",
    "all_to_all_uneven",
    "redistribute_all2all",
    "redistribute_allgather",
    "sample_bytes",
]

# torch >= 2.13 deprecates all_gather_into_tensor in favour of all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_FBGEMM_DTYPES = (torch.int32, torch.int64, torch.float16)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What this rank's phase-2 collectives moved over the network.

    Samples and bytes that stay on this rank are not counted. For the
    all-gather path every rank's (padded) buffer goes to every other rank.
    """

    samples_sent: int = 0
    samples_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


# ------------------------------------------------------------- collectives
def all_gather_fixed(t: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    """All-gather a 1-D tensor whose size every rank knows in advance.

    Example (W=2)::

        rank0: t = [1, 2]       rank1: t = [3, 4]
        both:  out = [[1, 2],
                      [3, 4]]

    Args:
        t: [M] tensor; M equal on every rank (a mismatch aborts gloo, hangs
            NCCL -- callers size it from an agreed value).
        pg: process group.

    Returns:
        [W, M] tensor, row r from rank r, on ``t``'s device.
    """
    w = dist.get_world_size(pg)
    out = t.new_empty(w * t.numel())
    _all_gather_single(out, t.contiguous(), group=pg)
    return out.view(w, t.numel())


def all_to_all_uneven(
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    pg: dist.ProcessGroup,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``all_to_all_single`` of a 1-D tensor with uneven splits.

    Example (W=2; ``send_splits[d]`` elements go to rank d, in rank order)::

        rank0: send = [a0, a1, a2]  send_splits [1, 2]  recv_splits [1, 1]
        rank1: send = [b0, b1]      send_splits [1, 1]  recv_splits [2, 1]
        rank0: out  = [a0, b0]      rank1: out = [a1, a2, b1]

    ``recv_splits[s]`` on rank r must equal ``send_splits[r]`` on rank s; both
    come from the same plan (:func:`balancer._plan.plan_rank`) or from lengths
    received in the previous collective. The chunk a rank sends to itself is a
    local copy.

    Args:
        send: [sum(send_splits)] tensor.
        send_splits: [W] elements per destination.
        recv_splits: [W] elements per source.
        pg: process group.
        out: optional [sum(recv_splits)] output tensor (same dtype).

    Returns:
        [sum(recv_splits)] tensor, chunks in source-rank order.
    """
    assert send.numel() == sum(send_splits), f"{send.numel()} != sum({send_splits})"
    if out is None:
        out = send.new_empty(sum(recv_splits))
    assert out.numel() == sum(recv_splits), f"{out.numel()} != sum({recv_splits})"
    dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=pg)
    return out


# ------------------------------------------------------------------ packing
def _lengths_matrix(batch: BaseBatch, layout: WireLayout) -> torch.Tensor:
    """[K_total, B] int64 lengths of every KJT field, stacked."""
    kjts = batch.kjt_fields()
    b = layout.batch_size
    rows = [kjts[s.name].lengths().view(len(s.keys), b).to(torch.int64) for s in layout.kjts]
    return torch.cat(rows) if rows else torch.zeros(0, b, dtype=torch.int64, device=batch.device)


def _column_units(lengths_mk: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """[M, C] packing units of every (sample, column), from [M, K_total] lengths."""
    dev = lengths_mk.device
    ext = torch.cat([lengths_mk, lengths_mk.new_ones(lengths_mk.shape[0], 1)], dim=1)
    row_of = torch.tensor(layout.row_of, dtype=torch.int64, device=dev)
    mult = torch.tensor(layout.mult, dtype=torch.int64, device=dev)
    return ext.index_select(1, row_of) * mult


def sample_bytes(batch: BaseBatch, layout: WireLayout) -> torch.Tensor:
    """[B] int64 bytes a sample occupies on the wire (its lengths and payload)."""
    units = _column_units(_lengths_matrix(batch, layout).t(), layout)
    return units.sum(1) * layout.unit + 8 * layout.num_lengths


def _source_units(batch: BaseBatch, layout: WireLayout) -> torch.Tensor:
    """The batch's tensors in section order as one flat tensor of packing units."""
    kjts, dense = batch.kjt_fields(), batch.dense_fields()
    pieces = []
    for s in layout.sections:
        if s.kind == "dense":
            t = dense[s.field]
        elif s.kind == "values":
            t = kjts[s.field].values()
        else:
            t = kjts[s.field].weights()
        pieces.append(t.contiguous().reshape(-1).view(torch.uint8).view(layout.unit_dtype))
    if not pieces:
        return torch.zeros(0, dtype=layout.unit_dtype, device=batch.device)
    return torch.cat(pieces)


def _gather_segments(
    buf: torch.Tensor, seg_lengths: torch.Tensor, seg_ids: torch.Tensor, total: int
) -> torch.Tensor:
    """Concatenate segments ``seg_ids`` of ``buf`` (segment j: ``seg_lengths[j]``
    elements, segments stored back to back); ``total`` is the result's size."""
    if seg_ids.numel() == 0 or total == 0:
        return buf.new_empty(total)
    if buf.dtype in _FBGEMM_DTYPES and hasattr(torch.ops.fbgemm, "permute_1D_sparse_data"):
        # permuted_lengths_sum spares the kernel a device-to-host sync on CUDA.
        _, out, _ = torch.ops.fbgemm.permute_1D_sparse_data(
            seg_ids.to(torch.int32), seg_lengths, buf, None, total
        )
        return out
    offsets = torch.zeros(seg_lengths.numel() + 1, dtype=torch.int64, device=buf.device)
    torch.cumsum(seg_lengths, 0, out=offsets[1:])
    sel = seg_lengths[seg_ids]
    out_seg = torch.repeat_interleave(torch.arange(seg_ids.numel(), device=buf.device), sel,
                                      output_size=total)
    out_start = torch.cumsum(sel, 0) - sel
    idx = offsets[seg_ids][out_seg] + torch.arange(total, device=buf.device) - out_start[out_seg]
    return buf[idx]


def _group_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive groups of ``values`` of sizes ``counts``."""
    ends = np.cumsum(counts)
    csum = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    return csum[ends] - csum[ends - counts]


def _build_output(
    batch: BaseBatch,
    layout: WireLayout,
    lengths_mk: torch.Tensor,
    colmajor: torch.Tensor,
    column_totals: np.ndarray,
) -> BaseBatch:
    """A batch of B samples: M real ones from column-major units, then padding.

    Args:
        lengths_mk: [M, K_total] int64 lengths of the real samples.
        colmajor: the real samples' units, column by column.
        column_totals: [C] units per column (host).
    """
    m, b = lengths_mk.shape[0], layout.batch_size
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    off = 0
    for s in layout.sections:
        n = int(column_totals[s.first : s.first + s.count].sum())
        # Sections are ordered by decreasing item size, so `off` is aligned.
        tensors[(s.field, s.kind)] = colmajor[off : off + n].view(torch.uint8).view(s.dtype)
        off += n
    fields: dict[str, torch.Tensor | KeyedJaggedTensor] = {}
    for k in layout.kjts:
        lengths = lengths_mk.new_zeros(len(k.keys), b)
        lengths[:, :m] = lengths_mk[:, k.row : k.row + len(k.keys)].t()
        fields[k.name] = KeyedJaggedTensor(
            keys=list(k.keys),
            values=tensors[(k.name, "values")],
            weights=tensors.get((k.name, "weights")),
            lengths=lengths.view(-1).to(k.lengths_dtype),
        )
    for d in layout.dense:
        rows = torch.zeros((b, *d.shape), dtype=d.dtype, device=lengths_mk.device)
        rows[:m] = tensors[(d.name, "dense")].view(m, *d.shape)
        fields[d.name] = rows
    return dataclasses.replace(batch, **fields, actual_batch_size=m)  # type: ignore[arg-type]


def _pack(batch: BaseBatch, layout: WireLayout, units: torch.Tensor, order: torch.Tensor,
          total: int) -> torch.Tensor:
    """Samples ``order`` of ``batch``, sample by sample, as packing units.

    Args:
        units: [B, C] units per (sample, column) of ``batch``.
        order: [M] local sample indices.
        total: ``units[order].sum()`` (host).
    """
    c, b = layout.num_columns, layout.batch_size
    seg = (order.unsqueeze(1) + torch.arange(c, device=order.device) * b).reshape(-1)
    return _gather_segments(_source_units(batch, layout), units.t().reshape(-1), seg, total)


def _unpack(batch: BaseBatch, layout: WireLayout, lengths_mk: torch.Tensor, units: torch.Tensor,
            packed: torch.Tensor, column_totals: np.ndarray) -> BaseBatch:
    """Inverse of :func:`_pack`: a batch of the M packed samples, then padding.

    Args:
        lengths_mk: [M, K_total] lengths of the packed samples.
        units: [M, C] their units per column.
        packed: their units, sample by sample.
        column_totals: [C] ``units.sum(0)`` (host).
    """
    c, m = layout.num_columns, lengths_mk.shape[0]
    dev = packed.device
    seg = (torch.arange(c, device=dev).unsqueeze(1) + torch.arange(m, device=dev) * c).reshape(-1)
    colmajor = _gather_segments(packed, units.reshape(-1), seg, int(column_totals.sum()))
    return _build_output(batch, layout, lengths_mk, colmajor, column_totals)


# ----------------------------------------------------------- redistribution
def redistribute_all2all(
    batch: BaseBatch, layout: WireLayout, plan: RankPlan, pg: dist.ProcessGroup
) -> tuple[BaseBatch, Traffic]:
    """Move samples with two ``all_to_all_single`` calls: lengths, then payload.

    Example (W=2, B=2, one KJT key ``a``, values only; rank 0 keeps its sample
    0 and gives sample 1 to rank 1, rank 1 gives sample 0 to rank 0)::

        rank0 in:  a lengths [2, 1]  values [x, y, z]    rank1 in:  a lengths [1, 0]  values [u]
        1) lengths a2a  rank0 sends [[2]] to itself, [[1]] to rank1;
                        rank1 sends [[1]] to rank0          -> rank0 gets [[2], [1]], rank1 [[1]]
        2) payload a2a  rank0 sends [x, y] to itself, [z] to rank1; rank1 sends [u] to rank0
        rank0 out: a lengths [2, 1]  values [x, y, u]    rank1 out: a lengths [1, 0]  values [z]

    Receive sizes of 1) come from the plan, of 2) from the lengths received in
    1); padding is never sent and is recreated locally at the end.

    Returns:
        The output batch (real samples in ``plan.sources`` order, then padding)
        and this rank's network traffic.
    """
    dev, k, u = batch.device, layout.num_lengths, layout.unit
    order = torch.from_numpy(plan.send_order).to(dev)
    lengths = _lengths_matrix(batch, layout)
    units = _column_units(lengths.t(), layout)  # [B, C]
    # Host copies: collective split sizes are host integers (a sync on CUDA).
    send_units = _group_sums(units.sum(1).cpu().numpy()[plan.send_order], plan.send_counts)
    recv_len = all_to_all_uneven(
        lengths.t().index_select(0, order).reshape(-1),
        (plan.send_counts * k).tolist(), (plan.recv_counts * k).tolist(), pg,
    ).view(plan.num_out, k)
    recv_units = _column_units(recv_len, layout)  # [M, C]
    recv_host = recv_units.cpu().numpy()
    recv_split = _group_sums(recv_host.sum(1), plan.recv_counts)

    packed = _pack(batch, layout, units, order, int(send_units.sum()))
    recv = torch.empty(int(recv_split.sum()), dtype=layout.unit_dtype, device=dev)
    all_to_all_uneven(packed.view(torch.uint8), (send_units * u).tolist(),
                      (recv_split * u).tolist(), pg, out=recv.view(torch.uint8))

    out = _unpack(batch, layout, recv_len, recv_units, recv, recv_host.sum(0))

    r = plan.rank
    sent = (plan.send_counts * k * 8 + send_units * u).sum() - (plan.send_counts[r] * k * 8 + send_units[r] * u)
    got = (plan.recv_counts * k * 8 + recv_split * u).sum() - (plan.recv_counts[r] * k * 8 + recv_split[r] * u)
    traffic = Traffic(
        samples_sent=int(plan.send_counts.sum() - plan.send_counts[r]),
        samples_received=int(plan.recv_counts.sum() - plan.recv_counts[r]),
        bytes_sent=int(sent),
        bytes_received=int(got),
    )
    return out, traffic


def _all_padding(batch: BaseBatch, layout: WireLayout) -> BaseBatch:
    """A batch of B padding samples with ``batch``'s schema."""
    m = torch.zeros(0, layout.num_lengths, dtype=torch.int64, device=batch.device)
    return _build_output(batch, layout, m, torch.zeros(0, dtype=layout.unit_dtype, device=batch.device),
                         np.zeros(layout.num_columns, np.int64))


def redistribute_allgather(
    batch: BaseBatch, layout: WireLayout, plan: RankPlan, real: np.ndarray, pg: dist.ProcessGroup
) -> tuple[BaseBatch, Traffic]:
    """Gather every rank's batch with two ``all_gather_single`` calls, then select.

    Example (W=2, B=2, one KJT key ``a``; rank 0 gets global samples [0, 2])::

        rank0 in:  a lengths [2, 1]  values [x, y, z]    rank1 in:  a lengths [1, 0]  values [u]
        1) lengths all-gather (fixed [W, B * K]):  both get [[2, 1], [1, 0]]
        2) payload all-gather, padded to the largest rank (3 values):
                   both get [[x, y, z], [u, 0, 0]]
        rank0 out: a lengths [2, 1]  values [x, y, u]    (global samples 0 and 2)

    Every rank sends its whole batch to every rank: simpler and fewer,
    larger messages than :func:`redistribute_all2all`, but W times the traffic.

    Args:
        real: [W] real samples per rank.

    Returns:
        The same batch :func:`redistribute_all2all` returns, and this rank's
        traffic.
    """
    dev, k, c, b, u = batch.device, layout.num_lengths, layout.num_columns, layout.batch_size, layout.unit
    w, r = real.size, plan.rank
    glen = all_gather_fixed(_lengths_matrix(batch, layout).t().reshape(-1), pg).view(w * b, k)
    col_tot = _column_units(glen, layout).view(w, b, c).sum(1).cpu().numpy()  # [W, C]
    width = int(col_tot.sum(1).max(initial=0))
    src = _source_units(batch, layout)
    buf = torch.zeros(width, dtype=layout.unit_dtype, device=dev)
    buf[: src.numel()] = src
    rows = all_gather_fixed(buf.view(torch.uint8), pg).view(layout.unit_dtype).view(w, width)
    starts = np.cumsum(col_tot, axis=1) - col_tot

    def section(first: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        # Key-major over global samples: for each column, rank 0's run, rank 1's, ...
        pieces = [rows[s, int(starts[s, j]) : int(starts[s, j] + col_tot[s, j])]
                  for j in range(first, first + count) for s in range(w)]
        return torch.cat(pieces).view(torch.uint8).view(dtype)

    tensors = {(s.field, s.kind): section(s.first, s.count, s.dtype) for s in layout.sections}
    fields: dict[str, torch.Tensor | KeyedJaggedTensor] = {}
    for kj in layout.kjts:
        fields[kj.name] = KeyedJaggedTensor(
            keys=list(kj.keys),
            values=tensors[(kj.name, "values")],
            weights=tensors.get((kj.name, "weights")),
            lengths=glen[:, kj.row : kj.row + len(kj.keys)].t().reshape(-1).to(kj.lengths_dtype),
        )
    for d in layout.dense:
        fields[d.name] = tensors[(d.name, "dense")].view(w * b, *d.shape)
    everything = dataclasses.replace(batch, **fields, batch_size=w * b,  # type: ignore[arg-type]
                                     actual_batch_size=w * b)
    m = plan.num_out
    if m == 0:
        out = _all_padding(batch, layout)
    else:
        picked = everything.index_select(torch.from_numpy(plan.sources).to(dev), actual_batch_size=m)
        out = pad_batch(picked, b)
    nbytes = (w - 1) * (b * k * 8 + width * u)
    traffic = Traffic(
        samples_sent=int((w - 1) * real[r]),
        samples_received=int(real.sum() - real[r]),
        bytes_sent=int(nbytes),
        bytes_received=int(nbytes),
    )
    return out, traffic
