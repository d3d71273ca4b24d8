"""Per-sample workload estimators: ``batch -> int64[batch_size]`` cost.

A *workload function* (:data:`WorkloadFn`) maps a :class:`~balancer.batch.BaseBatch`
to an int64 tensor ``[batch_size]`` of per-sample cost; the shuffler moves samples
so every rank gets the same total. Only ratios between samples matter.

Every estimator here is a frozen dataclass whose cost is a quadratic in the
sample's sequence length ``L`` (:func:`sequence_lengths`)::

    cost(L) = a * L**2 + b * L + c        (real samples; padding costs 0)

:class:`HSTUAttentionCost` and :class:`SelfAttentionCost` derive ``a, b`` from the
layer's matmul shapes (FLOPs, ``c = 0``); :class:`TokenCount` is ``L``;
:class:`PolynomialCost` takes ``a, b, c`` directly, e.g. from :func:`calibrate`.
Costs are evaluated in float64 on the batch's device (no host sync), rounded and
clamped to ``[0, MAX_COST]`` before the int64 cast, so huge lengths saturate
instead of wrapping negative. Estimators compose as plain callables:
``lambda b: attn(b) + 4096 * tokens(b)``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from balancer._ints import as_count
from balancer._limits import MAX_COST
from balancer._quadratic import _names, _positive_int, _Quadratic, sequence_lengths
from balancer.transformer_cost import TransformerCost

if TYPE_CHECKING:  # annotations only: the token path runs without TorchRec (_torchrec)
    from balancer.batch import BaseBatch

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_COST", "Calibration", "HSTUAttentionCost", "PolynomialCost", "SelfAttentionCost",
    "TokenCount", "TransformerCost", "WorkloadFn", "calibrate", "fit_polynomial", "measure_times",
    "sequence_lengths",
]

if TYPE_CHECKING:
    WorkloadFn = Callable[[BaseBatch], torch.Tensor]
else:  # resolvable at run time (typing.get_type_hints) without importing TorchRec
    WorkloadFn = Callable[[Any], torch.Tensor]
"""Maps a batch to an int64 tensor ``[batch_size]`` of per-sample cost."""


# ------------------------------------------------------------- estimators
@dataclasses.dataclass(frozen=True)
class HSTUAttentionCost(_Quadratic):
    """Matmul FLOPs of ``num_layers`` HSTU layers (Zhai et al. 2024) per sample.

    With ``d = hidden_dim``, ``H = num_heads``, ``da = head_dim``,
    ``dl = linear_dim``, ``N = num_layers`` and a multiply-add counted as 2
    FLOPs, one layer on ``L`` tokens costs::

        input projection  X -> U, V, Q, K    2 L d H (2 dl + 2 da)
        scores            Q K^T              2 H da P
        aggregation       A V                2 H dl P
        output projection H dl -> d          2 L H dl d

        FLOPs = N * (2 L d H (3 dl + 2 da) + 2 H (da + dl) P)

    where ``P = L (L + 1) / 2`` query-key pairs with ``causal`` (``j <= i``) and
    ``P = L**2`` without. Heads are counted once and only the causal half of
    the pairs (the predecessor, NVIDIA recsys-examples, multiplies the attention
    term by heads twice and always counts ``L**2`` pairs). Elementwise work is
    not counted: SiLU on the ``H P`` scores is a few ops per pair against
    ``2 (da + dl)`` matmul FLOPs, and SiLU, layer norm and the ``U * norm(AV)``
    gate are ``O(H dl)`` per token against ``O(d H dl)``; all are memory-bound.
    Relative attention bias is not counted.

    Attributes:
        feature_names: the item feature(s) forming the sequence.
        hidden_dim, num_heads, head_dim, linear_dim, num_layers: ``d, H, da,
            dl, N`` above; ints >= 1.
        interleaved: action interleaving doubles the item length.
        causal: count only the causal half of the attention pairs.
        include_contextual: add the contextual prefix to the length.
    """

    feature_names: Sequence[str]
    hidden_dim: int
    num_heads: int
    head_dim: int
    linear_dim: int
    num_layers: int = 1
    interleaved: bool = False
    causal: bool = True
    include_contextual: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_names", _names(self.feature_names))
        _positive_int(self, "hidden_dim", "num_heads", "head_dim", "linear_dim", "num_layers")
        self._check_coefficients()

    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, c)`` with ``FLOPs(L) = a L^2 + b L + c``."""
        d, h, da, dl, n = self.hidden_dim, self.num_heads, self.head_dim, self.linear_dim, self.num_layers
        linear = 2 * d * h * (3 * dl + 2 * da)
        pair = 2 * h * (da + dl)  # FLOPs per query-key pair, all heads
        if self.causal:  # pair * L (L + 1) / 2
            return float(n * pair / 2), float(n * (linear + pair / 2)), 0.0
        return float(n * pair), float(n * linear), 0.0


