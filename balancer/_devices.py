"""Which CUDA device: the calling thread's, and the one a process group's collectives use.

CUDA's current device is per thread, and a new thread starts on device 0: a thread of
ours (the shuffle's background thread, BalancedLoader's producer) runs CUDA calls
under the device of the thread that gave it the work, or on a node of several GPUs
they land on GPU 0 (a stray context there from every rank, tensors on the wrong GPU).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["caller_cuda_device", "collective_device", "on_cuda_device"]


def caller_cuda_device() -> int | None:
    """The calling thread's current CUDA device where this process uses CUDA, else
    ``None`` (asking would initialise CUDA)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def on_cuda_device(index: int | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(index)``; nothing for ``None``."""
    return torch.cuda.device(index) if index is not None else contextlib.nullcontext()


def collective_device(pg: Any, prefer: torch.device | None = None) -> torch.device:
    """Where a small collective on ``pg`` puts its tensor: the CPU unless ``pg`` is NCCL;
    there the group's bound device (``init_process_group(device_id=...)``), else ``prefer``
    when it is a CUDA device, else the calling thread's current device."""
    if dist.get_backend(pg) != "nccl":
        return torch.device("cpu")
    group = pg if pg is not None else dist.distributed_c10d._get_default_group()
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return bound  # type: ignore[no-any-return]
    if prefer is not None and prefer.type == "cuda":
        return prefer
    return torch.device("cuda", torch.cuda.current_device())
