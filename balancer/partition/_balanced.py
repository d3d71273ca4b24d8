"""The library's partitioner, :func:`balanced_partition`: ``W`` parts of exactly ``B`` items.

Validation, the pipeline of :func:`balancer.partition._solve.solve`, the
optional token cap (:mod:`balancer.partition._tokens`) and locality
(:mod:`balancer.partition._locality`), as lists (:func:`balanced_partition`)
or as an int64 array ``[W, B]`` (:func:`localized_rows`, :func:`partition_rows`:
building ``W`` Python lists costs more than the partition at scale), and
:func:`solve_rows`, the shuffler's call: rows, compute seconds and the bound.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from balancer._quantize import quantize
from balancer.partition._bound import bound_ordered
from balancer.partition._locality import assign_parts, localize_rows
from balancer.partition._solve import solve
from balancer.partition._tokens import apply_token_cap, check_tokens_met, token_cap
from balancer.partition._validate import as_workloads, check_home

__all__ = ["balanced_partition", "localized_rows", "partition_rows", "solve_rows"]


def balanced_partition(workloads: Any, num_parts: int, home: Any = None, sizes: Any = None, *,
                       rtol: float = 1e-5, deadline_ms: float | None = None, tokens: Any = None,
                       max_tokens: float | None = None) -> list[list[int]]:
    """The library's partitioner: a cardinality-aware greedy start, then swap refinement.

    Example: workloads ``[9, 1, 8, 2, 7, 3]`` into 2 parts of 3 gives
    ``[[0, 3, 5], [1, 2, 4]]`` with loads 14 and 16 (contiguous chunks: 18
    and 12). 16 is optimal: one part holds two of the three largest (9, 8, 7),
    so at least ``8 + 7`` plus the smallest item ``1`` -- the pigeonhole term
    of :func:`lower_bound`.

    The work done is a deterministic function of ``(workloads, num_parts)``:
    refinement stops at ``rtol`` or when a budget of swap steps derived from
    ``N`` and ``W`` is spent, so every rank computes the same partition.

    Args:
        workloads: [N] non-negative workloads (int or float; list, ndarray or
            CPU tensor), ``N = num_parts * B``.
        num_parts: W, the number of parts (ranks).
        home: optional [N] rank each sample lives on; when given the result is
            passed through :func:`localize` (part ``r`` goes to rank ``r``).
        sizes: optional [N] bytes per sample for :func:`localize`.
        rtol: stop refining once the max load is within ``rtol`` of
            :func:`lower_bound` (0 refines until no swap helps or the budget
            is spent).
        deadline_ms: optional safety net: stop refining after this many
            milliseconds and return the best partition so far (the greedy
            start always completes, and no swap raises the max; with
            ``tokens`` the repair to ``max_tokens`` completes too). Ranks running
            at different speeds can then stop at different swaps and return
            *different* partitions, which breaks the shuffler's assumption that
            every rank computes the same one; leave it ``None`` there.
        tokens: optional [N] second per-sample quantity with a hard per-part
            cap, e.g. tokens (activation memory) while ``workloads`` is
            compute. Every part ends with at most ``max_tokens`` of it; the
            max compute load stays within ``rtol`` of :func:`lower_bound`
            whenever the cap leaves room (see ``docs/benchmarks_partition.md``).
        max_tokens: the cap on ``tokens`` per part; default
            ``1.01 * sum(tokens) / num_parts``.

    Returns:
        ``W`` lists of exactly ``B`` sample indices each (each ascending);
        every index appears once.

    Raises:
        TypeError: ``num_parts`` is not an int.
        ValueError: ``num_parts < 1``; ``workloads`` not 1-D, its length not
            divisible by ``num_parts``, negative, NaN/inf, non-numeric, or
            summing to 2**61 or more; ``rtol`` negative or not finite;
            ``deadline_ms <= 0``; ``tokens`` malformed (as ``workloads``);
            ``max_tokens`` not a finite number >= 0, below what any
            partition can meet, or not met by the search (the message names
            the cap, the proven minimum and the best found: a cap between
            the two may be reachable; up to 12 items every partition is
            tried, and none meets it). Integer tokens are compared exactly,
            float tokens by each part's correctly rounded sum.
    """
    out: list[list[int]] = localized_rows(workloads, num_parts, home, sizes, rtol=rtol, deadline_ms=deadline_ms,
                                          tokens=tokens, max_tokens=max_tokens).tolist()
    return out


def localized_rows(workloads: Any, num_parts: int, home: Any = None, sizes: Any = None, *, rtol: float = 1e-5,
                   deadline_ms: float | None = None, tokens: Any = None,
                    max_tokens: float | None = None) -> np.ndarray:
    """:func:`balanced_partition` as an int64 array ``[W, B]`` (the planner keeps arrays)."""
    return _localized(workloads, num_parts, home, sizes, rtol=rtol, deadline_ms=deadline_ms, tokens=tokens,
                      max_tokens=max_tokens)[0]


def _localized(workloads: Any, num_parts: int, home: Any = None, sizes: Any = None, *, rtol: float = 1e-5,
               deadline_ms: float | None = None, tokens: Any = None,
               max_tokens: float | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`localized_rows` and the ascending order of the workloads the partition sorted
    (``None`` where it sorted none)."""
    if home is None and sizes is not None:  # once ignored without a word
        raise ValueError("sizes (bytes per sample) weigh what localize moves; pass home (each "
                         "sample's current part) with them")
    rows, order = _partition(workloads, num_parts, rtol=rtol, deadline_ms=deadline_ms,
                             tokens=tokens, max_tokens=max_tokens)
    if home is not None:
        x = as_workloads(workloads, num_parts)
        h, s = check_home(home, sizes, x.size, num_parts)
        local = localize_rows(x, rows, h, s)
        if tokens is not None:
            # localize trades items by compute alone; keep its result only if
            # the token cap still holds, else just assign whole parts to ranks.
            t = as_workloads(tokens, num_parts, "tokens")
            if t[local].sum(axis=1).max() > token_cap(t, num_parts, max_tokens):
                local = rows[np.argsort(assign_parts(rows, h, s), kind="stable")]
        rows = local
    return rows, order


