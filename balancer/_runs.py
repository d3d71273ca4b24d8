"""Copies of runs of a buffer, planned on the host (numpy only).

Phase 2 moves bytes whose positions the plan computed on the host: "elements
``[start, start + length)`` of this buffer, in this order". One such copy is a
:class:`RunGather`, planned here (in the torch-free planner process or the
shuffler's background thread) and executed by :mod:`balancer._gather` with one
kernel that never reads a device value: the runs and the gaps between them
tile the buffer into segments, and a permutation lists the runs in output
order.

Index arrays travel in one :class:`IndexBlob` per shuffle: one host buffer
per dtype, one (pinned, non-blocking) copy to the device.

Example (buffer of 10 elements, runs ``(6, 4)`` then ``(0, 2)``)::

    segments [0:0) [0:2) [2:6) [6:10) [10:10)   lengths [0, 2, 4, 4, 0]
    permute  [3, 1]                              output  buf[6:10] + buf[0:2]
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["HostBlob", "IndexBlob", "RunGather", "RunPut", "merge_runs", "plan_puts", "plan_runs"]


@dataclasses.dataclass(frozen=True)
class RunGather:
    """A planned copy of runs; :func:`balancer._gather.take_runs` executes it.

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

    def freeze(self) -> HostBlob:
        """One host array per dtype."""
        return HostBlob(_concat(self._i64, np.int64), tuple(a.size for a in self._i64),
                        _concat(self._i32, np.int32), tuple(a.size for a in self._i32))


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


@dataclasses.dataclass(frozen=True)
class HostBlob:
    """The arrays of an :class:`IndexBlob`, concatenated per dtype (picklable)."""

    i64: np.ndarray
    sizes64: tuple[int, ...]
    i32: np.ndarray
    sizes32: tuple[int, ...]


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


@dataclasses.dataclass(frozen=True)
class RunPut:
    """A planned scatter: a contiguous source's runs written at ``dst_starts``
    of a zeroed output of ``dst_numel`` elements (padded token slots);
    :func:`balancer._gather.put_runs` executes it."""

    total: int
    dst_numel: int
    dst_starts: int
    lengths: int
    src_starts: int


def plan_puts(blob: IndexBlob, dst_numel: int, dst_starts: np.ndarray, lengths: np.ndarray) -> RunPut:
    """Plan writing consecutive runs of a source (lengths ``lengths``, in order)
    at ``dst_starts`` of an output of ``dst_numel`` elements."""
    lengths = np.asarray(lengths, np.int64)
    dst_starts = np.asarray(dst_starts, np.int64)
    assert not lengths.size or int((dst_starts + lengths).max()) <= dst_numel, "a run leaves the output"
    src_starts = np.cumsum(lengths) - lengths
    return RunPut(int(lengths.sum()), dst_numel, blob.add64(dst_starts), blob.add64(lengths),
                  blob.add64(src_starts))