@dataclasses.dataclass(frozen=True)
class SelfAttentionCost(_Quadratic):
    """Matmul FLOPs of ``num_layers`` pre-norm transformer layers per sample.

    With ``d = hidden_dim``, ``H = num_heads``, ``h = head_dim`` (default
    ``d / H``), ``f = round(mlp_ratio * d)``, ``N = num_layers`` and a
    multiply-add counted as 2 FLOPs, one layer on ``L`` tokens costs::

        QKV projection    d -> 3 H h         6 L d H h
        scores + A V                         4 H h P
        output projection H h -> d           2 L H h d
        MLP               d -> f -> d        4 L d f   (gated: 6 L d f)

        FLOPs = N * (8 L d H h + 4 H h P + 4 L d f)   (gated: 6 L d f)

    with ``P = L (L + 1) / 2`` pairs when ``causal``, else ``L**2``. Norms,
    softmax, activations and residual adds are not counted.

    Attributes:
        feature_names: the feature(s) forming the sequence.
        hidden_dim, num_heads, num_layers: ``d, H, N`` above; ints >= 1.
        mlp_ratio: MLP hidden width over ``d``.
        causal: count only the causal half of the attention pairs.
        gated_mlp: SwiGLU-style MLP, three ``d x f`` matmuls instead of two.
        head_dim: per-head dimension ``h``; ``None`` means ``d / H``.
        interleaved, include_contextual: see :func:`sequence_lengths`.
    """

    feature_names: Sequence[str]
    hidden_dim: int
    num_heads: int
    mlp_ratio: float = 4.0
    num_layers: int = 1
    causal: bool = True
    gated_mlp: bool = False
    head_dim: int | None = None
    interleaved: bool = False
    include_contextual: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_names", _names(self.feature_names))
        _positive_int(self, "hidden_dim", "num_heads", "num_layers")
        if self.head_dim is None:
            if self.hidden_dim % self.num_heads:
                raise ValueError(
                    f"SelfAttentionCost: hidden_dim={self.hidden_dim} is not divisible by "
                    f"num_heads={self.num_heads}; pass head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_dim // self.num_heads)
        _positive_int(self, "head_dim")
        if not (math.isfinite(self.mlp_ratio) and self.mlp_ratio >= 0):
            raise ValueError(f"SelfAttentionCost: mlp_ratio={self.mlp_ratio!r}, expected a finite float >= 0")
        self._check_coefficients()

    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, c)`` with ``FLOPs(L) = a L^2 + b L + c``."""
        assert self.head_dim is not None, "set in __post_init__"
        d, hh, n = self.hidden_dim, self.num_heads * self.head_dim, self.num_layers
        f = round(self.mlp_ratio * d)
        linear = 8 * d * hh + (6 if self.gated_mlp else 4) * d * f
        pair = 4 * hh
        if self.causal:
            return float(n * pair / 2), float(n * (linear + pair / 2)), 0.0
        return float(n * pair), float(n * linear), 0.0


@dataclasses.dataclass(frozen=True)
class TokenCount(_Quadratic):
    """Number of tokens per sample, ``L`` (see :func:`sequence_lengths`)."""

    feature_names: Sequence[str]
    interleaved: bool = False
    include_contextual: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_names", _names(self.feature_names))

    def coefficients(self) -> tuple[float, float, float]:
        """``(0, 1, 0)``."""
        return 0.0, 1.0, 0.0


@dataclasses.dataclass(frozen=True)
class PolynomialCost(_Quadratic):
    """``a L^2 + b L + c`` per real sample, rounded to int64; padding costs 0.

    The constant ``c`` (fixed per-sample overhead) applies to every real sample,
    including one of length 0. Negative values are clamped to 0.

    Attributes:
        feature_names: the feature(s) forming the sequence.
        a, b, c: coefficients in cost units (nanoseconds from :func:`calibrate`).
        interleaved, include_contextual: see :func:`sequence_lengths`.
    """

    feature_names: Sequence[str]
    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    interleaved: bool = False
    include_contextual: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_names", _names(self.feature_names))
        for f in ("a", "b", "c"):
            v = getattr(self, f)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not _finite_float(v):
                raise ValueError(f"PolynomialCost: {f}={v!r}, expected a finite number")
            if isinstance(v, (np.integer, np.floating)):
                object.__setattr__(self, f, float(v))  # a plain float (the dataclass is frozen)

    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, c)``."""
        return float(self.a), float(self.b), float(self.c)