@contextlib.contextmanager
def _cap_shown(t: np.ndarray, w: int, max_tokens: float | None) -> Iterator[None]:
    """Errors about the cap name it in whole tokens (``max_tokens=4`` for 4.9): add the
    value the caller passed where the two differ."""
    try:
        yield
    except ValueError as e:
        if max_tokens is not None and e.args and isinstance(e.args[0], str):
            cap = token_cap(t, w, max_tokens)
            if cap != max_tokens:
                e.args = (f"{e.args[0]} (the max_tokens={max_tokens!r} passed, in whole tokens)", *e.args[1:])
        raise


def partition_rows(workloads: Any, num_parts: int, *, rtol: float = 1e-5,
                   deadline_ms: float | None = None, tokens: Any = None,
                   max_tokens: float | None = None) -> np.ndarray:
    """:func:`balanced_partition` without ``home``, as an int64 array [W, B] (rows ascending).

    Building ``W`` Python lists costs ~10 ms at N = 262,144 (more than the
    partition itself); callers that want an array (the partition child) can
    skip it here.
    """
    return _partition(workloads, num_parts, rtol=rtol, deadline_ms=deadline_ms, tokens=tokens,
                      max_tokens=max_tokens)[0]


def _partition(workloads: Any, num_parts: int, *, rtol: float = 1e-5, deadline_ms: float | None = None,
               tokens: Any = None, max_tokens: float | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`partition_rows` and the ascending order of the workloads (``None`` where none
    was sorted)."""
    x = as_workloads(workloads, num_parts)
    if not (isinstance(rtol, (int, float)) and 0 <= rtol < float("inf")):
        raise ValueError(f"rtol={rtol!r}, expected a finite number >= 0")
    if deadline_ms is not None and (isinstance(deadline_ms, (bool, np.bool_))
                                    or not isinstance(deadline_ms, (int, float, np.integer, np.floating))
                                    or not deadline_ms > 0):  # True passed as 1 ms, "5" raised TypeError
        raise ValueError(f"deadline_ms={deadline_ms!r}, expected a number > 0 or None")
    start = time.perf_counter()
    n, w = x.size, num_parts
    b = n // w
    t = None if tokens is None else as_workloads(tokens, num_parts, "tokens")
    if t is not None and t.size != n:
        raise ValueError(f"tokens has {t.size} entries, expected {n} (one per workload)")
    if t is None and max_tokens is not None:  # once ignored without a word
        raise ValueError(f"max_tokens={max_tokens!r} caps the tokens per part; pass tokens (one count "
                         "per workload) with it")
    if b <= 1 or w == 1:
        rows = np.arange(n, dtype=np.int64).reshape(w, b)
        if t is not None:
            with _cap_shown(t, w, max_tokens):
                check_tokens_met(t, rows, token_cap(t, w, max_tokens), w, None)
        return rows, None
    stop_at = None if deadline_ms is None else start + deadline_ms / 1e3
    sol = solve(x, w, rtol, stop_at)
    if t is not None:
        with _cap_shown(t, w, max_tokens):
            sol.rows = apply_token_cap(sol, t, w, rtol, max_tokens, stop_at)
    _check_every_item_once(sol.rows, n)
    return _ascending_rows(sol.order, sol.rows), sol.order


# Up to this many parts the rows are ordered through a stable argsort of each
# item's part (uint8: numpy's one-pass radix sort) instead of sorting every row.
# Side by side on random rows at N = 262,144 (ms, row sorts against the
# labels): 2x131072 14.8 / 4.9, 16x16384 8.6 / 1.9, 64x4096 6.8 / 2.7,
# 256x1024 5.1 / 2.8; from 1024x256 on the row sorts are faster (3.4 / 5.1).
_LABEL_SORT_MAX_PARTS = 256


def _ascending_rows(order: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``np.sort(order[rows], axis=1)``: the original indices of each part, ascending."""
    w, b = rows.shape
    if b == 2:  # two a part: no sort at all (elementwise: a reduction over rows of 2 is slow)
        first, second = order[rows[:, 0]], order[rows[:, 1]]
        out2 = np.empty((w, 2), np.int64)
        np.minimum(first, second, out=out2[:, 0])
        np.maximum(first, second, out=out2[:, 1])
        return out2
    if w > _LABEL_SORT_MAX_PARTS:
        return np.sort(order[rows], axis=1)
    part = np.empty(w * b, np.uint8)
    part[order[rows]] = np.arange(w, dtype=np.uint8)[:, None]
    # Stable: within one part the indices come out ascending.
    out: np.ndarray = np.argsort(part, kind="stable").reshape(w, b)
    return out


def _check_every_item_once(rows: np.ndarray, n: int) -> None:
    """Raise ``RuntimeError`` unless ``rows`` holds each of ``0..n-1`` exactly once.

    The search is built to keep this; the check (~0.5 ms at N = 262,144) makes
    sure that a fault in it can never lose or duplicate a sample silently.
    """
    flat = rows.ravel()
    if flat.size == n and (n == 0 or (flat.min() >= 0 and flat.max() < n)):
        seen = np.zeros(n, bool)
        seen[flat] = True
        if seen.all():  # n positions, all of them seen: each once
            return
    counts = np.bincount(flat[(flat >= 0) & (flat < n)], minlength=n)
    wrong = np.flatnonzero(counts != 1)
    raise RuntimeError(f"internal error: the partition holds {flat.size} items for {n} positions, "
                       f"{wrong.size} of them not exactly once (first {wrong[:5].tolist()}); "
                       "please report the workloads that caused it")


def solve_rows(workloads: np.ndarray, num_parts: int, home: np.ndarray | None = None,
               sizes: np.ndarray | None = None, quantized: bool = False, tokens: np.ndarray | None = None,
               max_tokens: float | None = None) -> tuple[np.ndarray, float, float]:
    """``balanced_partition`` (+ ``localize`` with ``home``) as ``[num_parts, B]``
    int64 rows, its compute seconds, and ``lower_bound`` of ``workloads``.

    With ``quantized`` the partition runs on :func:`balancer._quantize.quantize`
    of the workloads. The partition child process and the shuffler's
    in-process fallback both call this, so they return the same rows.
    ``tokens`` / ``max_tokens``: the token cap of :func:`balanced_partition`.
    """
    t0 = time.perf_counter()
    x = quantize(workloads) if quantized else workloads
    rows, order = _localized(x, num_parts, home, sizes, tokens=tokens, max_tokens=max_tokens)
    rows = np.asarray(rows, dtype="<i8")
    seconds = time.perf_counter() - t0
    if not quantized:
        return rows.reshape(num_parts, -1), seconds, bound_ordered(workloads, num_parts, order)
    # The bound is homogeneous; computing it on x / max keeps any scale (even
    # costs whose sum exceeds lower_bound's integer range) in range. The
    # quantized integers rise with the workloads, so their order nearly sorts
    # them too.
    top = float(np.max(workloads, initial=0.0))
    bound = bound_ordered(np.asarray(workloads, np.float64) / top, num_parts, order) * top if top > 0 else 0.0
    return rows.reshape(num_parts, -1), seconds, bound
