"""Phase 2 planned on the host: every byte count, offset and index of the one collective (numpy only).

Phase 1 gave every rank the lengths of every sample, so before phase 2 starts
each rank knows, as host integers, what it sends, what it receives and where
every element of its output comes from. This module turns a
:class:`~balancer._plan.RankPlan` into an :class:`Exchange`: pure numpy, run in
the torch-free planner process (or the shuffler's background thread), so the
calling thread only executes it (:mod:`balancer._comm`).

Wire format. Each section's bytes (:class:`~balancer._layout.Section`) form a
block padded to 8 bytes, so every block can be viewed as its own dtype:

* ``all2all``: the chunk for destination ``d`` holds, section by section, the
  section's elements of the samples sent to ``d`` (KJT sections key-major,
  then by sample). The chunk a rank sends itself carries the samples it keeps,
  so its output is assembled from one buffer.
* ``allgather``: every rank contributes its whole batch, section by section,
  padded to the largest rank's size.

The receive buffer ends in a zero tail; dense padding rows of the output are
copied from it, so one gather per section builds a complete output tensor.
Output lengths never travel: they are known here and uploaded with the
indices.

Example (W=2, B=2, one KJT key, int64 values; rank 0 keeps its sample 0 and
sends sample 1 (3 values) to rank 1; rank 1 sends its sample 0 (1 value))::

    rank0: send_splits [8, 24]  recv_splits [8, 8]   out values: [own s0 | r1 s0]
    rank1: send_splits [8, 0]   recv_splits [24, 0]  out values: [r0 s1]
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from balancer._plan import Gathered, RankPlan
from balancer._plan_layout import PlanLayout, SectionPlan
from balancer._runs import HostBlob, IndexBlob, RunGather, RunPut, plan_puts, plan_runs

__all__ = ["Exchange", "Traffic", "padded_length", "plan_exchange"]


def _pad8(n: np.ndarray) -> np.ndarray:
    """Byte counts rounded up to whole 8-byte words (every block can then be
    viewed as any dtype)."""
    return (n + 7) // 8 * 8


def _pad8i(n: int) -> int:
    return (n + 7) // 8 * 8


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What this rank's phase-2 collective moved between ranks (its own chunk excluded)."""

    samples_sent: int = 0
    samples_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclasses.dataclass(frozen=True)
class Exchange:
    """Phase 2 of one rank, ready to execute (see :mod:`balancer._comm`).

    Attributes:
        comm: ``"all2all"`` or ``"allgather"``.
        blob: every index array, one host buffer per dtype.
        pack: per section, the gather of its outgoing elements from the local
            tensor (``all2all``); ``None`` where the whole tensor is sent.
        pieces: the send buffer as ``(section, byte offset, bytes)`` slices of
            each section's outgoing bytes; section ``-1`` is zero padding.
        send_splits, recv_splits: bytes per destination / source
            (``allgather``: the per-rank width, once).
        recv_bytes: bytes the collective writes; ``tail``: zero bytes after them.
        out: per section, the gather of its output from the received buffer.
        puts: per section, where a padded token field's gathered elements go in
            its ``[B_out, out_len * width]`` output (``None``: the gather is the output).
        out_len: the padded output length of a padded token batch (else 0).
        out_batch: samples of the output, real and padding (B_out).
        out_lengths: per KJT field, the blob index of its ``[K * B]`` lengths and
            whether they are int32 (else int64).
        length_per_key: per KJT field, elements per key of the output.
        num_out: real samples of the output.
        traffic: what crosses to other ranks.
    """

    comm: Literal["all2all", "allgather"]
    blob: HostBlob
    pack: tuple[RunGather | None, ...]
    pieces: tuple[tuple[int, int, int], ...]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_bytes: int
    tail: int
    out: tuple[RunGather, ...]
    puts: tuple[RunPut | None, ...]
    out_len: int
    out_batch: int
    out_lengths: tuple[tuple[int, bool], ...]
    length_per_key: tuple[tuple[int, ...], ...]
    num_out: int
    traffic: Traffic


