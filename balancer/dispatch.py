"""Single-controller dispatch: split a global batch across data-parallel ranks.

RL trainers (verl) and speculative-decoding trainers (torchspec) hold the whole
global batch in one controller process and hand every rank its share. This
module plans that split on the host (numpy only, no device tensor, no
collective: safe from a controller or a data-loader thread). Every rank
running the same call on the same lengths gets the same plan.

1. units: samples, or groups that stay together (GRPO: one prompt's ``n``
   responses);
2. ranks: equal counts (:func:`~balancer.partition.balanced_partition`) or,
   in token-budget mode (``equal_count=False``), any counts
   (:func:`~balancer.partition.free_partition`), so a rank that draws one huge
   sample draws few others;
3. micro-batches (optional): the same ``k`` on every rank, each rank's share
   cut by :func:`~balancer.microbatch.plan_micro_batches`' planner;
   with ``padded=True`` the global batch is cut first into length-homogeneous
   micro-batches and those are dealt, ``k`` per rank, to balance the summed
   padded cost.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from balancer._limits import DISPATCH_TOTAL
from balancer._llm_units import (
    Units,
    as_lengths,
    check_fits,
    check_flag,
    check_positive,
    make_units,
)
from balancer._microbatch_pack import (
    bins_bound,
    first_fit_padded,
    kk_labels,
    max_ends,
    min_segments,
    pack_padded_groups,
    segment_padded,
)
from balancer.microbatch import (
    MicroBatchPlan,
    _cut_at,
    _finish,
    _grouped,
    _local_k,
    _plan_k,
    _with_empty,
)
from balancer.partition import balanced_partition, lower_bound
from balancer.partition._bound import bound_sorted
from balancer.partition._free import free_assign, labels_to_lists

__all__ = ["DispatchPlan", "plan_dispatch"]

_WHERE = "controller"


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchPlan:
    """Per-rank shares of a global batch. Arrays are ``[W]``."""

    ranks: list[list[int]]
    """``W`` ascending lists of global sample indices: rank ``r``'s share."""
    micro_batches: list[list[list[int]]] | None
    """Per rank, its micro-batches (global indices, heaviest first), or ``None``."""
    num_micro_batches: int
    """Micro-batches per rank (the same everywhere; 0 when not cut)."""
    loads: np.ndarray
    """Cost per rank (padded: summed padded micro-batch costs)."""
    tokens: np.ndarray
    """Real tokens per rank."""
    padded_tokens: np.ndarray
    """Tokens after padding each micro-batch (or the whole share) to its longest."""
    bound: float
    """Lower bound on the largest load for this split's rules (padded: given its micro-batches)."""
    loads_before: np.ndarray
    """Loads of contiguous equal-count chunks in input order, cut the same way (no planning)."""
    padded_tokens_before: np.ndarray
    """Padded tokens of those chunks."""

    def metrics(self, prefix: str = "dispatch/") -> dict[str, float]:
        """verl-style scalars for a logger: loads, imbalance, padding, counts."""
        mean = float(self.loads.mean())
        top, top_before = float(self.loads.max()), float(self.loads_before.max())
        real = int(self.tokens.sum())
        counts = [len(r) for r in self.ranks]
        out = {
            "load_min": float(self.loads.min()), "load_max": top, "load_mean": mean,
            "imbalance": top / mean if mean > 0 else 1.0,
            "max_over_bound": top / self.bound if self.bound > 0 else 1.0,
            "load_max_before": top_before,
            "imbalance_before": top_before / float(self.loads_before.mean()) if mean > 0 else 1.0,
            "speedup": top_before / top if top > 0 else 1.0,
            "tokens_min": float(self.tokens.min()), "tokens_max": float(self.tokens.max()),
            "samples_min": float(min(counts)), "samples_max": float(max(counts)),
            # 1.0 (no padding) with no real token, as MicroBatchPlan.padding_ratio
            "padding_ratio": float(self.padded_tokens.sum()) / real if real else 1.0,
            "padding_ratio_before": float(self.padded_tokens_before.sum()) / real if real else 1.0,
            "num_micro_batches": float(self.num_micro_batches),
        }
        return {prefix + k: v for k, v in out.items()}


def _sub(un: Units, idx: np.ndarray) -> Units:
    """The units ``idx`` of ``un``, members still global sample indices."""
    members = [un.members[i] for i in idx.tolist()]
    return Units(members, un.tokens[idx], un.rows[idx], un.head[idx], un.cost[idx],
                  un.head_cost[idx], un.sample_cost[np.concatenate(members)])


