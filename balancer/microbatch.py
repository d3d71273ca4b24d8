"""Micro-batches within a rank: cut a rank's samples into ``k`` micro-batches.

LLM trainers accumulate gradients over micro-batches, each bounded by a token
budget (activation memory). This module plans that cut on the host:

1. units: samples, or groups of samples that must stay together (GRPO's ``n``
   responses of one prompt);
2. ``k``: given, or the fewest micro-batches the token budget allows (raised
   to ``min_micro_batches`` and to a multiple of ``divisible_by``), made equal
   on every data-parallel rank with one all-reduce (MAX) of 18 integers;
3. the cut (``balancer/_microbatch_pack.py``): balanced summed cost under a
   hard token cap, or, with ``padded=True``, length-homogeneous micro-batches
   that minimise the rank's padded compute.

The plan touches no device memory: lengths and costs are host arrays, and the
only collective is the agreement on ``k`` (skipped when ``k`` is given).
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from balancer._devices import collective_device
from balancer._llm_units import (
    Units,
    as_lengths,
    check_fits,
    check_flag,
    check_positive,
    is_empty,
    make_units,
)
from balancer._microbatch_pack import (
    bins_bound,
    first_fit_padded,
    max_ends,
    min_segments,
    pack_padded_groups,
    pack_sum,
    segment_padded,
)
from balancer.partition._bound import bound_sorted

logger = logging.getLogger(__name__)

__all__ = ["MicroBatchPlan", "plan_micro_batches"]


@dataclasses.dataclass(frozen=True, eq=False)
class MicroBatchPlan:
    """One rank's micro-batches. Arrays are ``[k]`` unless noted; ``N`` samples in all."""

    micro_batches: list[list[int]]
    """``k`` lists of sample indices, each ascending, heaviest micro-batch first."""
    inverse: np.ndarray
    """[N] int64: where sample ``i`` sits in :attr:`order`; ``cat(outputs)[inverse]``
    puts per-sample outputs back in input order."""
    num_micro_batches: int
    """``k`` (the same on every rank that planned together)."""
    local_min: int
    """The fewest micro-batches this rank's samples were packed into under the
    budget, at least ``min_micro_batches`` and a multiple of ``divisible_by``;
    before the agreement across ranks."""
    token_bound: int
    """No cut fits the budget in fewer: ``ceil(tokens / max_tokens)`` (padded:
    the greedy run count, which is exact when every unit is one sample; with
    groups of several samples, the larger of ``ceil(tokens / max_tokens)`` and
    ``ceil(rows / micro_batch_size)``); 1 without a budget."""
    padded: bool
    """Whether costs are padded (``rows x cost(longest)``) or summed."""
    costs: np.ndarray
    """Cost per micro-batch (float64)."""
    tokens: np.ndarray
    """Real tokens per micro-batch (int64)."""
    padded_tokens: np.ndarray
    """``rows x longest`` per micro-batch (int64): what a padded batch holds."""
    bound: float
    """Lower bound on :attr:`objective` for this ``k``."""
    objective_before: float
    """:attr:`objective` of ``k`` contiguous chunks in input order (no planning)."""
    padded_tokens_before: int
    """Padded tokens of those chunks."""

    @property
    def order(self) -> np.ndarray:
        """[N] int64: the micro-batches concatenated."""
        return np.concatenate([np.asarray(m, dtype=np.int64) for m in self.micro_batches])

    @property
    def objective(self) -> float:
        """The slowest micro-batch (summed costs) or the rank's total (padded costs)."""
        return float(self.costs.sum() if self.padded else self.costs.max())

    @property
    def gap(self) -> float:
        """``objective / bound - 1`` (0 when the bound is 0)."""
        return self.objective / self.bound - 1 if self.bound > 0 else 0.0

    @property
    def padding_ratio(self) -> float:
        """Padded tokens over real tokens (1.0 = no padding; 1.0 when empty)."""
        real = int(self.tokens.sum())
        return int(self.padded_tokens.sum()) / real if real else 1.0

    @property
    def padding_ratio_before(self) -> float:
        """:attr:`padding_ratio` of the input-order chunks."""
        real = int(self.tokens.sum())
        return self.padded_tokens_before / real if real else 1.0