def _elements(s: SectionPlan, lengths: np.ndarray) -> np.ndarray:
    """[K_s, B] elements per (key, sample) of section ``s``, from one rank's lengths [K_total, B]."""
    if s.jagged:
        return lengths[s.row : s.row + s.count] * s.width
    return np.full((1, lengths.shape[1]), s.width, np.int64)


def _slot(s: SectionPlan, g: Gathered, r: int) -> int:
    """Elements per sample slot of rank r's padded token tensor (its own L), else 0."""
    if not (s.jagged and s.padded):
        return 0
    assert g.pad_len is not None, "padded token batches send their padded length"
    return int(g.pad_len[r]) * s.width


def _starts(s: SectionPlan, g: Gathered, r: int) -> np.ndarray:
    """[K_s, B] element offsets of each (key, sample) in rank r's tensor of section ``s``."""
    lengths = g.lengths[r]
    k, b = (s.count if s.jagged else 1), lengths.shape[1]
    if s.jagged and not s.padded:  # back to back, key-major
        flat = _elements(s, lengths).reshape(-1)
        return (np.cumsum(flat) - flat).reshape(k, b)
    slot = _slot(s, g, r) if s.jagged else s.width  # fixed slots: padded tokens, dense rows
    return (np.arange(k)[:, None] * b + np.arange(b)[None, :]) * slot


def _numel(s: SectionPlan, g: Gathered, r: int) -> int:
    """Elements of rank r's tensor of section ``s``."""
    lengths = g.lengths[r]
    b = lengths.shape[1]
    if s.jagged and not s.padded:
        return int(_elements(s, lengths).sum())
    return (s.count * b * _slot(s, g, r)) if s.jagged else b * s.width


def _tail_bytes(layout: PlanLayout, out_batch: int) -> int:
    need = [out_batch * s.width * s.itemsize for s in layout.sections if not s.jagged]
    return _pad8i(max(need, default=0))


