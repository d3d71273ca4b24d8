"""Input checks shared by the partition package's public functions.

Every public function converts its input here first, so the algorithms below
see only validated arrays: int64 (integer input) or float64 (float input),
1-D, non-negative, finite, with a total below :data:`balancer._limits.MAX_TOTAL`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from balancer._limits import MAX_TOTAL

__all__ = ["as_workloads", "check_home", "check_num_parts", "check_sizes"]


def check_num_parts(num_parts: int) -> None:
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)):
        raise TypeError(f"num_parts={num_parts!r}, expected an int")
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts}, expected >= 1")


def as_workloads(workloads: Any, num_parts: int, name: str = "workloads") -> np.ndarray:
    """Validate and convert to int64 (integer input) or float64 (float input)."""
    check_num_parts(num_parts)
    arr = _as_array(workloads)
    if arr.ndim != 1:
        raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected 1-D [N]")
    n = arr.size
    if n % num_parts:
        raise ValueError(f"{name} has {n} entries, not divisible by num_parts={num_parts}")
    kind = arr.dtype.kind
    if kind in "biu":
        if kind == "u" and n and int(arr.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"{name} max {int(arr.max())} does not fit in int64")
        x = arr.astype(np.int64, copy=False)
    elif kind == "f":
        x = arr.astype(np.float64, copy=False)
        if n and not np.isfinite(x).all():
            i = int(np.flatnonzero(~np.isfinite(x))[0])
            raise ValueError(f"{name}[{i}] = {x[i]}, expected a finite value")
    else:
        raise ValueError(f"{name} has dtype {arr.dtype}, expected integers or floats")
    if n and x.min() < 0:
        i = int(np.argmin(x))
        raise ValueError(f"{name}[{i}] = {x[i]}, expected >= 0")
    if n:
        with np.errstate(over="ignore"):  # an inf total is refused below, not warned about
            total: int | float = float(x.sum(dtype=np.float64))
        if total >= MAX_TOTAL * (1 - 1e-9) and x.dtype.kind == "i":
            total = sum(x.tolist())  # near the limit, integers are judged by their exact total
        if total >= MAX_TOTAL:
            raise ValueError(f"{name} sum to {total:.6g}, expected < 2**61")
    return x


def _as_array(values: Any) -> np.ndarray:
    """``values`` as a numpy array; a CPU torch tensor also when it requires grad or
    has a dtype numpy lacks (bfloat16, float8: as float64). Without importing torch."""
    if type(values).__module__.split(".")[0] == "torch" and hasattr(values, "detach"):
        t = values.detach()
        if t.is_floating_point() and str(t.dtype) not in _NUMPY_FLOATS:
            t = t.double()
        return np.asarray(t.numpy())
    return np.asarray(values)


_NUMPY_FLOATS = ("torch.float16", "torch.float32", "torch.float64")


def check_home(home: Any, sizes: Any, n: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """``home`` as int64 [N] in ``[0, W)`` and ``sizes`` as float64 [N] (default ones)."""
    h = np.asarray(home)
    if h.shape != (n,) or h.dtype.kind not in "iu" or (n and (h.min() < 0 or h.max() >= w)):
        raise ValueError(f"home has shape {h.shape} and dtype {h.dtype}, expected [{n}] ints in [0, {w})")
    if sizes is None:
        s = np.ones(n, np.float64)
    else:
        s = np.asarray(sizes, dtype=np.float64)
        if s.shape != (n,) or not np.isfinite(s).all() or (n and s.min() < 0):
            raise ValueError(f"sizes has shape {s.shape}, expected [{n}] finite values >= 0")
    return h.astype(np.int64), s


def check_sizes(n: int, w: int, min_size: Any, max_size: Any) -> tuple[int, int]:
    """Validate the per-part item-count bounds; returns ``(min_size, max_size)``.

    ``max_size=None`` becomes ``n`` (no bound).

    Raises:
        ValueError: a bound is not an int, ``min_size < 0``, ``max_size < 1``,
            ``min_size > max_size``, or ``n`` items cannot satisfy them.
    """
    for name, val, optional in (("min_size", min_size, False), ("max_size", max_size, True)):
        if (val is None and not optional) or (
                val is not None and (isinstance(val, bool) or not isinstance(val, (int, np.integer)))):
            raise ValueError(f"{name}={val!r}, expected an int")
    lo = int(min_size)
    hi = n if max_size is None else int(max_size)
    if lo < 0:
        raise ValueError(f"min_size={lo}, expected >= 0")
    if max_size is not None and hi < 1:
        raise ValueError(f"max_size={hi}, expected >= 1")
    if lo > hi and max_size is not None:
        raise ValueError(f"min_size={lo} > max_size={hi}")
    if w * lo > n:
        raise ValueError(f"{n} items cannot give {w} parts min_size={lo} each (needs {w * lo})")
    if max_size is not None and w * hi < n:
        raise ValueError(f"{n} items do not fit in {w} parts of max_size={hi} (holds {w * hi})")
    return lo, max(hi, lo)