# ------------------------------------------------------------------ helpers
def _rank_of(pg: ProcessGroup | None) -> int:
    return dist.get_rank(pg) if dist.is_available() and dist.is_initialized() else 0


# ------------------------------------------------------------------ planning
def _plan_k(un: Units, k: int, cap: int | None, mbs: int | None, padded: bool) -> Any:
    """The cut at ``k`` (labels [U] or run boundaries), or ``None`` if it does not fit."""
    if padded and _grouped(un):
        found = pack_padded_groups(un.head, un.rows, un.head_cost, cap, mbs, k)
        if found is None:
            return None
        labels = np.empty(un.head.size, np.int64)
        for j, members in enumerate(found):
            labels[members] = j
        return labels
    if padded:
        order = np.lexsort((np.arange(un.head.size), -un.head))
        ends = max_ends(un.head[order], un.rows[order], cap, mbs)
        cuts = segment_padded(un.head_cost[order], un.rows[order], ends, k)
        if cuts is None:
            return None
        labels = np.empty(un.head.size, np.int64)
        labels[order] = np.repeat(np.arange(k), np.diff(cuts))
        return labels
    return pack_sum(un.cost, un.tokens, k, cap)


def _split_up(un: Units, labels: np.ndarray, k: int, padded: bool) -> np.ndarray:
    """A cut into ``k`` micro-batches from a cut into fewer (``labels``, ids ``0..m-1``):
    the costliest micro-batch of two or more units is split in two, until ``k``.

    Splitting keeps every budget (a half holds fewer tokens, rows and padded
    tokens than the whole), so a cut into ``m`` always gives one into any
    ``m < k <= units``; the packing search, a heuristic, can miss those (59
    samples under 88 tokens: it packed 28 micro-batches but not 29). Summed
    costs split by LPT into two halves; padded ones at the length order's
    cheapest point (the two halves' padded costs summed).
    """
    labels = labels.copy()
    m = int(labels.max()) + 1
    while m < k:
        sizes = np.bincount(labels, minlength=m)
        costs: np.ndarray
        if padded:
            head_cost = np.zeros(m)
            np.maximum.at(head_cost, labels, un.head_cost)
            costs = np.bincount(labels, weights=un.rows, minlength=m) * head_cost
        else:
            costs = np.bincount(labels, weights=un.cost.astype(np.float64), minlength=m)
        costs[sizes < 2] = -np.inf
        j = int(np.argmax(costs))
        idx = np.flatnonzero(labels == j)
        if padded:
            idx = idx[np.lexsort((idx, -un.head[idx]))]  # longest first, ties by index
            rows = np.cumsum(un.rows[idx])
            hc = un.head_cost[idx]
            split = rows[:-1] * hc[0] + (rows[-1] - rows[:-1]) * hc[1:]  # first s + 1 units | the rest
            second = idx[int(np.argmin(split)) + 1:]
        else:
            idx = idx[np.lexsort((idx, -un.cost[idx]))]  # costliest first, ties by index
            half = np.zeros(2)
            side = np.empty(idx.size, np.int64)
            for i, c in enumerate(un.cost[idx].astype(np.float64).tolist()):
                side[i] = int(half[1] < half[0])
                half[side[i]] += c
            second = idx[side == 1]
        labels[second] = m
        m += 1
    return labels


def _cut_at(un: Units, k: int, cap: int | None, mbs: int | None, padded: bool,
            known: dict[int, Any]) -> Any:
    """The cut at ``k``: a known one, a packing found at ``k``, or a known cut into fewer
    split up (:func:`_split_up`); ``None`` only when none of those exists."""
    if k in known:
        return known[k]
    cut = _plan_k(un, k, cap, mbs, padded)
    fewer = [m for m in known if m < k and known[m] is not None]
    if cut is None and fewer and k <= un.tokens.size:
        cut = _split_up(un, known[max(fewer)], k, padded)
    return cut


