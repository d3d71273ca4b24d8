"""The background partition task: gathered workloads -> the destination rank of every sample.

Runs in the planner process (or the shuffler's background thread), numpy only:

* :func:`partition` -- the partition (child process, thread or a custom
  function), locality refinement and the never-worse guard, on scale-free
  integer workloads (:mod:`balancer._quantize`);
* :func:`partition_free` -- the same with parts of free size up to a capacity;
* :func:`validate_partition` and :func:`destinations` -- a partition function's
  result checked and turned into ``dest[g]``, what :mod:`balancer._plan` plans from.

Deterministic in its arguments: every rank computes the same destinations.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import numpy as np

from balancer._plan import Gathered, real_mask
from balancer._plan_layout import PlanLayout, sample_bytes
from balancer._quantize import quantize
from balancer.partition._balanced import solve_rows
from balancer.partition._bound import bound_sorted
from balancer.partition._free import free_assign
from balancer.partition._worker import PartitionWorker

logger = logging.getLogger(__name__)

__all__ = ["PartitionFn", "PartitionResult", "destinations", "partition", "partition_free", "validate_partition"]

PartitionFn = Callable[[np.ndarray, int], Sequence[Sequence[int]]]
"""``(workloads [N], num_parts) -> num_parts`` lists of ``N / num_parts`` global
indices; must be deterministic: every rank runs it on identical input. The
shuffler passes scale-free int64 workloads (:func:`balancer._quantize.quantize`)."""


def validate_partition(parts: Any, num_parts: int, batch_size: int) -> np.ndarray:
    """Check that ``parts`` splits ``range(num_parts * batch_size)`` into
    ``num_parts`` parts of exactly ``batch_size`` indices.

    Returns:
        The parts as an int64 array ``[num_parts, batch_size]``.

    Raises:
        ValueError: naming the offending part and the expectation.
    """
    n = num_parts * batch_size
    if len(parts) != num_parts:
        raise ValueError(f"partition returned {len(parts)} parts, expected num_parts={num_parts}")
    out = []
    for r, part in enumerate(parts):
        raw = np.asarray(part)
        if raw.size and raw.dtype.kind not in "iu":
            # Casting would truncate 0.5 to 0 and read True as 1: a wrong partition
            # that still looks like a permutation.
            raise ValueError(f"partition part {r} has dtype {raw.dtype}, expected integer sample indices")
        out.append(raw.astype(np.int64).reshape(-1))
    for r, p in enumerate(out):
        if p.size != batch_size:
            raise ValueError(f"partition part {r} has {p.size} indices, expected batch_size={batch_size}")
    flat = np.concatenate(out) if out else np.empty(0, np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= n):
        raise ValueError(f"partition indices span [{flat.min()}, {flat.max()}], expected [0, {n})")
    if np.bincount(flat, minlength=n).max(initial=1) != 1:
        raise ValueError(f"partition is not a permutation of range({n}): an index repeats")
    return flat.reshape(num_parts, batch_size)


def destinations(parts: np.ndarray, n: int) -> np.ndarray:
    """``dest[g]``: the rank that gets global sample ``g`` (``parts[r]`` goes to rank r)."""
    dest = np.empty(n, dtype=np.int64)
    for r, p in enumerate(parts):
        dest[p] = r
    return dest


def _max_load(rows: np.ndarray, q: np.ndarray) -> int:
    return int(q[rows].sum(axis=1).max(initial=0)) if rows.size else 0


@dataclasses.dataclass(frozen=True)
class PartitionResult:
    """Destinations of one shuffle and how they were found (host data only)."""

    dest: np.ndarray  # [W * B] destination rank per global sample
    lower_bound: float  # in workload units
    seconds: float  # partition compute time (child or thread), not waiting
    token_cap: float | None = None  # the cap on tokens per rank the partition honoured, if any


def partition(g: Gathered, layout: PlanLayout, *, fn: PartitionFn | None, worker: PartitionWorker | None,
              locality: bool, localize: Callable[..., Any], lower_bound: Callable[..., float],
              capacity: int | None = None, tokens: np.ndarray | None = None,
              token_cap: float | None = None) -> PartitionResult:
    """Partition the gathered workloads into W parts of B (background thread).

    ``worker`` (the torch-free child) runs ``balanced_partition`` (+ locality)
    when given; if it died, the same :func:`balancer.partition._balanced.solve_rows`
    runs here, giving the rows every other rank's child gives. Otherwise ``fn``
    runs here, then ``localize``. The result is never worse than not moving.

    With ``capacity`` the parts are free in size, up to ``capacity`` real
    samples each (:func:`balancer.partition.free_partition`); see
    :func:`partition_free`.

    With ``token_cap`` (and ``balanced_partition``): no rank receives more
    than ``token_cap`` times the mean of ``tokens`` ([W * B] per sample, 0
    for padding), or the proven minimum any partition reaches if that is
    higher; compute is balanced under the cap. If the search cannot meet the
    cap, compute alone is balanced (``PartitionResult.token_cap`` is then
    ``None``): the same on every rank, since the inputs are.
    """
    if capacity is not None:
        return partition_free(g, layout, capacity, locality)
    w, b = g.world_size, g.batch_size
    x = g.workloads
    home = np.arange(x.size, dtype=np.int64) // b if locality else None
    sizes = sample_bytes(layout, g.lengths).astype(np.float64) if locality else None
    q = quantize(x)
    if fn is None and token_cap is not None and tokens is not None and w > 1:
        capped = _capped(x, q, w, b, home, sizes, np.asarray(tokens, np.int64), token_cap, lower_bound)
        if capped is not None:
            return capped
    if fn is None:
        rows = None
        if worker is not None:
            try:
                pending = worker.submit(x, w, home, sizes, quantized=True)
                rows, seconds, bound = pending.wait_rows(), pending.seconds, pending.lower_bound
            except (EOFError, OSError):  # the child is gone: same computation here
                rows = None
        if rows is None:
            rows, seconds, bound = solve_rows(x, w, home, sizes, quantized=True)
        rows = validate_partition(rows, w, b)
    else:
        t0 = perf_counter()
        rows = validate_partition(fn(q, w), w, b)
        if locality:
            moved = validate_partition(localize(rows.tolist(), q, home, sizes), w, b)
            rows = moved if _max_load(moved, q) <= _max_load(rows, q) else rows
        seconds = perf_counter() - t0
        top = float(x.max(initial=0.0))
        bound = float(lower_bound(x / top, w)) * top if top > 0 else 0.0
    return _guarded(rows, q, w, b, bound, seconds, None)


def _capped(x: np.ndarray, q: np.ndarray, w: int, b: int, home: np.ndarray | None, sizes: np.ndarray | None,
            tokens: np.ndarray, token_cap: float, lower_bound: Callable[..., float]) -> PartitionResult | None:
    """``balanced_partition`` under the token cap, or ``None`` if the search cannot meet it."""
    cap = max(token_cap * float(tokens.sum()) / w, float(lower_bound(tokens, w)))
    try:
        rows, seconds, bound = solve_rows(x, w, home, sizes, quantized=True, tokens=tokens, max_tokens=cap)
    except ValueError as e:  # raised only for a cap the search did not meet
        logger.debug("balancer: token cap %.6g not met (%s); balancing compute alone", cap, e)
        return None
    return _guarded(validate_partition(rows, w, b), q, w, b, bound, seconds, cap)


def _guarded(rows: np.ndarray, q: np.ndarray, w: int, b: int, bound: float, seconds: float,
             cap: float | None) -> PartitionResult:
    """The result, never worse in compute than staying (then without a cap)."""
    if _max_load(rows, q) > _max_load(np.arange(w * b).reshape(w, b), q):
        rows, cap = np.arange(w * b, dtype=np.int64).reshape(w, b), None  # never worse than staying
    return PartitionResult(destinations(rows, w * b), bound, seconds, cap)


def partition_free(g: Gathered, layout: PlanLayout, capacity: int, locality: bool) -> PartitionResult:
    """Real samples into W parts of at most ``capacity`` each, smallest max load.

    Padding samples stay home (they are never sent). With ``locality`` whole
    parts go to the ranks that already hold most of their bytes (greedy on the
    W x W overlap); items are not traded. Never worse than equal counts
    (``balanced_partition`` is tried too), nor than not moving.
    """
    w, b = g.world_size, g.batch_size
    idx = np.flatnonzero(real_mask(g.real, b))
    home = idx // b
    dest = np.arange(w * b, dtype=np.int64) // b
    x = g.workloads[idx]
    q = quantize(x)
    t0 = perf_counter()
    labels = free_assign(q, w, 0, capacity) if idx.size else np.zeros(0, np.int64)
    if labels is None:  # the greedy could not place every item under the cap: stay
        labels = home.copy()
    labels = np.asarray(labels, np.int64)
    sizes = sample_bytes(layout, g.lengths).astype(np.float64)
    if locality and idx.size:
        labels = _assign_parts(labels, home, sizes[idx], w)
    # Equal counts are one answer the free problem allows: keep whichever of
    # the two has the smaller max load (the free heuristic is not always better).
    rows, _, _ = solve_rows(g.workloads, w, dest if locality else None, sizes if locality else None, quantized=True)
    equal = destinations(rows, w * b)[idx]
    load = lambda lab: np.bincount(lab, weights=q, minlength=w).max(initial=0)  # noqa: E731
    if load(equal) < load(labels):
        labels = equal
    if load(labels) > load(home):
        labels = home  # never worse than staying
    dest[idx] = labels
    seconds = perf_counter() - t0
    top = float(x.max(initial=0.0))
    bound = float(bound_sorted(np.sort(x / top), w, equal_size=False, max_size=capacity)) * top if top > 0 else 0.0
    return PartitionResult(dest, bound * (1 - 8 * x.size * np.finfo(np.float64).eps), seconds)


def _assign_parts(labels: np.ndarray, home: np.ndarray, sizes: np.ndarray, w: int) -> np.ndarray:
    """Relabel parts so each goes to the rank holding most of its bytes (greedy, deterministic)."""
    overlap = np.zeros((w, w))
    np.add.at(overlap, (labels, home), sizes)
    to_rank = np.full(w, -1, np.int64)
    taken = np.zeros(w, bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        p, r = divmod(int(flat), w)
        if to_rank[p] < 0 and not taken[r]:
            to_rank[p], taken[r] = r, True
    return to_rank[labels]
