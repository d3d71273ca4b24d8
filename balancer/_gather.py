"""Host-planned run copies, executed on the device without reading a device value.

:mod:`balancer._runs` plans a :class:`~balancer._runs.RunGather` (numpy); this
module runs it:

* ``torch.ops.fbgemm.permute_1D_sparse_data`` when the element size has a
  kernel (8, 4 and 2 bytes, through :func:`balancer._layout.opaque` views).
  Passing the output size spares the kernel a device-to-host sync.
* otherwise (1-byte elements, or no fbgemm): an index built on the device with
  ``repeat_interleave(..., output_size=total)``, then ``index_select``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from balancer._runs import HostBlob, RunGather, RunPut

logger = logging.getLogger(__name__)

__all__ = ["DeviceBlob", "host_tensors", "put_runs", "take_runs", "upload"]


def _has_permute() -> bool:
    try:
        torch.ops.fbgemm.permute_1D_sparse_data  # noqa: B018 - lookup raises if absent
    except (AttributeError, RuntimeError):
        return False
    return True


_PERMUTE = _has_permute()
_FBGEMM_ITEMSIZES = frozenset({8, 4, 2})


@dataclasses.dataclass(frozen=True)
class HostTensors:
    """A :class:`~balancer._runs.HostBlob` as host tensors (pinned when they
    will be copied to a CUDA device)."""

    i64: torch.Tensor
    sizes64: tuple[int, ...]
    i32: torch.Tensor
    sizes32: tuple[int, ...]


def host_tensors(blob: HostBlob, pin: bool) -> HostTensors:
    """Wrap (and with ``pin``, copy to pinned memory) the blob's arrays; background thread."""
    def wrap(a: object) -> torch.Tensor:
        t = torch.from_numpy(a)  # type: ignore[arg-type]
        return t.pin_memory() if pin and t.numel() else t
    return HostTensors(wrap(blob.i64), blob.sizes64, wrap(blob.i32), blob.sizes32)


@dataclasses.dataclass(frozen=True)
class DeviceBlob:
    """The blob's arrays on the device, split back into the planned arrays."""

    i64: list[torch.Tensor]
    i32: list[torch.Tensor]


def upload(blob: HostTensors, device: torch.device) -> DeviceBlob:
    """Copy to ``device`` (non-blocking from pinned memory; a view on the CPU)."""
    # The caching host allocator keeps the pinned source alive until the copy
    # has run, so the host tensors may be dropped after this call.
    d64 = blob.i64.to(device, non_blocking=True)
    d32 = blob.i32.to(device, non_blocking=True)
    return DeviceBlob(list(torch.split(d64, list(blob.sizes64))) if blob.sizes64 else [],
                      list(torch.split(d32, list(blob.sizes32))) if blob.sizes32 else [])


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


def put_runs(src: torch.Tensor, p: RunPut, blob: DeviceBlob, out: torch.Tensor | None = None) -> torch.Tensor:
    """Execute ``p``: ``src``'s runs written into ``out`` (``[p.dst_numel]`` of src's
    dtype; default zeros), which is returned."""
    if out is None:
        out = src.new_zeros(p.dst_numel)
    if p.total == 0:
        return out
    lengths = blob.i64[p.lengths]
    idx = torch.repeat_interleave(blob.i64[p.dst_starts] - blob.i64[p.src_starts], lengths, output_size=p.total)
    idx += torch.arange(p.total, device=src.device)
    return out.index_copy_(0, idx, src)