def _out_len(layout: PlanLayout, g: Gathered, plan: RankPlan) -> int:
    """The padded length of a padded token output: its longest sample, rounded up."""
    if not any(s.jagged and s.padded for s in layout.sections):
        return 0
    b = g.batch_size
    longest = int(g.lengths[plan.sources // b, 0, plan.sources % b].max(initial=0))
    return padded_length(longest, layout.pad_multiple)


def padded_length(longest: int, pad_multiple: int) -> int:
    """L of a padded token batch whose longest sample has ``longest`` tokens: rounded up to ``pad_multiple``."""
    return -(-longest // pad_multiple) * pad_multiple


def plan_exchange(comm: str, layout: PlanLayout, g: Gathered, plan: RankPlan, out_batch: int | None = None) -> Exchange:
    """This rank's :class:`Exchange` for ``comm``.

    Args:
        out_batch: samples of the output (B_out >= its real samples); default B.
    """
    b_out = g.batch_size if out_batch is None else out_batch
    assert plan.num_out <= b_out, f"{plan.num_out} real samples do not fit an output of {b_out}"
    if comm == "all2all":
        return _plan_all2all(layout, g, plan, b_out)
    return _plan_allgather(layout, g, plan, b_out)


def _plan_all2all(layout: PlanLayout, g: Gathered, plan: RankPlan, b_out: int) -> Exchange:
    w, b, me = g.world_size, g.batch_size, plan.rank
    secs = layout.sections
    blob = IndexBlob()
    dest_of = np.repeat(np.arange(w), plan.send_counts)  # per sample in send order
    # --- send side: per section, outgoing elements in (destination, key, sample) order
    sent = np.zeros((w, len(secs)), np.int64)  # elements per (destination, section)
    packs: list[RunGather | None] = []
    for j, s in enumerate(secs):
        el, st = _elements(s, g.lengths[me]), _starts(s, g, me)  # [K_s, B]
        kk, pos = np.meshgrid(np.arange(el.shape[0]), np.arange(plan.send_order.size), indexing="ij")
        order = np.lexsort((pos.reshape(-1), kk.reshape(-1), dest_of[pos].reshape(-1)))
        local = plan.send_order[pos.reshape(-1)][order]
        keys = kk.reshape(-1)[order]
        lens = el[keys, local]
        packs.append(plan_runs(blob, _numel(s, g, me), st[keys, local], lens))
        sent[:, j] = np.bincount(dest_of[pos.reshape(-1)][order], weights=lens, minlength=w).astype(np.int64)
    items = np.array([s.itemsize for s in secs], np.int64)
    send_bytes = sent * items  # [W, S]
    pieces, offsets = [], np.zeros(len(secs), np.int64)
    for d in range(w):
        for j in range(len(secs)):
            n = int(send_bytes[d, j])
            if n:
                pieces.append((j, int(offsets[j]), n))
                offsets[j] += n
            pad = _pad8i(n) - n
            if pad:
                pieces.append((-1, 0, pad))
    send_splits = _pad8(send_bytes).sum(axis=1)
    # --- receive side: elements per (source, section, key) of what comes here
    src_of = plan.sources // b
    recv = np.zeros((w, len(secs)), np.int64)
    rel = []
    for j, s in enumerate(secs):
        per = _out_elements(s, g, plan)  # [K_s, M]
        # Within a source's block: key-major, then by sample: offset of (k, i) =
        # this key's elements of the earlier samples of that source, plus all
        # elements of the earlier keys from that source.
        by_key = np.zeros((w, per.shape[0]), np.int64)
        for k in range(per.shape[0]):
            by_key[:, k] = np.bincount(src_of, weights=per[k], minlength=w).astype(np.int64)
        key_base = np.cumsum(by_key, axis=1) - by_key  # [W, K_s]
        first = np.searchsorted(src_of, np.arange(w))  # first output position of each source
        within = np.cumsum(per, axis=1) - per  # [K_s, M] running count over all sources
        within -= within[:, first[src_of]] if per.size else 0
        rel.append(key_base[src_of].T + within)
        recv[:, j] = by_key.sum(axis=1)
    recv_bytes_ws = recv * items
    recv_splits = _pad8(recv_bytes_ws).sum(axis=1)
    padded = _pad8(recv_bytes_ws).reshape(-1)
    base_bytes = (np.cumsum(padded) - padded).reshape(w, len(secs))
    total = int(recv_splits.sum())
    tail = _tail_bytes(layout, b_out)
    base = base_bytes // items[None, :]
    outs, puts, out_len, out_lengths, per_key = _assemble_plan(layout, g, plan, blob, base, rel, total + tail,
                                                              total, b_out)
    others = np.arange(w) != me
    traffic = Traffic(int(plan.send_counts[others].sum()), int(plan.recv_counts[others].sum()),
                      int(send_splits[others].sum()), int(recv_splits[others].sum()))
    return Exchange("all2all", blob.freeze(), tuple(packs), tuple(pieces),
                    tuple(int(x) for x in send_splits), tuple(int(x) for x in recv_splits), total, tail,
                    tuple(outs), tuple(puts), out_len, b_out, tuple(out_lengths), tuple(per_key), plan.num_out,
                    traffic)


def _out_elements(s: SectionPlan, g: Gathered, plan: RankPlan) -> np.ndarray:
    """[K_s, M] elements per (key, output sample) of section ``s``."""
    b = g.batch_size
    src_of, idx_of = plan.sources // b, plan.sources % b
    if s.jagged:
        return g.lengths[src_of, s.row : s.row + s.count, idx_of].T * s.width
    return np.full((1, plan.num_out), s.width, np.int64)


def _assemble_plan(layout: PlanLayout, g: Gathered, plan: RankPlan, blob: IndexBlob, base: np.ndarray,
                   rel: list[np.ndarray], buffer_bytes: int, tail_at: int, b_out: int
                   ) -> tuple[list[RunGather], list[RunPut | None], int, list[tuple[int, bool]],
                              list[tuple[int, ...]]]:
    """Output gathers (order: key, then output sample), puts into padded
    token slots, and output lengths."""
    b, m = g.batch_size, plan.num_out
    src_of, idx_of = plan.sources // b, plan.sources % b
    out_len = _out_len(layout, g, plan)
    outs: list[RunGather] = []
    puts: list[RunPut | None] = []
    for j, s in enumerate(layout.sections):
        e = s.itemsize
        per = _out_elements(s, g, plan)
        starts = base[src_of, j][None, :] + rel[j]
        run_starts, run_lens = starts.reshape(-1), per.reshape(-1)
        if not s.jagged:  # padding rows come from the zero tail
            run_starts = np.append(run_starts, tail_at // e)
            run_lens = np.append(run_lens, (b_out - m) * s.width)
        outs.append(plan_runs(blob, buffer_bytes // e, run_starts, run_lens))
        if s.jagged and s.padded:  # padded tokens: sample j's elements go to slot (k, j)
            slot = out_len * s.width
            dst = (np.arange(per.shape[0])[:, None] * b_out + np.arange(m)[None, :]) * slot
            puts.append(plan_puts(blob, per.shape[0] * b_out * slot, dst.reshape(-1), per.reshape(-1)))
        else:
            puts.append(None)
    out_lengths, per_key = [], []
    for k in layout.kjts:
        out = np.zeros((k.num_keys, b_out), np.int64)
        out[:, :m] = g.lengths[src_of, k.row : k.row + k.num_keys, idx_of].T
        out_lengths.append((blob.add32(out) if k.int32 else blob.add64(out), k.int32))
        per_key.append(tuple(int(v) for v in out.sum(axis=1)))
    return outs, puts, out_len, out_lengths, per_key


def _plan_allgather(layout: PlanLayout, g: Gathered, plan: RankPlan, b_out: int) -> Exchange:
    w, me = g.world_size, plan.rank
    secs = layout.sections
    blob = IndexBlob()
    items = np.array([s.itemsize for s in secs], np.int64)
    numel = np.array([[_numel(s, g, r) for s in secs] for r in range(w)], np.int64).reshape(w, len(secs))
    block = _pad8(numel * items)  # [W, S]: every rank sends its whole tensors
    width = int(block.sum(axis=1).max(initial=0))
    pieces = []
    for j in range(len(secs)):
        n = int(numel[me, j] * items[j])
        if n:
            pieces.append((j, 0, n))
        if int(block[me, j]) - n:
            pieces.append((-1, 0, int(block[me, j]) - n))
    if width - int(block[me].sum()):
        pieces.append((-1, 0, width - int(block[me].sum())))
    base_bytes = np.arange(w)[:, None] * width + (np.cumsum(block, axis=1) - block)
    base = base_bytes // items[None, :]
    b = g.batch_size
    src_of, idx_of = plan.sources // b, plan.sources % b
    rel = []
    for s in secs:
        starts_all = np.stack([_starts(s, g, r) for r in range(w)])  # [W, K_s, B]
        rel.append(starts_all[src_of, :, idx_of].T if plan.num_out else np.zeros((starts_all.shape[1], 0), np.int64))
    total = w * width
    tail = _tail_bytes(layout, b_out)
    outs, puts, out_len, out_lengths, per_key = _assemble_plan(layout, g, plan, blob, base, rel, total + tail,
                                                              total, b_out)
    real_me = int(g.real[me])
    traffic = Traffic((w - 1) * real_me, int(g.real.sum()) - real_me, (w - 1) * width, (w - 1) * width)
    return Exchange("allgather", blob.freeze(), tuple(None for _ in secs), tuple(pieces), (width,),
                    (width,), total, tail, tuple(outs), tuple(puts), out_len, b_out, tuple(out_lengths),
                    tuple(per_key), plan.num_out, traffic)