def _scaled(x: np.ndarray) -> np.ndarray:
    total = float(x.sum(dtype=np.float64))  # an int64 sum of large costs would wrap
    if x.dtype.kind == "i" and total < DISPATCH_TOTAL:
        return x
    return x.astype(np.float64) * (DISPATCH_TOTAL / total if total > DISPATCH_TOTAL else 1.0)


def _contiguous(u: int, w: int) -> list[np.ndarray]:
    edges = np.arange(w + 1) * u // w
    return [np.arange(edges[r], edges[r + 1]) for r in range(w)]


def _equal_split(x: np.ndarray, w: int) -> list[np.ndarray]:
    """Equal counts: the library partitioner, or equal-size Karmarkar-Karp if that is better.

    KK is what verl uses; taking the better of the two means the split is
    never worse than verl's on the same workloads (KK is cheap next to it).
    """
    parts = [np.asarray(p, np.int64) for p in balanced_partition(x, w)]
    labels = kk_labels(x, w, equal=True)
    kk = [np.flatnonzero(labels == r) for r in range(w)]
    if max(x[p].sum() for p in kk) < max(x[p].sum() for p in parts):
        return kk
    return parts


def _rank_plan(un: Units, parts: list[np.ndarray], k: int, cap: int | None,
               known: list[dict[int, Any]]) -> list[MicroBatchPlan]:
    """Each share cut into ``k`` micro-batches: a cut found while choosing ``k``, a
    packing at ``k``, or the share's own fewer split up (``_cut_at``); a share with
    fewer units than ``k``, one unit a micro-batch and empty ones for the rest."""
    plans = []
    for idx, cuts in zip(parts, known, strict=True):
        sub = _sub(un, idx)
        mine = min(k, idx.size)
        cut = _cut_at(sub, mine, cap, None, False, cuts)
        # A share with >= k units has a cut into at most k (its own k, or k dealt);
        # one with fewer is cut one unit each (every unit fits the budget).
        assert cut is not None, "a share's cut into fewer splits up to k"
        plans.append(_with_empty(_finish(sub, cut, mine, False, k, k, cap), k))
    return plans


