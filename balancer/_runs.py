"""Copy runs of a buffer into a contiguous output, with every size known on the host.

Phase 2 moves bytes whose positions the plan computed on the host: "elements
``[start, start + length)`` of this buffer, in this order". One such copy is a
:class:`RunGather`. Planning it is numpy (the background thread does it);
executing it is one kernel and never reads a device value:

* ``torch.ops.fbgemm.permute_1D_sparse_data`` when the element size has a
  kernel (8, 4 and 2 bytes, through :func:`balancer._layout.opaque` views):
  the runs and the gaps between them tile the buffer into segments, and the
  permutation lists the runs in output order. Passing the output size spares
  the kernel a device-to-host sync.
* otherwise (1-byte elements, or no fbgemm): an index built on the device with
  ``repeat_interleave(..., output_size=total)``, then ``index_select``.

Index arrays travel in one :class:`IndexBlob` per shuffle: one host buffer,
one (pinned, non-blocking) copy to the device.

Example (buffer of 10 elements, runs ``(6, 4)`` then ``(0, 2)``)::

    segments [0:0) [0:2) [2:6) [6:10) [10:10)   lengths [0, 2, 4, 4, 0]
    permute  [3, 1]                              output  buf[6:10] + buf[0:2]
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["IndexBlob", "RunGather", "merge_runs", "plan_runs", "take_runs"]


def _has_permute() -> bool:
    try:
        torch.ops.fbgemm.permute_1D_sparse_data  # noqa: B018 - lookup raises if absent
    except (AttributeError, RuntimeError):
        return False
    return True


_PERMUTE = _has_permute()
_FBGEMM_ITEMSIZES = frozenset({8, 4, 2})


@dataclasses.dataclass(frozen=True)
class RunGather:
    """A planned copy of runs; :func:`take_runs` executes it.

    Attributes:
        total: elements of the output.
        src_numel: elements of the source buffer (the segments tile it).
        segments: index in the blob of the [T] int64 segment lengths.
        permute: index in the blob of the [R] int32 run segments, in output order.
        starts, lengths, out_starts: blob indices of the [R] int64 run arrays
            (the index fallback).
    """

    total: int
    src_numel: int
    segments: int
    permute: int
    starts: int
    lengths: int
    out_starts: int


class IndexBlob:
    """Host int64/int32 arrays gathered into two buffers, moved to the device at once."""

    def __init__(self) -> None:
        self._i64: list[np.ndarray] = []
        self._i32: list[np.ndarray] = []

    def add64(self, a: np.ndarray) -> int:
        self._i64.append(np.ascontiguousarray(a, dtype=np.int64).reshape(-1))
        return len(self._i64) - 1

    def add32(self, a: np.ndarray) -> int:
        self._i32.append(np.ascontiguousarray(a, dtype=np.int32).reshape(-1))
        return len(self._i32) - 1

    def freeze(self, pin: bool) -> FrozenBlob:
        """One host buffer per dtype; ``pin`` puts them in pinned memory so the
        copy to the device can be asynchronous."""
        return FrozenBlob(_concat(self._i64, np.int64, pin), [a.size for a in self._i64],
                          _concat(self._i32, np.int32, pin), [a.size for a in self._i32])


def _concat(arrays: list[np.ndarray], dtype: type, pin: bool) -> torch.Tensor:
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype)
    t = torch.from_numpy(flat)
    return t.pin_memory() if pin and t.numel() else t


@dataclasses.dataclass
class FrozenBlob:
    """The host buffers of an :class:`IndexBlob` and, once :meth:`to` ran, their
    device copies, sliced back into the arrays."""

    host64: torch.Tensor
    sizes64: list[int]
    host32: torch.Tensor
    sizes32: list[int]

    def to(self, device: torch.device) -> DeviceBlob:
        """Copy to ``device`` (non-blocking from pinned memory; a view on the CPU)."""
        # The caching host allocator keeps the pinned source alive until the
        # copy has run, so the host buffers may be dropped after this call.
        d64 = self.host64.to(device, non_blocking=True)
        d32 = self.host32.to(device, non_blocking=True)
        return DeviceBlob(_split(d64, self.sizes64), _split(d32, self.sizes32))


def _split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, sizes)) if sizes else []


@dataclasses.dataclass(frozen=True)
class DeviceBlob:
    i64: list[torch.Tensor]
    i32: list[torch.Tensor]


def merge_runs(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Join consecutive runs that are adjacent in the source (``start[j+1] ==
    start[j] + length[j]``), dropping empty ones; the output is unchanged."""
    keep = lengths > 0
    s, n = starts[keep], lengths[keep]
    if s.size <= 1:
        return s, n
    cont = s[1:] == s[:-1] + n[:-1]
    head = np.concatenate([[True], ~cont])
    return s[head], np.add.reduceat(n, np.flatnonzero(head))


def plan_runs(blob: IndexBlob, src_numel: int, starts: np.ndarray, lengths: np.ndarray) -> RunGather:
    """Plan copying runs ``[starts[j], starts[j] + lengths[j])`` of a buffer of
    ``src_numel`` elements, in order; runs must not overlap."""
    starts, lengths = merge_runs(np.asarray(starts, np.int64), np.asarray(lengths, np.int64))
    total = int(lengths.sum())
    order = np.argsort(starts, kind="stable")
    s_sorted, n_sorted = starts[order], lengths[order]
    ends = s_sorted + n_sorted
    gaps = s_sorted - np.concatenate([[0], ends[:-1]])
    assert (gaps >= 0).all() and (ends[-1] if ends.size else 0) <= src_numel, "runs overlap or overflow"
    segs = np.empty(2 * s_sorted.size + 1, np.int64)
    segs[0:-1:2] = gaps
    segs[1::2] = n_sorted
    segs[-1] = src_numel - (ends[-1] if ends.size else 0)
    position = np.empty_like(order)
    position[order] = np.arange(order.size)
    out_starts = np.cumsum(lengths) - lengths
    return RunGather(total, src_numel, blob.add64(segs), blob.add32(2 * position + 1),
                     blob.add64(starts), blob.add64(lengths), blob.add64(out_starts))


def take_runs(src: torch.Tensor, g: RunGather, blob: DeviceBlob) -> torch.Tensor:
    """Execute ``g`` on the 1-D tensor ``src``; returns ``[g.total]`` of src's dtype."""
    assert src.numel() == g.src_numel, f"source has {src.numel()} elements, planned {g.src_numel}"
    if g.total == 0:
        return src.new_empty(0)
    if _PERMUTE and src.element_size() in _FBGEMM_ITEMSIZES:
        try:
            _, out, _ = torch.ops.fbgemm.permute_1D_sparse_data(
                blob.i32[g.permute], blob.i64[g.segments], src, None, g.total)
            return out  # type: ignore[no-any-return]
        except (NotImplementedError, RuntimeError) as e:  # a build without this dtype/device
            logger.debug("permute_1D_sparse_data failed for %s (%s); using index_select", src.dtype, e)
    lengths = blob.i64[g.lengths]
    shift = blob.i64[g.starts] - blob.i64[g.out_starts]
    idx = torch.repeat_interleave(shift, lengths, output_size=g.total)
    idx += torch.arange(g.total, device=src.device)
    return src.index_select(0, idx)