def _grouped(un: Units) -> bool:
    """Whether a unit is a group of several samples (padded runs are then not always optimal)."""
    return bool(un.rows.max(initial=1) > 1)


def _padded_fewest(un: Units, cap: int | None, mbs: int | None) -> tuple[int, int]:
    """``(a lower bound on the padded micro-batch count, the fewest a cut found)``."""
    order = np.lexsort((np.arange(un.head.size), -un.head))
    runs = len(min_segments(max_ends(un.head[order], un.rows[order], cap, mbs))) - 1
    if not _grouped(un):
        return runs, runs  # contiguous runs are optimal: exact
    by_tokens = -(-int(un.tokens.sum()) // cap) if cap else 1
    by_rows = -(-int(un.rows.sum()) // mbs) if mbs else 1
    return max(by_tokens, by_rows), min(runs, len(first_fit_padded(un.head, un.rows, cap, mbs)))


def _local_k(un: Units, cap: int | None, mbs: int | None, padded: bool, num: int | None,
             lo: int, div: int, where: str, strict: bool = True) -> tuple[int, int, dict[int, Any]]:
    """``(k this rank needs, token bound, {k: cut})``; raises if impossible.

    Settings that ask for more micro-batches than units (``num``, ``lo`` or
    ``div`` above the unit count: the end of an uneven epoch) give that ``k``
    with no cut: the caller cuts one unit a micro-batch and adds empty ones.
    ``strict=False`` (a dispatcher that can still re-split) also returns a
    fixed ``num`` that does not pack instead of raising, with no cut.
    """
    u = un.tokens.size
    if padded:
        bound, fewest = _padded_fewest(un, cap, mbs)
    else:
        bound = fewest = -(-int(un.tokens.sum()) // cap) if cap else 1
    units = "samples" if all(m.size == 1 for m in un.members) else "groups"
    if num is not None:
        _check_fixed(num, lo, div, where)
        if num > u:
            return num, bound, {}  # one unit a micro-batch, the rest empty
        probes: dict[int, Any] = {}  # k -> cut or None: each count is packed at most once
        cut = _probe(un, num, cap, mbs, padded, probes)
        if cut is None:
            # The search may miss a packing at ``num`` that the fewest cut, split up, gives.
            few = _fewest(un, cap, mbs, padded, fewest, u, probes)
            if few is not None and few[0] <= num:
                cut = _split_up(un, few[1], num, padded)
        if cut is None:
            if not strict:
                return num, bound, {}
            rows = f", micro_batch_size={mbs}" if padded else ""
            if bound > num:
                raise ValueError(f"num_micro_batches={num} cannot hold these {units} under the budget "
                                 f"(max_tokens={cap}{rows}); at least {bound} are needed ({where})")
            # Packing under a budget is bin packing: the search may miss a tight fit.
            raise ValueError(f"num_micro_batches={num}: no packing of these {units} under the budget "
                             f"(max_tokens={cap}{rows}) was found, though the token count alone "
                             f"allows {bound}; pass more micro-batches or a larger budget ({where})")
        return num, bound, {num: cut}
    if cap is not None and not padded:
        fewest = max(fewest, bins_bound(un.tokens, cap))  # no cut fits in fewer: no probe below it
    first = -(-max(lo, fewest) // div) * div
    probes = {}
    found = _search(un, cap, mbs, padded, first, div, u, probes)
    if found is not None and found[0] > first and (lo > fewest or div > 1):
        # Probes at allowed counts missed: the fewest cut of all, split up to the
        # first allowed count above it, may beat the constrained search's count.
        few = _fewest(un, cap, mbs, padded, fewest, u, probes)
        if few is not None:
            k = -(-max(lo, few[0]) // div) * div
            if k < found[0]:
                found = (k, _split_up(un, few[1], k, padded))
    if found is None:
        # No allowed count up to the unit count packs (one unit each always does):
        # the first allowed count above it, one unit a micro-batch, the rest empty.
        top = u // div * div
        return (top + div if top >= max(lo, fewest) else first), bound, {}
    good, cut = found
    return good, bound, {good: cut}


def _fewest(un: Units, cap: int | None, mbs: int | None, padded: bool, fewest: int,
            u: int, probes: dict[int, Any]) -> tuple[int, Any] | None:
    """The fewest micro-batches the packing finds (no ``min_micro_batches`` or
    ``divisible_by``), with its cut; ``None`` if none up to ``u`` packs."""
    return _search(un, cap, mbs, padded, max(1, fewest), 1, u, probes)


def _probe(un: Units, k: int, cap: int | None, mbs: int | None, padded: bool, probes: dict[int, Any]) -> Any:
    """:func:`_plan_k`, remembered in ``probes`` (a second search reuses the first's)."""
    if k not in probes:
        probes[k] = _plan_k(un, k, cap, mbs, padded)
    return probes[k]


def _search(un: Units, cap: int | None, mbs: int | None, padded: bool, first: int, div: int,
            u: int, probes: dict[int, Any]) -> tuple[int, Any] | None:
    """The fewest multiple of ``div`` from ``first`` up to ``u`` that packs, with its cut,
    or ``None``: probe ``first``, then gallop (div, 2 div, 4 div, ... above it)
    to a count that packs and bisect back. A probe is a whole packing search,
    so stepping by one from a weak bound took minutes at N = 800."""
    fail, k = 0, first
    found: tuple[int, Any] | None = None
    step = div
    while found is None:
        if k > u:
            top = u // div * div  # the most micro-batches with none empty
            if top <= fail or top < first:
                return None
            k = top
        cut = _probe(un, k, cap, mbs, padded, probes)
        if cut is not None:
            found = (k, cut)
        else:
            fail, k, step = k, k + step, 2 * step
    good, cut = found
    while fail and good - fail > div:  # bisect between the last miss and the first fit
        mid = fail + (good - fail) // div // 2 * div
        c = _probe(un, mid, cap, mbs, padded, probes)
        if c is not None:
            good, cut = mid, c
        else:
            fail = mid
    return good, cut


def _agree(k: int, fingerprints: list[int], failed: bool, pg: ProcessGroup | None
           ) -> tuple[int, int, list[int]]:
    """One all-reduce (MAX): ``(max k, a failed rank or -1, indices of the settings that
    differ between ranks)``."""
    rank = dist.get_rank(pg)
    # (on NCCL the group's bound device where it has one: a thread other than the one
    # that set the current device sees device 0)
    msg = torch.tensor([k, rank + 1 if failed else 0, *fingerprints, *(-f for f in fingerprints)],
                       dtype=torch.int64).to(collective_device(pg))
    dist.all_reduce(msg, op=dist.ReduceOp.MAX, group=pg)
    # A few integers, needed on the host to plan: the one device sync of the call.
    top_k, bad, *fps = msg.tolist()
    n = len(fingerprints)
    differ = [i for i in range(n) if fps[i] != -fps[n + i]]
    return top_k, bad - 1, differ


# plan_micro_batches' settings that every rank must pass alike, in _agree's order.
_SETTINGS = ("num_micro_batches", "max_tokens", "min_micro_batches", "divisible_by", "micro_batch_size",
             "padded", "cost", "groups given or not")


def _fingerprint(*settings: Any) -> int:
    # numpy scalars by value (np.int64(100) and np.int64(50) must differ), other
    # objects (cost functions) by type name: their repr holds a per-process address.
    text = repr(tuple(s.item() if isinstance(s, np.generic)
                      else s if dataclasses.is_dataclass(s) or s is None or isinstance(s, (int, float, bool))
                      else type(s).__name__ for s in settings))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _capped_bound(un: Units, k: int, cap: int | None) -> float:
    """A bound that sees the budget: every micro-batch holds >= ``m = T - (k - 1) cap`` tokens.

    The micro-batch holding unit ``i`` covers its other ``m - t_i`` tokens at
    no less than the cheapest tokens cost (units by cost per token, the last
    one fractional), so it costs at least ``c_i + F(m - t_i)``. Matters when
    the budget is nearly full at the fewest micro-batches.
    """
    if cap is None:
        return 0.0
    need = int(un.tokens.sum()) - (k - 1) * cap
    if need <= 0:
        return 0.0
    tok = un.tokens.astype(np.float64)
    cost = un.cost.astype(np.float64)
    # Fillers: units with tokens (one of none fills nothing, whatever it costs: a
    # per-sample overhead counted as cheap tokens put the bound above the plan).
    has = np.flatnonzero(tok > 0)
    density = cost[has] / tok[has]
    order = has[np.argsort(density, kind="stable")]
    cum_t = np.concatenate([[0.0], np.cumsum(tok[order])])
    cum_c = np.concatenate([[0.0], np.cumsum(cost[order])])
    rest = np.maximum(need - tok, 0.0)
    j = np.clip(np.searchsorted(cum_t, rest, side="right") - 1, 0, order.size - 1)
    fill = cum_c[j] + (rest - cum_t[j]) * (cost[order] / tok[order])[j]
    return float((cost + fill).max()) * (1.0 - 1e-12)


def _finish(un: Units, labels: np.ndarray, k: int, padded: bool, local_min: int,
            token_bound: int, cap: int | None) -> MicroBatchPlan:
    """Statistics, heaviest-first order and the inverse permutation of a cut."""
    u = labels.size
    tokens = np.bincount(labels, weights=un.tokens, minlength=k).astype(np.int64)
    rows = np.bincount(labels, weights=un.rows, minlength=k).astype(np.int64)
    head = np.zeros(k, np.int64)
    np.maximum.at(head, labels, un.head)
    costs: np.ndarray
    if padded:
        head_cost = np.zeros(k)
        np.maximum.at(head_cost, labels, un.head_cost)
        costs = rows * head_cost
        bound = float(un.sample_cost.sum())
    else:
        costs = np.bincount(labels, weights=un.cost, minlength=k)
        bound = max(float(bound_sorted(np.sort(un.cost), k, equal_size=False, min_size=1)), _capped_bound(un, k, cap))
    # Input-order chunks of about equal unit counts: what a loader would do.
    chunk = np.repeat(np.arange(k), np.diff(np.arange(k + 1) * u // k))
    b_rows = np.bincount(chunk, weights=un.rows, minlength=k)
    b_head = np.zeros(k, np.int64)
    np.maximum.at(b_head, chunk, un.head)
    if padded:
        b_hc = np.zeros(k)
        np.maximum.at(b_hc, chunk, un.head_cost)
        before = float((b_rows * b_hc).sum())
    else:
        before = float(np.bincount(chunk, weights=un.cost, minlength=k).max())
    groups = [np.sort(np.concatenate([un.members[i] for i in np.flatnonzero(labels == j).tolist()]))
              for j in range(k)]
    first = np.array([g[0] for g in groups])
    rank = np.lexsort((first, -costs))  # heaviest first, ties by first sample
    batches: list[list[int]] = [groups[j].tolist() for j in rank.tolist()]
    order = np.concatenate([np.asarray(b, dtype=np.int64) for b in batches])
    # Positions relative to the units' samples in ascending order (all of
    # range(N) for one rank's plan; a rank's share in a dispatch).
    local = np.searchsorted(np.sort(order), order)
    inverse = np.empty(order.size, np.int64)
    inverse[local] = np.arange(order.size)
    return MicroBatchPlan(
        micro_batches=batches, inverse=inverse, num_micro_batches=k, local_min=local_min,
        token_bound=token_bound, padded=padded, costs=costs[rank].astype(np.float64),
        tokens=tokens[rank], padded_tokens=(rows * head)[rank], bound=bound,
        objective_before=before, padded_tokens_before=int((b_rows * b_head).sum()),
    )


def _no_samples(lengths: Any, cost: Any, groups: Any, where: str) -> bool:
    """Whether ``lengths`` holds no sample (an empty list, array or tensor); then an
    array ``cost`` or ``groups`` must be empty too."""
    if not is_empty(lengths):
        return False
    for name, value in (("cost", cost), ("groups", groups)):
        if value is None or callable(value) or hasattr(value, "of_lengths") or hasattr(value, "coefficients"):
            continue
        got = value.numel() if isinstance(value, torch.Tensor) else np.asarray(value).size
        if got:
            raise ValueError(f"{name} has {got} entries, expected 0 like lengths ({where})")
    return True


def _check_fixed(num: int, lo: int, div: int, where: str) -> None:
    """A fixed ``num_micro_batches`` must respect ``min_micro_batches`` and ``divisible_by``."""
    if num % div or num < lo:
        raise ValueError(f"num_micro_batches={num} must be >= min_micro_batches={lo} and a "
                         f"multiple of divisible_by={div} ({where})")


def _fewest_allowed(num: int | None, lo: int, div: int, where: str) -> int:
    """The ``k`` of a rank with no samples: ``num`` (checked as for any rank), else the
    smallest multiple of ``div`` that is ``>= lo``."""
    if num is None:
        return -(-lo // div) * div
    _check_fixed(num, lo, div, where)
    return num


def _with_empty(plan: MicroBatchPlan, k: int) -> MicroBatchPlan:
    """``plan`` with empty micro-batches appended up to ``k``: a rank with fewer samples
    than the agreed ``k`` still runs the step's ``k`` passes."""
    more = k - plan.num_micro_batches
    if more <= 0:
        return plan
    zeros = np.zeros(more, np.int64)
    return dataclasses.replace(
        plan, micro_batches=plan.micro_batches + [[] for _ in range(more)], num_micro_batches=k,
        costs=np.concatenate([plan.costs, np.zeros(more)]), tokens=np.concatenate([plan.tokens, zeros]),
        padded_tokens=np.concatenate([plan.padded_tokens, zeros]))


def _empty_plan(k: int, local_min: int, padded: bool) -> MicroBatchPlan:
    """``k`` empty micro-batches: the plan of a rank with no samples."""
    none = np.zeros(0, np.int64)
    plan = MicroBatchPlan(micro_batches=[], inverse=none, num_micro_batches=0, local_min=local_min,
                          token_bound=0, padded=padded, costs=np.zeros(0), tokens=none, padded_tokens=none,
                          bound=0.0, objective_before=0.0, padded_tokens_before=0)
    return _with_empty(plan, k)


def plan_micro_batches(
    lengths: Any,
    *,
    max_tokens: int | None = None,
    num_micro_batches: int | None = None,
    min_micro_batches: int = 1,
    divisible_by: int = 1,
    micro_batch_size: int | None = None,
    cost: Any = None,
    groups: Any = None,
    padded: bool = False,
    pg: ProcessGroup | None = None,
    sync: bool = True,
) -> MicroBatchPlan:
    """Cut this rank's samples into micro-batches for gradient accumulation.

    ``k`` is ``num_micro_batches`` when given; otherwise the fewest
    micro-batches under ``max_tokens`` (the fewest our packing finds: often
    ``token_bound``, more when few samples fit together; the search starts at
    a bin-packing lower bound, gallops up to a count that packs and bisects
    back), at least ``min_micro_batches``,
    rounded up to a multiple of ``divisible_by`` (Megatron's interleaved
    schedule needs multiples of ``microbatch_group_size_per_vp_stage``). With
    ``sync`` and an initialised process group of more than one rank, the
    ranks of ``pg`` then agree on the largest ``k`` with one all-reduce (MAX)
    of 18 integers, which also carries a fingerprint of each setting and an
    error flag, so that invalid input or differing settings on *any* rank
    raise ``ValueError`` on *every* rank instead of hanging.

    The cut, for summed costs: balance ``cost`` (default: tokens) over the
    ``k`` micro-batches, never letting one exceed ``max_tokens`` tokens. For
    ``padded=True`` (each micro-batch padded to its longest sample): a
    micro-batch costs ``rows x cost(longest)`` and holds ``rows x longest``
    tokens (``<= max_tokens``; ``rows <= micro_batch_size``); the plan puts
    similar lengths together, minimising the rank's summed padded cost.

    Example (one rank, no process group): lengths ``[7] * 8`` with
    ``max_tokens=8`` give 8 micro-batches of one sample each (7 tokens);
    verl's ``ceil(56 / 8) = 7`` micro-batches would hold 14 tokens in one.
    Lengths ``[5, 1, 4, 2, 3, 3]`` with ``max_tokens=6`` give 3 micro-batches
    of 6 tokens: ``[[0, 1], [2, 3], [4, 5]]``, ``inverse`` ``[0, 1, 2, 3, 4, 5]``.

    Args:
        lengths: [N] token counts of this rank's samples (list, ndarray or
            CPU tensor; integers >= 0 summing below ``2**53``).
        max_tokens: token budget per micro-batch (padded tokens with
            ``padded``), or ``None``.
        num_micro_batches: a fixed ``k``, or ``None``. A fixed ``k`` still
            takes part in the agreement when ``sync`` (a rank passing ``4``
            next to one passing ``None`` is an error on both, not a hang);
            ``sync=False`` skips the collective.
        min_micro_batches: at least this many micro-batches (e.g. the
            pipeline-parallel stages).
        divisible_by: ``k`` is a multiple of this.
        micro_batch_size: with ``padded``, at most this many rows (samples)
            per micro-batch (torchspec's ``mbs``).
        cost: per-sample cost: ``None`` (tokens), an estimator with
            ``of_lengths`` (:class:`~balancer.TransformerCost`) or
            ``coefficients()`` (the other estimators), a function of the
            lengths array, or (not with ``padded``) an [N] array.
        groups: optional [N] int group id; samples sharing an id land in the
            same micro-batch (a group must fit the budget).
        padded: micro-batches are padded to their longest sample.
        pg: the data-parallel group for the agreement (``None``: the default
            group, resolved at call time). A gloo group can agree from any thread;
            on an NCCL group the all-reduce runs on the group's device and must
            be issued in the same order as the training loop's collectives on that
            group (call it on the training thread, or pass a gloo group).
        sync: agree on ``k`` across ``pg`` (set ``False`` on a single
            controller that plans for everyone). The same on every rank: a
            rank with ``False`` (or a falsy non-bool, which raises at once)
            skips the all-reduce its peers wait in, which nothing can detect.

    Returns:
        A :class:`MicroBatchPlan`.

    A rank with fewer samples (or groups) than ``k`` -- the agreed one, or the
    one its own ``num_micro_batches``, ``min_micro_batches`` or
    ``divisible_by`` ask for; none at all (empty ``lengths``: an all-padding
    batch at the end of an uneven epoch) or a few -- gets one per micro-batch
    and empty micro-batches for the rest of the ``k`` (the fewest allowed where
    every rank is empty), so that it runs the step's ``k`` forward/backward
    passes with the others.

    Raises:
        ValueError: non-1-D, negative, NaN, bool or non-integer lengths;
            costs that are negative, not finite, bools or sum to ``1e300`` or
            more; a sample or group longer than ``max_tokens`` (named, with its
            length and the budget); bad settings (non-positive ints, flags
            that are not Python bools,
            ``num_micro_batches`` not a multiple of ``divisible_by`` or below
            ``min_micro_batches``, ``micro_batch_size`` without ``padded``); a
            ``num_micro_batches`` that the samples do not pack into under the
            budget; with the collective, any of these on another rank or
            settings that differ between ranks.
    """
    rank = _rank_of(pg)
    where = f"rank {rank}"
    # A falsy bad ``sync`` (None, 0) raises at once, without the agreement: a single
    # controller that meant False must not wait in an all-reduce its peers never join.
    collective = (sync and dist.is_available()
                  and dist.is_initialized() and dist.get_world_size(pg) > 1)
    err: BaseException | None = None
    un: Units | None = None
    empty = False
    k_local = bound = 0
    cache: dict[int, Any] = {}
    try:
        check_positive("max_tokens", max_tokens, where, allow_none=True)
        check_positive("num_micro_batches", num_micro_batches, where, allow_none=True)
        check_positive("min_micro_batches", min_micro_batches, where)
        check_positive("divisible_by", divisible_by, where)
        check_positive("micro_batch_size", micro_batch_size, where, allow_none=True)
        check_flag("padded", padded, where)
        check_flag("sync", sync, where)
        if micro_batch_size is not None and not padded:
            raise ValueError(f"micro_batch_size={micro_batch_size} bounds the rows of padded "
                             f"micro-batches; pass padded=True or use max_tokens ({where})")
        empty = _no_samples(lengths, cost, groups, where)
        if empty:
            k_local = _fewest_allowed(num_micro_batches, min_micro_batches, divisible_by, where)
        else:
            lens = as_lengths(lengths, where)
            un = make_units(lens, cost, groups, padded, where)
            check_fits(un, max_tokens, micro_batch_size, padded, where)
            k_local, bound, cache = _local_k(un, max_tokens, micro_batch_size, padded,
                                             num_micro_batches, min_micro_batches, divisible_by, where)
    except BaseException as e:  # noqa: BLE001 - any failure (a cost function's too, or a KeyboardInterrupt
        # in it) goes through the agreement, then is raised here as itself
        if not collective:
            raise
        err = e
    k = k_local
    if collective:
        fps = [_fingerprint(v) for v in (num_micro_batches, max_tokens, min_micro_batches, divisible_by,
                                         micro_batch_size, padded, cost, groups is None)]
        k, bad, differ = _agree(k_local, fps, err is not None, pg)
        if err is not None:
            raise err
        if bad >= 0:
            raise ValueError(f"plan_micro_batches failed on rank {bad} (see its error); "
                             f"nothing was planned ({where})")
        if differ:
            shown = (repr(num_micro_batches), repr(max_tokens), repr(min_micro_batches), repr(divisible_by),
                     repr(micro_batch_size), repr(padded), "None" if cost is None else f"a {type(cost).__name__}",
                     "given" if groups is not None else "not given")
            mine = ", ".join(f"{_SETTINGS[i]}: {shown[i]}" for i in differ)
            raise ValueError(f"plan_micro_batches got different settings on different ranks: "
                             f"{', '.join(_SETTINGS[i] for i in differ)}; pass the same everywhere "
                             f"(this rank's {mine}) ({where})")
    if empty:
        return _empty_plan(k, k_local, padded)
    assert un is not None, "set unless an error was raised"
    # A rank with fewer units than k (the agreed one, or its own settings' at the end
    # of an uneven epoch) cuts one unit a micro-batch and runs the remaining passes empty.
    units = un.tokens.size
    cut_k = min(k, units)
    # Either k_local <= cut_k <= units (a cut into k_local splits up to cut_k) or
    # cut_k == units (one unit each: every unit fits the budget).
    cut = _cut_at(un, cut_k, max_tokens, micro_batch_size, padded, cache)
    assert cut is not None, "a cut into k_local splits up to any k up to the unit count"
    if k != k_local:
        logger.debug("rank %d: %d micro-batches (needed %d)", rank, k, k_local)
    return _with_empty(_finish(un, cut, cut_k, padded, k_local, bound, max_tokens), k)
