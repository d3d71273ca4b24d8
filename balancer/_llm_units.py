"""Units of an LLM batch: samples (or groups of samples) with their tokens and costs.

Shared by :mod:`balancer.microbatch` and :mod:`balancer.dispatch`: input
validation (lengths, costs, groups, settings) with ``ValueError`` messages
that name the value, the expectation and where it happened, and the
per-unit aggregates the planners work on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from balancer._limits import DISPATCH_TOTAL, LENGTHS_TOTAL

# Summed costs stay below this: the planners' bounds and ratios (sums, products by
# counts) of costs near float64's largest value came out inf or nan.
_COST_TOTAL = 1e300

__all__ = ["Units", "as_lengths", "check_fits", "check_flag", "check_positive", "is_empty", "make_units", "row_cost"]


def is_empty(lengths: Any) -> bool:
    """Whether ``lengths`` is a 1-D sequence, array or tensor of no element (anything else,
    malformed input included, is for :func:`as_lengths` to judge)."""
    if isinstance(lengths, torch.Tensor):
        return lengths.dim() == 1 and lengths.numel() == 0
    try:
        arr = np.asarray(lengths)
    except (TypeError, ValueError):
        return False
    return arr.ndim == 1 and arr.size == 0


def as_lengths(lengths: Any, where: str) -> np.ndarray:
    if isinstance(lengths, torch.Tensor):
        lengths = _host_numpy(lengths, "lengths", where)
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths has shape {tuple(arr.shape)}, expected 1-D [N] ({where})")
    if arr.size == 0:
        raise ValueError(f"lengths is empty, expected at least one sample ({where})")
    if arr.dtype.kind not in "iuf":  # not bools: True is no token count
        raise ValueError(f"lengths has dtype {arr.dtype}, expected integer token counts ({where})")
    if arr.dtype.kind in "iu":
        # Checked as integers: float64 would round 2**53 + 1 and wrap 2**63 - 1.
        big = arr >= LENGTHS_TOTAL
        if big.any():
            i = int(np.flatnonzero(big)[0])
            raise ValueError(f"lengths[{i}] = {arr[i]}, expected an integer below 2**53 ({where})")
    x = arr.astype(np.float64)
    bad = ~np.isfinite(x) | (x < 0) | (x != np.round(x)) | (x >= LENGTHS_TOTAL)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"lengths[{i}] = {arr[i]}, expected an integer >= 0 and below 2**53 ({where})")
    # Exact in int64 unless the float64 sum is already far past the limit.
    approx = float(x.sum())
    total = approx if approx >= 2.0**62 else int(x.astype(np.int64).sum())
    if total >= LENGTHS_TOTAL:
        raise ValueError(f"lengths sum to {total}, expected below 2**53 so that float64 sums them exactly "
                         f"({where})")
    return x.astype(np.int64)


def _host_numpy(t: torch.Tensor, name: str, where: str) -> np.ndarray:
    """A CPU tensor as numpy (detached; half floats widened: numpy has no bfloat16)."""
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}, expected a host array: reading a "
                         f"device tensor would synchronise ({where})")
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.to(torch.float64)
    return t.numpy()


def row_cost(cost: Any) -> Callable[[np.ndarray], np.ndarray] | None:
    """Per-sample cost as a function of length, or ``None`` for a per-sample array."""
    if cost is None:
        return lambda lens: lens
    if hasattr(cost, "of_lengths"):
        return lambda lens: np.asarray(cost.of_lengths(lens), dtype=np.float64)
    if hasattr(cost, "coefficients"):
        a, b, c = cost.coefficients()
        return lambda lens: (a * lens.astype(np.float64) + b) * lens + c
    if callable(cost):
        return lambda lens: np.asarray(cost(lens), dtype=np.float64)
    return None


def _sample_costs(lengths: np.ndarray, cost: Any, where: str) -> np.ndarray:
    fn = row_cost(cost)
    out = fn(lengths) if fn is not None else np.asarray(
        _host_numpy(cost, "cost", where) if isinstance(cost, torch.Tensor) else cost)
    if out.shape != lengths.shape:
        raise ValueError(f"cost gives shape {tuple(out.shape)}, expected [{lengths.size}] ({where})")
    if out.dtype.kind not in "iuf":
        raise ValueError(f"cost has dtype {out.dtype}, expected numbers per sample, a function of length "
                         f"or None ({where})")
    if out.dtype.kind == "f":
        out = out.astype(np.float64)
        bad = ~np.isfinite(out) | (out < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"cost of sample {i} is {out[i]}, expected a finite value >= 0 ({where})")
    elif out.size and out.min() < 0:
        raise ValueError(f"cost of sample {int(np.argmin(out))} is negative ({where})")
    elif float(out.sum(dtype=np.float64)) >= DISPATCH_TOTAL:
        # Integer costs this large would wrap when summed per group or per part
        # (and overflow the packers' int64 heaps): plan them as float64.
        out = out.astype(np.float64)
    else:
        # Sums per group, micro-batch or rank are taken in the array's dtype: a
        # narrower one wraps (three uint8 costs of 100 summed to 44).
        out = out.astype(np.int64)
    with np.errstate(over="ignore"):  # an inf total is refused below, not warned about
        total = float(out.sum(dtype=np.float64))
    if not total < _COST_TOTAL:
        raise ValueError(f"costs sum to {total:.6g}, expected below {_COST_TOTAL:.0e} (bounds and "
                         f"imbalance ratios of larger ones overflow float64): scale them down ({where})")
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Units:
    """Samples grouped into units (in order of their first sample)."""

    members: list[np.ndarray]  # [U] ascending sample indices
    tokens: np.ndarray  # [U] int64
    rows: np.ndarray  # [U] int64
    head: np.ndarray  # [U] int64 longest sample
    cost: np.ndarray  # [U] summed sample cost
    head_cost: np.ndarray  # [U] float64 per-row cost at `head` (padded only; else zeros)
    sample_cost: np.ndarray  # [N]


def make_units(lengths: np.ndarray, cost: Any, groups: Any, padded: bool, where: str) -> Units:
    n = lengths.size
    if padded and row_cost(cost) is None:
        raise ValueError(f"padded=True needs cost as a function of length, not per-sample values ({where})")
    sc = _sample_costs(lengths, cost, where)
    if groups is None:
        members = [np.array([i]) for i in range(n)]
        inv = np.arange(n)
    else:
        g = np.asarray(_host_numpy(groups, "groups", where) if isinstance(groups, torch.Tensor) else groups)
        if g.shape != (n,) or g.dtype.kind not in "iu":
            raise ValueError(f"groups has shape {g.shape} and dtype {g.dtype}, expected [{n}] ints ({where})")
        _, first, inv = np.unique(g, return_index=True, return_inverse=True)
        rank = np.argsort(np.argsort(first, kind="stable"), kind="stable")
        inv = rank[inv]  # unit ids in order of first appearance
        order = np.argsort(inv, kind="stable")
        members = np.split(order, np.cumsum(np.bincount(inv))[:-1])
    u = len(members)
    tokens = np.bincount(inv, weights=lengths, minlength=u).astype(np.int64)
    rows = np.bincount(inv, minlength=u).astype(np.int64)
    head = np.zeros(u, np.int64)
    np.maximum.at(head, inv, lengths)
    ucost = np.zeros(u, sc.dtype)
    np.add.at(ucost, inv, sc)
    fn = row_cost(cost)
    head_cost = np.asarray(fn(head), dtype=np.float64) if padded and fn is not None else np.zeros(u)
    return Units(members, tokens, rows, head, ucost, head_cost, sc)


def check_fits(un: Units, cap: int | None, mbs: int | None, padded: bool, where: str) -> None:
    need = un.rows * un.head if padded else un.tokens
    for limit, what, name in ((cap, need, "max_tokens"), (mbs if padded else None, un.rows, "micro_batch_size")):
        if limit is not None and what.size and what.max() > limit:
            u = int(np.argmax(what))
            who = (f"sample {int(un.members[u][0])}" if un.members[u].size == 1
                   else f"group of samples {un.members[u].tolist()}")
            detail = (f"{int(un.rows[u])} rows x {int(un.head[u])} = " if padded and name == "max_tokens"
                      else "")
            unit = "tokens" if name == "max_tokens" else "rows"
            raise ValueError(f"{who} needs {detail}{int(what[u])} {unit}, more than {name}={limit}; "
                             f"it must fit in one micro-batch ({where})")


def check_flag(name: str, value: Any, where: str) -> None:
    """A Python bool (np.False_ was falsy in one check and ``is not False`` in another)."""
    if not isinstance(value, bool):
        # The type too: numpy 1.x shows np.False_ as a bare "False".
        raise ValueError(f"{name}={value!r} ({type(value).__name__}), expected a Python bool ({where})")


def check_positive(name: str, value: Any, where: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}, expected an int >= 1 ({where})")
    if value >= 2**63:  # the planners hold it in int64 arrays (sys.maxsize is the largest)
        raise ValueError(f"{name}={value!r}, expected an int below 2**63 ({where})")