def _finite_float(v: Any) -> bool:
    """Whether ``v`` is finite as a float64 (``10**400`` is not: it raised OverflowError)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


# ------------------------------------------------------------ calibration
@dataclasses.dataclass(frozen=True)
class Calibration:
    """Result of :func:`fit_polynomial`: ``scale * time(L) ~ a L^2 + b L + c``.

    ``a, b, c`` are in cost units (time units times ``scale``); ``rmse`` is the
    root-mean-square (absolute) residual in time units; ``r2`` the coefficient of
    determination (1.0 when all times are equal and fitted exactly, 0.0 when
    they are equal and not).
    """

    a: float
    b: float
    c: float
    rmse: float
    r2: float
    scale: float

    def to_cost(self, feature_names: Sequence[str], **kwargs: Any) -> PolynomialCost:
        """A :class:`PolynomialCost` with these coefficients; ``kwargs`` go to it."""
        return PolynomialCost(feature_names, a=self.a, b=self.b, c=self.c, **kwargs)


def _lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Scale columns to unit norm: L^2 and 1 differ by ~12 orders of magnitude.
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    sol = np.linalg.lstsq(x / norms, y, rcond=None)[0]
    return np.asarray(sol / norms, dtype=np.float64)


def fit_polynomial(
    lengths: Sequence[float] | np.ndarray, times: Sequence[float] | np.ndarray,
    degree: int = 2, nonneg: bool = True, scale: float = 1e9, relative: bool = True,
) -> Calibration:
    """Least-squares fit of ``a L^2 + b L + c`` to measured ``(L, time)`` pairs.

    With ``nonneg`` the fit is a non-negative least squares: with at most three
    coefficients we solve the unconstrained problem on each of the ``2**3``
    supports and keep the best one whose coefficients are all ``>= 0``. That is
    exact: the NNLS optimum is the unconstrained optimum on its own support.

    Args:
        lengths, times: ``[n]`` lengths and measured times (e.g. seconds), >= 0.
        degree: 0, 1 or 2; higher coefficients are 0.
        nonneg: constrain every coefficient to ``>= 0`` (a cost that falls with
            length would mislead the balancer).
        scale: multiplies the coefficients so int64 costs keep resolution; the
            default turns seconds into nanoseconds.
        relative: minimise relative residuals ``(fit - t) / t`` instead of
            absolute ones. Calibration lengths usually span decades and timing
            noise is roughly proportional to the time, so an absolute fit is
            decided by the longest lengths alone and may drop the linear term
            that dominates short sequences; those errors add up over the many
            short samples of a batch. Zero times get the weight of the smallest
            positive time.

    Returns:
        A :class:`Calibration`; ``.to_cost(names)`` gives the estimator.

    Raises:
        ValueError: invalid inputs, fewer than ``degree + 1`` distinct lengths,
            or coefficients that overflow float64 at this ``scale``.
    """
    lx = np.asarray(lengths, dtype=np.float64)
    ty = np.asarray(times, dtype=np.float64)
    if lx.ndim != 1 or ty.ndim != 1:  # a 2-D array was flattened without a word
        raise ValueError(f"lengths has shape {lx.shape} and times {ty.shape}, expected 1-D [N] each")
    if isinstance(degree, bool) or degree not in (0, 1, 2):  # True fitted degree 1
        raise ValueError(f"degree={degree!r}, expected 0, 1 or 2")
    for name, flag in (("nonneg", nonneg), ("relative", relative)):
        if not isinstance(flag, bool):  # "no" was truthy
            raise ValueError(f"{name}={flag!r}, expected a bool")
    if lx.shape != ty.shape:
        raise ValueError(f"lengths has {lx.size} entries and times {ty.size}, expected equal")
    if not (np.isfinite(lx).all() and np.isfinite(ty).all() and (lx >= 0).all() and (ty >= 0).all()):
        raise ValueError("lengths and times must be finite and >= 0")
    if (n := len(np.unique(lx))) < degree + 1:
        raise ValueError(f"{n} distinct lengths, expected >= degree + 1 = {degree + 1}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r}, expected a finite float > 0")
    # Fit in units of the longest length and the longest time (L = l_max u,
    # t = t_max s), so that no input scale over- or underflows the squares:
    # times of 1e300 or denormals and lengths of 1e160 raised OverflowError
    # or LinAlgError. The coefficients are scaled back at the end.
    l_max = float(lx.max(initial=0.0)) or 1.0
    t_max = float(ty.max(initial=0.0)) or 1.0
    u, st = lx / l_max, ty / t_max
    x = np.stack([u**2, u, np.ones_like(u)], axis=1)[:, 2 - degree :]
    k = x.shape[1]
    w = np.ones_like(st)
    if relative and (st > 0).any():
        w = 1.0 / np.maximum(st, st[st > 0].min())
    xw, tw = x * w[:, None], st * w
    best, best_res = np.zeros(k), float(tw @ tw)
    for mask in range(1, 2**k):
        cols = [i for i in range(k) if mask >> i & 1]
        sol = np.zeros(k)
        sol[cols] = _lstsq(xw[:, cols], tw)
        if nonneg and (sol < 0).any():
            continue
        res = float(np.sum((xw @ sol - tw) ** 2))
        if res < best_res:
            best, best_res = sol, res
    full = np.concatenate([np.zeros(3 - k), best])
    abs_res = float(np.sum((x @ best - st) ** 2))  # in units of t_max^2
    ss_tot = float(np.sum((st - st.mean()) ** 2))
    # Equal times leave rounding in both sums (~1e-36 for 7e-3 s): below this
    # they are zero, or R^2 of an exact fit came out as 0 or -3.
    noise = st.size * (1e-12 * float(np.abs(st).max(initial=0.0))) ** 2
    r2 = 1.0 - abs_res / ss_tot if ss_tot > noise else float(abs_res <= noise)
    a, b, c = (float(v) * t_max * scale for v in full)  # Python floats: inf on overflow, never raise
    a, b = a / l_max / l_max, b / l_max
    if not all(math.isfinite(v) for v in (a, b, c)):
        raise ValueError(f"the fitted coefficients (a, b, c) = ({a:g}, {b:g}, {c:g}) overflow float64 at "
                         f"scale={scale:g} with times up to {t_max:g} and lengths up to {l_max:g}; "
                         "pass a smaller scale or times in larger units")
    return Calibration(a=a, b=b, c=c, rmse=t_max * math.sqrt(abs_res / st.size), r2=r2, scale=scale)


def measure_times(
    measure_fn: Callable[[int], object], lengths: Sequence[int], *, repeats: int = 5,
    warmup: int = 1, clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Median wall time of ``measure_fn(L)`` for each ``L``, in ``clock`` units.

    ``measure_fn`` must finish its work before returning (on CUDA: call
    ``torch.cuda.synchronize()``), or the time is only the launch overhead.
    """
    reps, warm = as_count(repeats), as_count(warmup)
    if reps is None or reps < 1 or warm is None or warm < 0:  # 2.5 raised a bare TypeError from range()
        raise ValueError(f"repeats={repeats!r}, warmup={warmup!r}, expected ints, repeats >= 1, warmup >= 0")
    repeats, warmup = reps, warm
    lengths = list(lengths)  # a generator is read once, here
    if not lengths:
        raise ValueError("lengths is empty, expected at least one length to time")
    out = []
    for length in lengths:
        for _ in range(warmup):
            measure_fn(length)
        samples = []
        for _ in range(repeats):
            t0 = clock()
            measure_fn(length)
            samples.append(clock() - t0)
        out.append(statistics.median(samples))
    return out


