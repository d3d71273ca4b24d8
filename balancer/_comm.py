"""The collectives of a shuffle, and the packing around them.

This is the only module of balancer that issues collectives. All of them run on
the calling thread and, for NCCL, are ordered after the work already queued on
the current stream. Every size passed to a collective is either fixed by the
agreement of phase 1 or derived from data that every rank has seen identically
(the gathered headers, or lengths received in the same shuffle): a rank never
sizes a message from data the other ranks have not validated.

Wire format (see :class:`balancer._plan.WireLayout`): per destination, a chunk
holds each section's data of the samples sent there, in the batch's own layout
(key by key, sample by sample); lengths travel in their own collective first.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer._plan import (
    RankPlan,
    WireLayout,
    gather_segments,
    lengths_matrix,
    opaque,
    section_elements_by_run,
    section_tensor,
)
from balancer.batch import BaseBatch, pad_batch

logger = logging.getLogger(__name__)

__all__ = [
    "Traffic", "all_gather_fixed", "all_to_all_uneven", "redistribute_all2all", "redistribute_allgather",
    "resolve_group",
]

# torch >= 2.13 deprecates all_gather_into_tensor in favour of all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
def resolve_group(pg: dist.ProcessGroup | None) -> tuple[Any, int, int]:
    """``(group, world size, rank)``, resolved now: ``None`` is the default group
    (``dist.group.WORLD`` is ``None`` before ``init_process_group``, so it is
    never a default argument); ``(None, 1, 0)`` without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return None, 1, 0
    group = pg if pg is not None else dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


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
def _pack(batch: BaseBatch, layout: WireLayout, lengths: torch.Tensor, lengths_h: np.ndarray,
          groups: list[np.ndarray]) -> tuple[torch.Tensor, np.ndarray]:
    """The samples ``groups[d]`` for every destination d, as one byte buffer.

    Chunk d holds, section by section, the section's data of ``groups[d]`` in
    the batch's own layout: key by key, sample by sample.

    Args:
        lengths: [K_total, B] int64 lengths (device); ``lengths_h`` the same on the host.
        groups: per destination, local sample indices (ascending).

    Returns:
        The uint8 buffer and [W] bytes per destination.
    """
    dev, b = batch.device, layout.batch_size
    order = torch.from_numpy(np.concatenate(groups)).to(dev)
    chunks: list[tuple[torch.Tensor, list[int]]] = []  # per section: bytes, bytes per destination
    for s in layout.sections:
        t = opaque(section_tensor(batch, s))
        if s.kind == "dense":
            data = t.view(b, s.width).index_select(0, order)
            per_dest = [g.size * s.width for g in groups]
        else:
            rows_h = lengths_h[s.row : s.row + s.count]
            per_dest = [int(rows_h[:, g].sum()) for g in groups]
            seg = np.concatenate([(np.arange(s.count)[:, None] * b + g).ravel() for g in groups])
            data = gather_segments(t, lengths[s.row : s.row + s.count].reshape(-1),
                                   torch.from_numpy(seg).to(dev), sum(per_dest))
        chunks.append((data.reshape(-1).view(torch.uint8), [n * s.itemsize for n in per_dest]))
    pieces, offsets = [], [0] * len(chunks)
    for d in range(len(groups)):  # destination-major: all_to_all_single sends contiguous chunks
        for i, (data, sizes) in enumerate(chunks):
            pieces.append(data[offsets[i] : offsets[i] + sizes[d]])
            offsets[i] += sizes[d]
    totals = np.array([sum(sizes[d] for _, sizes in chunks) for d in range(len(groups))], np.int64)
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=dev), totals


