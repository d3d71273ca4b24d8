"""The quadratic cost every length-based estimator shares: ``a L**2 + b L + c`` per sample.

:func:`sequence_lengths` reads the per-sample length a model sees from a
batch's KJT; :class:`_Quadratic` turns an estimator's ``coefficients()`` into
per-sample int64 costs. :mod:`balancer.workloads` and
:mod:`balancer.transformer_cost` both build on it (neither imports the other's
internals).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from balancer._ints import is_int
from balancer._limits import MAX_COST

__all__ = ["sequence_lengths"]


# ----------------------------------------------------------------- lengths
def sequence_lengths(
    batch: Any, feature_names: Sequence[str], *, interleaved: bool = False,
    include_contextual: bool = False,
) -> torch.Tensor:
    """Per-sample sequence length the model sees, int64 ``[batch_size]`` on the device.

    ``L = m * sum(len(f) for f in feature_names) + P``: ``m = 2`` when
    ``interleaved`` (HSTU action interleaving: one item and one action token per
    item, so ``feature_names`` names the item feature(s) only), else 1; ``P`` is
    the summed length of ``batch.contextual_feature_names`` when
    ``include_contextual``, else 0. Padding samples have length 0.

    Example: item lengths ``[3, 0]``, contextual ``user`` lengths ``[1, 1]``,
    ``interleaved=True, include_contextual=True`` gives ``[7, 1]``.

    A :class:`~balancer.tokens.TokenBatch` has one length per sample, its
    ``seq_lens`` (doubled when ``interleaved``): feature names and contextual
    features, which name KJT keys, do not apply to it.

    Raises:
        ValueError: a name is not a key of ``batch.features`` (the available
            keys are listed), or, with ``include_contextual``, a contextual
            feature is also in ``feature_names`` (it would be counted twice).
    """
    if is_token_batch(batch):
        seq_lens = batch.seq_lens.to(torch.int64)
        return seq_lens * 2 if interleaved else seq_lens
    kjt, b = batch.features, batch.batch_size
    keys = kjt.keys()
    missing = [n for n in feature_names if n not in keys]
    if missing:
        raise ValueError(f"feature_names {missing} are not keys of batch.features; available keys: {keys}")
    contextual = list(batch.contextual_feature_names) if include_contextual else []
    both = [n for n in contextual if n in feature_names]
    if both:
        raise ValueError(
            f"features {both} are in both feature_names and contextual_feature_names; "
            "list them in one place (or pass include_contextual=False)"
        )
    by_key = kjt.lengths().view(len(keys), b).to(torch.int64)
    # Row views and adds stay on the device; indexing with a Python list would
    # copy the index to the device first.
    out = torch.zeros(b, dtype=torch.int64, device=by_key.device)
    for name in feature_names:
        out += by_key[keys.index(name)]
    if interleaved:
        out *= 2
    for name in contextual:
        out += by_key[keys.index(name)]
    return out


def is_token_batch(batch: Any) -> bool:
    """Whether ``batch`` is a token batch (``seq_lens``, no KJT ``features``): told by its
    fields, as :mod:`balancer.tokens` imports nothing of the estimators'."""
    return isinstance(getattr(batch, "seq_lens", None), torch.Tensor) and not hasattr(batch, "features")


def _evaluate(batch: Any, lengths: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """``a L^2 + b L + c`` for real samples, 0 for padding, int64 in ``[0, MAX_COST]``."""
    x = lengths.to(torch.float64)
    y = (a * x + b) * x + c
    real = torch.arange(batch.batch_size, device=x.device) < int(batch.actual_batch_size or 0)
    y = torch.where(real, y, torch.zeros_like(y))
    # float64 -> int64 of a value >= 2**63 is undefined behaviour; clamp first.
    return y.round().clamp(0.0, float(MAX_COST)).to(torch.int64)


# ------------------------------------------------------------- validation
def _names(value: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"feature_names={value!r}, expected a non-empty sequence of str")
    if len(set(names)) != len(names):
        raise ValueError(f"feature_names={value!r} has duplicates")
    return names


def _positive_int(obj: object, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        if not is_int(v, 1):
            raise ValueError(f"{type(obj).__name__}: {f}={v!r}, expected an int >= 1")


class _Quadratic:
    """Shared ``__call__`` for estimators that define :meth:`coefficients`."""

    feature_names: Sequence[str]
    interleaved: bool
    include_contextual: bool

    def coefficients(self) -> tuple[float, float, float]:
        raise NotImplementedError

    def _check_coefficients(self) -> None:
        """Raise ``ValueError`` (at construction) where the settings give coefficients
        float64 cannot hold: ``mlp_ratio=1e308`` or huge dimensions raised
        ``OverflowError`` at every later call."""
        try:
            coefs = self.coefficients()
            finite = all(math.isfinite(c) for c in coefs)
        except OverflowError:
            finite = False
        if not finite:
            raise ValueError(f"{type(self).__name__}: its cost coefficients (a, b, c) overflow float64; "
                             "expected dimensions and ratios of a real model")

    def __call__(self, batch: Any) -> torch.Tensor:
        """Per-sample cost, int64 ``[batch.batch_size]`` on the batch's device."""
        lengths = sequence_lengths(
            batch, self.feature_names, interleaved=self.interleaved,
            include_contextual=self.include_contextual,
        )
        return _evaluate(batch, lengths, *self.coefficients())