def calibrate(
    measure_fn: Callable[[int], object], lengths: Sequence[int], feature_names: Sequence[str],
    *, repeats: int = 5, warmup: int = 1, degree: int = 2, scale: float = 1e9,
    clock: Callable[[], float] = time.perf_counter, **cost_kwargs: Any,
) -> PolynomialCost:
    """Time ``measure_fn`` at ``lengths`` and fit a non-negative quadratic.

    ``measure_fn(L)`` runs the model's forward and backward on one sample (or a
    fixed number of samples) that the model sees as ``L`` tokens (the ``L`` of
    :func:`sequence_lengths` with ``cost_kwargs``) and synchronises. Times are medians
    of ``repeats`` runs after ``warmup``; with the default ``clock`` and
    ``scale`` costs are nanoseconds. The fit's R^2 is logged; for the full
    :class:`Calibration` call :func:`measure_times` and :func:`fit_polynomial`.

    Returns:
        ``PolynomialCost(feature_names, a, b, c, **cost_kwargs)``.

    Raises:
        ValueError: as :func:`measure_times` and :func:`fit_polynomial`, or every
            measured time is 0.
    """
    lengths = list(lengths)  # read twice below: a generator would be empty the second time
    times = measure_times(measure_fn, lengths, repeats=repeats, warmup=warmup, clock=clock)
    if not any(t > 0 for t in times):
        # A cost of 0 for every sample would silently turn balancing off.
        raise ValueError(f"every measured time is 0 ({len(times)} lengths): the clock did not advance "
                         "across measure_fn (too coarse a clock, or measure_fn does no work)")
    cal = fit_polynomial(lengths, times, degree=degree, nonneg=True, scale=scale)
    logger.info("calibrated cost %.4g L^2 + %.4g L + %.4g (R^2=%.4f)", cal.a, cal.b, cal.c, cal.r2)
    if cal.r2 < 0.9:
        logger.warning("calibration fits poorly (R^2=%.3f); check measure_fn synchronises", cal.r2)
    return cal.to_cost(feature_names, **cost_kwargs)