def _padded_before(un: Units, parts: list[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Loads and padded tokens of input-order chunks: ``k`` per rank (1 when ``k == 0``)."""
    loads, ptok = [], []
    for idx in parts:
        chunks = [c for c in np.array_split(idx, max(k, 1)) if c.size]
        loads.append(sum(float(un.rows[c].sum() * un.head_cost[c].max()) for c in chunks))
        ptok.append(sum(int(un.rows[c].sum() * un.head[c].max()) for c in chunks))
    return np.array(loads), np.array(ptok, np.int64)


def _deal_micro_batches(un: Units, x: np.ndarray, w: int, cap: int | None, num: int | None, lo: int,
                        div: int) -> tuple[int, list[np.ndarray], list[Any]] | None:
    """Unequal shares when splitting by cost first leaves a rank too few units
    for the micro-batches another needs: pack the whole batch into ``w k``
    micro-batches under the budget (the fewest ``k`` that packs), then deal
    them ``k`` a rank, balancing their costs. ``None`` if no ``k`` packs.

    E.g. lengths ``[7, 4, 7, 5, 10]`` on 2 ranks under 10 tokens, cost
    ``L^2``: by cost the 10 goes alone and the rest needs 3 micro-batches,
    which one sample cannot fill; dealt, 2 micro-batches a rank.
    """
    u = un.tokens.size
    if num is not None:
        k = num
    else:
        k = max(lo, -(-bins_bound(un.tokens, cap) // w) if cap is not None else 1)
        k = -(-k // div) * div
    while w * k <= u:
        cut = _plan_k(un, w * k, cap, None, False)
        if cut is not None:
            mb_cost = np.bincount(cut, weights=x.astype(np.float64), minlength=w * k)
            parts, cuts = [], []
            for bins in balanced_partition(mb_cost, w):
                local = np.full(w * k, -1, np.int64)
                local[np.asarray(bins, np.int64)] = np.arange(k)
                idx = np.flatnonzero(local[cut] >= 0)
                parts.append(idx)
                cuts.append(local[cut[idx]])
            return k, parts, cuts
        if num is not None:
            return None
        k += div
    return None


def plan_dispatch(
    lengths: Any,
    world_size: int,
    *,
    cost: Any = None,
    equal_count: bool = True,
    max_tokens: int | None = None,
    num_micro_batches: int | None = None,
    min_micro_batches: int = 1,
    divisible_by: int = 1,
    micro_batch_size: int | None = None,
    groups: Any = None,
    padded: bool = False,
) -> DispatchPlan:
    """Split a global batch across ``world_size`` ranks, optionally into micro-batches.

    Example: lengths ``[900, 10, 20, 30, 40, 50, 60, 70]`` on 2 ranks: equal
    counts give ``[[0, 1, 2, 3], [4, 5, 6, 7]]``-sized shares whose largest
    holds 960 tokens; ``equal_count=False`` gives ``[[0], [1, ..., 7]]``
    (900 and 280 tokens: the huge sample alone, the bound).

    Args:
        lengths: [N] token counts of the global batch, integers >= 0
            summing below ``2**53`` (any per-sample workload in that range
            works when ``cost`` is ``None`` and no budget or padding is
            involved; larger workloads go in ``cost``).
        world_size: W, ranks to dispatch to.
        cost: per-sample cost, as for
            :func:`~balancer.microbatch.plan_micro_batches` (default: tokens).
        equal_count: every rank gets the same number of units (samples or
            groups; N must be divisible by W); ``False``: any number >= 1
            (with micro-batches: the split by cost, or, when that leaves a
            rank too few units for the micro-batches another needs, the
            whole batch packed into ``W k`` micro-batches dealt ``k`` a rank).
            With ``padded`` every rank gets the same number of micro-batches
            instead (of any size, so N need not be divisible by W).
        max_tokens, num_micro_batches, min_micro_batches, divisible_by,
            micro_batch_size: cut every share into the same number of
            micro-batches (given, or the fewest under ``max_tokens`` over all
            ranks); see :func:`~balancer.microbatch.plan_micro_batches`.
            Without ``max_tokens``, ``num_micro_batches`` and
            ``micro_batch_size`` no micro-batches are planned.
        groups: optional [N] int ids of samples that stay on one rank and in
            one micro-batch.
        padded: micro-batches are padded to their longest sample; the global
            batch is cut into ``W k`` length-homogeneous micro-batches dealt
            ``k`` per rank (equal micro-batch counts, so ``equal_count`` must
            stay ``True``).

    Returns:
        A :class:`DispatchPlan`; :meth:`DispatchPlan.metrics` for logging.

    Raises:
        ValueError: as :func:`~balancer.microbatch.plan_micro_batches`; N
            (or the group count) not divisible by ``world_size`` with
            ``equal_count`` (not ``padded``); fewer units than ranks; or ``padded``
            with ``equal_count=False``. (A share with fewer units than ``k`` gets
            one a micro-batch and empty micro-batches for the rest, padded or not.)
    """
    where = _WHERE
    check_positive("world_size", world_size, where)
    for name, val in (("max_tokens", max_tokens), ("num_micro_batches", num_micro_batches),
                      ("micro_batch_size", micro_batch_size)):
        check_positive(name, val, where, allow_none=True)
    check_positive("min_micro_batches", min_micro_batches, where)
    check_positive("divisible_by", divisible_by, where)
    check_flag("equal_count", equal_count, where)
    check_flag("padded", padded, where)
    if padded and not equal_count:
        raise ValueError("padded=True deals whole micro-batches, the same number to every rank; "
                         f"equal_count=False is not supported with it ({where})")
    if micro_batch_size is not None and not padded:
        raise ValueError(f"micro_batch_size={micro_batch_size} bounds the rows of padded "
                         f"micro-batches; pass padded=True or use max_tokens ({where})")
    lens = as_lengths(lengths, where)
    un = make_units(lens, cost, groups, padded, where)
    check_fits(un, max_tokens, micro_batch_size, padded, where)
    u, w = un.tokens.size, world_size
    kind = "samples" if groups is None else "groups"
    if u < w:
        raise ValueError(f"{u} {kind} for {w} ranks: a rank would be empty ({where})")
    if equal_count and u % w and not padded:  # padded: equal micro-batch counts, not units
        raise ValueError(f"{u} {kind} are not divisible by world_size={w} (equal_count=True); "
                         f"pass equal_count=False for unequal shares ({where})")
    cut = max_tokens is not None or num_micro_batches is not None or micro_batch_size is not None
    if padded:
        return _dispatch_padded(un, w, max_tokens, num_micro_batches, min_micro_batches,
                                divisible_by, micro_batch_size, kind, cut)
    x = _scaled(un.cost)
    order_free = equal_count is False
    min_size = 1
    k = 0
    known: list[dict[int, Any]] = []
    for _ in range(4):  # token-budget mode: re-split if a share is too small for k
        if order_free:
            labels = free_assign(x, w, min_size)
            assert labels is not None, "no cap, always placed"
            parts = [np.asarray(p, np.int64) for p in labels_to_lists(labels, w)]
            top = max(x[p].sum() for p in parts)
            if u % w == 0 and min_size <= u // w and top > lower_bound(x, w):
                # Equal counts are one free split: keep them when they are better
                # (they cannot be when the free split is at their lower bound).
                equal = _equal_split(x, w)
                if max(x[p].sum() for p in equal) < top:
                    parts = equal
        else:
            parts = _equal_split(x, w)
        if not cut:
            break
        found = [_local_k(_sub(un, p), max_tokens, None, False, num_micro_batches,
                          min_micro_batches, divisible_by, where, strict=False) for p in parts]
        k = max(f[0] for f in found)
        known = [f[2] for f in found]
        cuts = [f[2].get(k) for f in found]
        fewest = min(p.size for p in parts)
        # A fixed count that one share cannot pack (a share's own tokens need more)
        # may still pack when the shares are dealt from the micro-batches.
        fixed = num_micro_batches is not None and k <= fewest  # else a None cut is packed later, at k
        missing = [i for i, c in enumerate(cuts) if c is None] if fixed else []
        if k <= fewest and not missing:
            break
        if not order_free or w * k > u or missing:
            dealt = _deal_micro_batches(un, x, w, max_tokens, num_micro_batches, min_micro_batches,
                                        divisible_by) if order_free else None
            if dealt is None:
                if missing:  # the share's own reason, raised as a single rank's plan would
                    _local_k(_sub(un, parts[missing[0]]), max_tokens, None, False, num_micro_batches,
                             min_micro_batches, divisible_by, where)
                # The settings ask for more micro-batches than a share has units (or a
                # dispatcher's last round is short): one unit a micro-batch there, the
                # rest empty, as plan_micro_batches gives such a rank (_rank_plan).
                break
            k, parts, cuts = dealt
            known = [{k: c} for c in cuts]
            min_size = k
            break
        min_size = k
    else:
        dealt = _deal_micro_batches(un, x, w, max_tokens, num_micro_batches, min_micro_batches, divisible_by)
        if dealt is None:
            raise ValueError(f"no split gives every rank {k} {kind} ({where})")
        k, parts, cuts = dealt
        known = [{k: c} for c in cuts]
        min_size = k
    loads = np.array([float(un.cost[p].sum()) for p in parts])
    bound = (bound_sorted(np.sort(x), w, equal_size=False, min_size=min_size) if order_free else lower_bound(x, w))
    bound = float(bound) * float(un.cost.sum()) / max(float(x.sum()), 1e-300)
    before = _contiguous(u, w)
    loads_before = np.array([float(un.cost[p].sum()) for p in before])
    if cut:
        plans = _rank_plan(un, parts, k, max_tokens, known)
        ptok = np.array([int(p.padded_tokens.sum()) for p in plans], np.int64)
        mbs = [p.micro_batches for p in plans]
    else:
        ptok = np.array([int(un.rows[p].sum() * un.head[p].max()) for p in parts], np.int64)
        mbs = None
    _, ptok_before = _padded_before(un, before, k)
    return DispatchPlan(
        ranks=[np.sort(np.concatenate([un.members[i] for i in p.tolist()])).tolist() for p in parts],
        micro_batches=mbs, num_micro_batches=k, loads=loads,
        tokens=np.array([int(un.tokens[p].sum()) for p in parts], np.int64), padded_tokens=ptok,
        bound=bound, loads_before=loads_before, padded_tokens_before=ptok_before,
    )


def _deal_singletons(x: np.ndarray, w: int, k: int) -> list[np.ndarray]:
    """``u`` one-unit micro-batches (costs ``x``, ``w <= u < w k``) and ``w k - u`` empty
    ones (indices ``u..``), ``k`` to a rank: the costliest first, each to the rank
    with the least load, then the fewest micro-batches (so every rank gets one),
    then the lowest index; the empty ones fill up the rest."""
    u = x.size
    load, count = [0.0] * w, [0] * w
    parts: list[list[int]] = [[] for _ in range(w)]
    for i in sorted(range(u), key=lambda i: (-float(x[i]), i)):
        r = min((r for r in range(w) if count[r] < k), key=lambda r: (load[r], count[r], r))
        parts[r].append(i)
        load[r] += float(x[i])
        count[r] += 1
    empty = iter(range(u, w * k))
    return [np.array(p + [next(empty) for _ in range(k - len(p))], np.int64) for p in parts]


def _dispatch_padded(un: Units, w: int, cap: int | None, num: int | None, lo: int, div: int,
                     mbs: int | None, kind: str, cut: bool) -> DispatchPlan:
    """Length-homogeneous micro-batches of the whole batch, dealt ``k`` per rank."""
    u = un.tokens.size
    order = np.lexsort((np.arange(u), -un.head))
    ends = max_ends(un.head[order], un.rows[order], cap, mbs)
    grouped = _grouped(un)
    fewest = len(min_segments(ends)) - 1
    if grouped:  # contiguous runs are not always the fewest: first-fit decreasing too
        fewest = min(fewest, len(first_fit_padded(un.head, un.rows, cap, mbs)))
    if num is not None:
        if num % div or num < lo:
            raise ValueError(f"num_micro_batches={num} must be >= min_micro_batches={lo} and a "
                             f"multiple of divisible_by={div} ({_WHERE})")
        k = num
    elif cut:
        k = -(-max(lo, -(-fewest // w)) // div) * div
    else:
        k = 1  # one padded batch per rank
    runs: list[np.ndarray] | None = None
    if w * k > u:
        # More micro-batches than units (the settings ask for them, or a dispatcher's
        # last round is short): one unit a micro-batch, the rest empty, dealt k a rank.
        runs = [order[i:i + 1] for i in range(u)] + [order[:0]] * (w * k - u)
    elif grouped:
        found = pack_padded_groups(un.head, un.rows, un.head_cost, cap, mbs, w * k)
        if found is not None:
            runs = [np.asarray(m, np.int64) for m in found]  # each longest first, as runs are
    else:
        bounds = segment_padded(un.head_cost[order], un.rows[order], ends, w * k)
        if bounds is not None:
            runs = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if runs is None:
        need = "are needed" if not grouped else "were found"
        raise ValueError(f"num_micro_batches={k} per rank cannot hold these {kind} under the budget "
                         f"(max_tokens={cap}, micro_batch_size={mbs}): {fewest} micro-batches {need} "
                         f"in all ({_WHERE})")
    run_cost = np.array([float(un.rows[r].sum() * un.head_cost[r[0]]) if r.size else 0.0 for r in runs])
    x = _scaled(run_cost)
    deal = _equal_split(x, w) if w * k <= u else _deal_singletons(x[:u], w, k)
    bound = float(lower_bound(x, w)) * float(run_cost.sum()) / max(float(x.sum()), 1e-300)
    ranks, micro, loads, ptok, tokens = [], [], [], [], []
    for p in deal:
        mine = [runs[i] for i in p.tolist()]
        # Heaviest first, ties by first sample; empty micro-batches last.
        mine.sort(key=lambda r: (-float(un.rows[r].sum() * un.head_cost[r[0]]), int(r.min())) if r.size
                  else (1.0, 0))
        batches = [np.sort(np.concatenate([un.members[i] for i in r.tolist()])).tolist() if r.size else []
                   for r in mine]
        micro.append(batches)
        ranks.append(sorted(i for b in batches for i in b))
        loads.append(float(run_cost[p].sum()))
        ptok.append(sum(int(un.rows[r].sum() * un.head[r[0]]) for r in mine if r.size))
        tokens.append(sum(int(un.tokens[r].sum()) for r in mine))
    loads_before, ptok_before = _padded_before(un, _contiguous(u, w), k)
    return DispatchPlan(
        ranks=ranks, micro_batches=micro if cut else None, num_micro_batches=k if cut else 0,
        loads=np.array(loads), tokens=np.array(tokens, np.int64), padded_tokens=np.array(ptok, np.int64),
        bound=bound, loads_before=loads_before, padded_tokens_before=ptok_before,
    )