def _chunk_bytes(layout: WireLayout, recv_len_h: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """[W, S, K] bytes of every (source, section, key) in a received buffer."""
    items = np.array([s.itemsize for s in layout.sections], np.int64)[:, None]
    return section_elements_by_run(layout, recv_len_h, starts) * items


def _assemble(batch: BaseBatch, layout: WireLayout, lengths: torch.Tensor, lengths_h: np.ndarray,
              keep: np.ndarray, rank: int, recv: torch.Tensor, recv_len: torch.Tensor,
              recv_len_h: np.ndarray, recv_counts: np.ndarray) -> BaseBatch:
    """The output batch: real samples in ascending global order -- each source
    rank's block in rank order, this rank's kept samples as block ``rank`` --
    then padding.

    Per section one gather over [this rank's tensor | received chunks]: kept
    and received bytes are copied twice (concatenation, gather), nothing else
    is touched.

    Args:
        lengths, lengths_h: [K_total, B] lengths of this batch (device, host).
        keep: local indices (ascending) of the real samples that stay.
        recv: uint8 buffer of :func:`_pack` chunks from every source (rank order).
        recv_len, recv_len_h: [M_recv, K_total] lengths of the received samples.
        recv_counts: [W] samples received per source (0 at ``rank``).
    """
    dev, b, w = batch.device, layout.batch_size, recv_counts.size
    starts = np.concatenate([[0], np.cumsum(recv_counts)])
    m = int(keep.size + recv_counts.sum())
    nbytes = _chunk_bytes(layout, recv_len_h, starts).sum(2)  # [W, S]
    offs = (np.cumsum(nbytes.reshape(-1)) - nbytes.reshape(-1)).reshape(nbytes.shape)
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    for j, s in enumerate(layout.sections):
        mine = opaque(section_tensor(batch, s))
        pieces = [mine.view(torch.uint8)] + [recv[offs[src, j] : offs[src, j] + nbytes[src, j]]
                                             for src in range(w) if recv_counts[src]]
        combined = torch.cat(pieces).view(mine.dtype)  # a fresh buffer: aligned for any dtype
        if s.kind == "dense":
            idx = np.concatenate([keep if src == rank else b + np.arange(starts[src], starts[src + 1])
                                  for src in range(w)])
            out = torch.zeros(b, s.width, dtype=mine.dtype, device=dev)
            torch.index_select(combined.view(-1, s.width), 0, torch.from_numpy(idx).to(dev), out=out[:m])
            tensors[(s.field, s.kind)] = out.view(s.dtype)
            continue
        seg_len, seg, base = [lengths[s.row : s.row + s.count].reshape(-1)], [], s.count * b
        for src in range(w):
            n = int(recv_counts[src])
            seg_len.append(recv_len[starts[src] : starts[src + 1], s.row : s.row + s.count].t().reshape(-1))
            seg.append(np.arange(s.count)[:, None] * (b if src == rank else n)
                       + (keep if src == rank else base + np.arange(n)))
            base += s.count * n
        order = np.concatenate(seg, axis=1).reshape(-1)  # key by key; sources in rank order
        total = int(lengths_h[s.row : s.row + s.count][:, keep].sum()) + int(nbytes[:, j].sum()) // s.itemsize
        tensors[(s.field, s.kind)] = gather_segments(
            combined, torch.cat(seg_len), torch.from_numpy(order).to(dev), total).view(s.dtype)
    keep_dev = torch.from_numpy(keep).to(dev)
    out_len = torch.cat([lengths.t().index_select(0, keep_dev) if src == rank
                         else recv_len[starts[src] : starts[src + 1]] for src in range(w)])
    return _build(batch, layout, out_len, tensors)


def _build(batch: BaseBatch, layout: WireLayout, lengths_mk: torch.Tensor,
           tensors: dict[tuple[str, str], torch.Tensor]) -> BaseBatch:
    """``batch`` with new tensors: M real samples (lengths [M, K_total]), then padding."""
    m, b = lengths_mk.shape[0], layout.batch_size
    fields: dict[str, torch.Tensor | KeyedJaggedTensor] = {}
    for k in layout.kjts:
        kl = lengths_mk.new_zeros(len(k.keys), b)
        kl[:, :m] = lengths_mk[:, k.row : k.row + len(k.keys)].t()
        fields[k.name] = KeyedJaggedTensor(
            keys=list(k.keys), values=tensors[(k.name, "values")],
            weights=tensors.get((k.name, "weights")), lengths=kl.view(-1).to(k.lengths_dtype))
    for d in layout.dense:
        fields[d.name] = tensors[(d.name, "dense")].view(b, *d.shape)
    return dataclasses.replace(batch, **fields, actual_batch_size=m)  # type: ignore[arg-type]


def _all_padding(batch: BaseBatch, layout: WireLayout) -> BaseBatch:
    """A batch of B padding samples with ``batch``'s schema."""
    dev, b = batch.device, layout.batch_size
    tensors: dict[tuple[str, str], torch.Tensor] = {
        (s.field, s.kind): torch.zeros(b * s.width if s.kind == "dense" else 0, dtype=s.dtype, device=dev)
        for s in layout.sections}
    return _build(batch, layout, torch.zeros(0, layout.num_lengths, dtype=torch.int64, device=dev), tensors)


# ----------------------------------------------------------- redistribution
def redistribute_all2all(
    batch: BaseBatch, layout: WireLayout, plan: RankPlan, pg: dist.ProcessGroup
) -> tuple[BaseBatch, Traffic]:
    """Move the samples that change rank with two ``all_to_all_single`` calls.

    Example (W=2, B=2, one KJT key ``a``, values only; rank 0 keeps its sample
    0 and gives sample 1 to rank 1, rank 1 gives its sample 0 to rank 0)::

        rank0 in:  a lengths [2, 1]  values [x, y, z]    rank1 in:  a lengths [1, 0]  values [u]
        1) lengths a2a  rank0 sends [[1]] to rank1;  rank1 sends [[1]] to rank0
        2) payload a2a  rank0 sends [z] to rank1;    rank1 sends [u] to rank0
        rank0 out: a lengths [2, 1]  values [x, y, u]    rank1 out: a lengths [1, 0]  values [z]

    Receive sizes of 1) come from the plan, of 2) from the lengths received in
    1). Samples that stay, and padding, are never sent; padding is recreated
    locally at the end.

    Returns:
        The output batch (real samples in ``plan.sources`` order, then padding)
        and this rank's network traffic.
    """
    dev, k, r, w = batch.device, layout.num_lengths, plan.rank, plan.send_counts.size
    ends = np.cumsum(plan.send_counts)
    groups = [plan.send_order[ends[d] - plan.send_counts[d] : ends[d]] for d in range(w)]
    keep, groups[r] = groups[r], groups[r][:0]
    send_counts, recv_counts = plan.send_counts.copy(), plan.recv_counts.copy()
    send_counts[r] = recv_counts[r] = 0
    lengths = lengths_matrix(batch, layout)
    # Host copies: split sizes and gather sizes are host integers (a sync on CUDA).
    lengths_h = lengths.cpu().numpy()
    out_order = torch.from_numpy(np.concatenate(groups)).to(dev)
    recv_len = all_to_all_uneven(lengths.t().index_select(0, out_order).reshape(-1),
                                 (send_counts * k).tolist(), (recv_counts * k).tolist(), pg).view(-1, k)
    recv_len_h = recv_len.cpu().numpy()
    packed, send_bytes = _pack(batch, layout, lengths, lengths_h, groups)
    starts = np.concatenate([[0], np.cumsum(recv_counts)])
    recv_bytes = _chunk_bytes(layout, recv_len_h, starts).sum((1, 2))
    recv = all_to_all_uneven(packed, send_bytes.tolist(), recv_bytes.tolist(), pg)
    out = _assemble(batch, layout, lengths, lengths_h, keep, r, recv, recv_len, recv_len_h, recv_counts)
    traffic = Traffic(
        samples_sent=int(send_counts.sum()), samples_received=int(recv_counts.sum()),
        bytes_sent=int(send_counts.sum() * k * 8 + send_bytes.sum()),
        bytes_received=int(recv_counts.sum() * k * 8 + recv_bytes.sum()),
    )
    return out, traffic


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
    An independent implementation (global batch + ``index_select``); both
    return bit-identical batches.

    Args:
        real: [W] real samples per rank.

    Returns:
        The same batch :func:`redistribute_all2all` returns, and this rank's
        traffic.
    """
    dev, k, b = batch.device, layout.num_lengths, layout.batch_size
    w, r = real.size, plan.rank
    glen = all_gather_fixed(lengths_matrix(batch, layout).t().reshape(-1), pg).view(w * b, k)
    per_key = _chunk_bytes(layout, glen.cpu().numpy(), np.arange(w + 1) * b)  # [W, S, K] bytes
    width = int(per_key.sum((1, 2)).max(initial=0))
    buf = torch.zeros(width, dtype=torch.uint8, device=dev)
    mine = [opaque(section_tensor(batch, s)).view(torch.uint8) for s in layout.sections]
    if mine:
        src = torch.cat(mine)
        buf[: src.numel()] = src
    rows = all_gather_fixed(buf, pg)  # [W, width]
    starts = (np.cumsum(per_key.reshape(w, -1), axis=1) - per_key.reshape(w, -1)).reshape(per_key.shape)
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    for j, s in enumerate(layout.sections):
        # Key-major over global samples: for each key, rank 0's run, rank 1's, ...
        pieces = [rows[src, starts[src, j, key] : starts[src, j, key] + per_key[src, j, key]]
                  for key in range(s.count) for src in range(w)]
        tensors[(s.field, s.kind)] = torch.cat(pieces).view(s.dtype)
    fields: dict[str, torch.Tensor | KeyedJaggedTensor] = {}
    for kj in layout.kjts:
        fields[kj.name] = KeyedJaggedTensor(
            keys=list(kj.keys), values=tensors[(kj.name, "values")],
            weights=tensors.get((kj.name, "weights")),
            lengths=glen[:, kj.row : kj.row + len(kj.keys)].t().reshape(-1).to(kj.lengths_dtype))
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
    nbytes = (w - 1) * (b * k * 8 + width)
    traffic = Traffic(samples_sent=int((w - 1) * real[r]), samples_received=int(real.sum() - real[r]),
                      bytes_sent=int(nbytes), bytes_received=int(nbytes))
    return out, traffic
