"""Batches the library builds correct by construction skip the padding-content check.

``BaseBatch.__post_init__`` reads its padding samples' values to check them
(on the CPU). A shuffle's output, or a batch :func:`balancer.batch.pad_batch`
builds, is correct by construction, and reading its values would be a value
read in the caller's per-step path: :func:`trusted` and
:func:`replace_unchecked` switch that check off for the batches they build.
Kept apart from :mod:`balancer.batch` so that the token path, which shares the
shuffle's code, does not import TorchRec (:mod:`balancer._torchrec`).
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["CHECK_CONTENTS", "replace_unchecked", "trusted"]

_B = TypeVar("_B")
_T = TypeVar("_T")

# False while the library builds a batch it constructed correct by design.
CHECK_CONTENTS: contextvars.ContextVar[bool] = contextvars.ContextVar("balancer_check_contents", default=True)


def trusted(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)`` with the padding-content check of every batch it
    builds switched off (for batches correct by construction)."""
    token = CHECK_CONTENTS.set(False)
    try:
        return fn(*args, **kwargs)
    finally:
        CHECK_CONTENTS.reset(token)


def replace_unchecked(batch: _B, **changes: Any) -> _B:
    """``dataclasses.replace`` that checks shapes but reads no tensor value.

    For batches the library built correct by construction (the shuffle's
    output): the padding-content check of ``__post_init__`` reads values.
    """
    token = CHECK_CONTENTS.set(False)
    try:
        return dataclasses.replace(batch, **changes)  # type: ignore[type-var]
    finally:
        CHECK_CONTENTS.reset(token)
