"""``padding_like``: an all-padding batch of a batch's layout, for either batch type.

Here and not in :mod:`balancer.batch` so that token batches get theirs without
TorchRec (:mod:`balancer._torchrec`); ``balancer.batch`` re-exports it.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TypeVar

import torch

from balancer._pinned import filled_like
from balancer._torchrec import BATCH_TYPES
from balancer.tokens import TokenBatch, pad_value

__all__ = ["padding_like"]

_T = TypeVar("_T")


def padding_like(batch: _T) -> _T:
    """A batch of ``batch``'s layout and size with no real sample: ``actual_batch_size = 0``,
    zero lengths and dense rows (a padded ``TokenBatch``'s token rows hold its
    ``pad_values``; a packed one holds no token). Device ops only (on the CPU, building
    the ``BaseBatch`` checks its padding contents, as every construction there does).

    What a rank whose data has run out takes part with while its peers still have
    batches (shuffled with ``start_shuffle_async(..., exhausted=True)``): every rank must
    shuffle the same number of batches (``BalancedLoader`` and the balanced TorchRec
    pipeline do this by themselves).

    Raises:
        TypeError: ``batch`` is neither a :class:`~balancer.batch.BaseBatch` nor a
            :class:`~balancer.tokens.TokenBatch`.
    """
    if isinstance(batch, TokenBatch):
        tb = batch

        def tokens(name: str, t: torch.Tensor) -> torch.Tensor:  # a packed batch holds no token at all
            return t.new_zeros((0, *t.shape[1:])) if tb.packed else filled_like(t, pad_value(tb, name))
        return dataclasses.replace(  # type: ignore[return-value]
            tb, seq_lens=filled_like(tb.seq_lens), tokens={k: tokens(k, v) for k, v in tb.tokens.items()},
            samples={k: filled_like(v) for k, v in tb.samples.items()}, actual_batch_size=0)
    base = sys.modules.get("balancer.batch")  # a BaseBatch exists only once its module is loaded
    if base is None or not isinstance(batch, base.BaseBatch):
        raise TypeError(f"padding_like: batch is a {type(batch).__name__}, expected a {BATCH_TYPES}")
    return base.base_padding(batch)  # type: ignore[no-any-return]
