"""New host tensors in pinned memory where their source is pinned.

A batch a DataLoader pinned goes to the device by a ``non_blocking`` copy (TorchRec's
pipeline, or the user's loop); a tensor built from it in pageable memory -- padding
added to it, a padding batch in its likeness -- makes that copy wait: the driver
stages a pageable source and may synchronise with the stream first. Asked only in a
process that already uses CUDA: ``is_pinned`` asks the driver, which would create a
context (on GPU 0) in one that does not, and fails in a DataLoader worker forked
after its parent did. Without CUDA these are the plain ``torch`` calls.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["filled_like", "grown", "new_full"]


def _pinned(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and torch.cuda.is_initialized() and t.is_pinned()


def filled_like(t: torch.Tensor, value: Any = 0) -> torch.Tensor:
    """``torch.full_like(t, value)``, pinned where ``t`` is."""
    if not _pinned(t):
        return torch.full_like(t, value)
    return torch.empty_like(t, pin_memory=True).fill_(value)


def new_full(t: torch.Tensor, shape: tuple[int, ...], value: Any = 0) -> torch.Tensor:
    """``t.new_full(shape, value)``, pinned where ``t`` is."""
    if not _pinned(t):
        return t.new_full(shape, value)
    return torch.full(shape, value, dtype=t.dtype, pin_memory=True)


def grown(t: torch.Tensor, rows: int, value: Any = 0) -> torch.Tensor:
    """``t`` with rows of ``value`` appended up to ``rows`` along dim 0, pinned where ``t`` is."""
    out = new_full(t, (rows, *t.shape[1:]), value)
    out[: t.shape[0]] = t
    return out
