"""New host tensors in pinned memory where their source is pinned.

A batch a DataLoader pinned goes to the device by a ``non_blocking`` copy (TorchRec's
pipeline, or the user's loop); a tensor built from it in pageable memory -- padding
added to it, a padding batch in its likeness -- makes that copy wait: the driver
stages a pageable source and may synchronise with the stream first. On a machine
without CUDA nothing is pinned, and these are the plain ``torch`` calls.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["filled_like", "new_full"]


def filled_like(t: torch.Tensor, value: Any = 0) -> torch.Tensor:
    """``torch.full_like(t, value)`` (``t``'s strides too), pinned where ``t`` is."""
    if not t.is_pinned():
        return torch.full_like(t, value)
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=True).fill_(value)


def new_full(t: torch.Tensor, shape: tuple[int, ...], value: Any = 0) -> torch.Tensor:
    """``t.new_full(shape, value)``, pinned where ``t`` is."""
    if not t.is_pinned():
        return t.new_full(shape, value)
    return torch.full(shape, value, dtype=t.dtype, pin_memory=True)
