"""The shapes that took seconds to plan at N = 10,000, pinned by what their plans must satisfy.

Budgets at the longest sample (one or two samples a micro-batch), a count equal
to the number of samples, and padded pairs (GRPO-style groups of two) cut into
thousands of micro-batches. The fast paths of ``balancer/_microbatch_pack.py``
(parked capped LPT, sparse Karmarkar-Karp, a tree for first fit, a heap of
splits) are checked against the straightforward versions they replace, written
here, and the plans against conservation, the budgets and lower bounds.
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from balancer import TransformerCost, plan_dispatch, plan_micro_batches
from balancer._microbatch_pack import (
    bins_bound,
    first_fit_padded,
    kk_labels,
    max_ends,
    pack_padded_groups,
    pack_sum,
    segment_padded,
)
from balancer.microbatch import MicroBatchPlan
from balancer.partition._free import free_assign
from balancer.partition._free_state import FreeState
from balancer.partition._refine import sort_order
from tests.llm_reference import kk_equal, kk_free

QWEN2_0_5B = TransformerCost.from_hf_config({
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936})
N = 10_000


def _pairs(n: int) -> np.ndarray:
    return np.repeat(np.arange(n // 2), 2)


def _check(plan: MicroBatchPlan, lengths: np.ndarray, cap: int | None, groups: np.ndarray | None = None,
           padded: bool = False) -> None:
    """Every sample once, ascending non-empty micro-batches, the inverse, the budget, groups together."""
    n = lengths.size
    assert len(plan.micro_batches) == plan.num_micro_batches
    flat = np.concatenate([np.asarray(m, np.int64) for m in plan.micro_batches])
    assert np.array_equal(np.sort(flat), np.arange(n)), "every sample once"
    assert all(m and m == sorted(m) for m in plan.micro_batches), "non-empty, ascending"
    assert np.array_equal(flat[plan.inverse], np.arange(n)), "inverse restores input order"
    sizes = [len(m) for m in plan.micro_batches]
    label = np.repeat(np.arange(len(sizes)), sizes)[np.argsort(flat)]
    tokens = np.bincount(label, weights=lengths, minlength=len(sizes))
    longest = np.zeros(len(sizes), np.int64)
    np.maximum.at(longest, label, lengths)
    padded_tokens = np.bincount(label) * longest
    assert np.array_equal(plan.tokens, tokens) and np.array_equal(plan.padded_tokens, padded_tokens)
    if cap is not None:
        assert (padded_tokens if padded else tokens).max() <= cap, "the budget is a hard cap"
    if groups is not None:
        gid = np.unique(groups, return_inverse=True)[1]
        first, last = np.full(gid.max() + 1, label.size), np.full(gid.max() + 1, -1)
        np.minimum.at(first, gid, label)
        np.maximum.at(last, gid, label)
        assert np.array_equal(first, last), "groups stay together"


# ------------------------------------------------------------ plans at N = 10,000
@pytest.mark.parametrize(("lengths", "cap"), [
    (np.random.default_rng(1).integers(1, 8192, N), 8191),  # two a micro-batch at most, often one
    (np.minimum(np.random.default_rng(2).zipf(1.2, N) + 100, 8192), 8192),
])
def test_budget_at_the_longest_sample(lengths: np.ndarray, cap: int) -> None:
    plan = plan_micro_batches(lengths, max_tokens=cap, cost=QWEN2_0_5B)
    _check(plan, lengths, cap)
    fewest = bins_bound(lengths, cap)
    assert fewest <= plan.num_micro_batches <= fewest + 10, (fewest, plan.num_micro_batches)
    # No cut beats the costliest sample alone; these reach it.
    assert plan.objective == QWEN2_0_5B.of_lengths(lengths).max() == plan.bound


@pytest.mark.parametrize(("lengths", "kwargs"), [
    (np.zeros(N, np.int64), {"num_micro_batches": N}),
    (np.random.default_rng(0).integers(1, 8192, N), {"num_micro_batches": N}),
    (np.full(N, 4096), {"max_tokens": 4096, "cost": QWEN2_0_5B}),
])
def test_every_sample_alone(lengths: np.ndarray, kwargs: dict) -> None:
    plan = plan_micro_batches(lengths, **kwargs)
    _check(plan, lengths, kwargs.get("max_tokens"))
    assert plan.num_micro_batches == N and all(len(m) == 1 for m in plan.micro_batches)
    cost = QWEN2_0_5B.of_lengths(lengths) if "cost" in kwargs else lengths.astype(np.float64)
    assert np.array_equal(plan.order, np.lexsort((np.arange(N), -cost))), "heaviest first, ties by index"
    assert plan.objective == cost.max()


def test_every_unit_alone_is_lpts_cut() -> None:
    # pack_sum's shortcut at k == U gives the labels capped LPT gives there.
    rng = np.random.default_rng(3)
    for _ in range(30):
        n = int(rng.integers(1, 60))
        tokens = rng.integers(0, 50, n)
        cost = rng.integers(0, 4, n) if rng.random() < 0.5 else tokens.astype(np.float64) ** 2
        cap = None if rng.random() < 0.3 else int(tokens.max(initial=0)) + 1
        got = pack_sum(cost, tokens, n, cap)
        ref = free_assign(cost, n, 1, sizes=None if cap is None else tokens, cap=cap, rtol=0.0)
        assert got is not None and np.array_equal(got, ref)
    assert pack_sum(np.ones(3), np.array([5, 9, 5]), 3, 8) is None, "a unit over the budget"


def _lpt_repopping(cost: np.ndarray, k: int, tokens: np.ndarray, cap: int) -> np.ndarray | None:
    """Capped LPT as written before parking: every item pops the lighter full parts and
    pushes them back (costliest item first, ties by index; at least one item a part)."""
    order = np.lexsort((np.arange(cost.size), cost))[::-1]  # sort_order reversed: costliest first
    n = cost.size
    loads, counts, toks = [0.0] * k, [0] * k, [0] * k
    part = np.full(n, -1, np.int64)
    heap = [(0.0, j) for j in range(k)]
    missing, remaining, needy = k, n, False
    for i in order.tolist():
        if not needy and remaining <= missing:
            needy = True
            heap = [(loads[j], j) for j in range(k) if counts[j] < 1]
            heapq.heapify(heap)
        skipped = []
        while heap:
            load, j = heapq.heappop(heap)
            if toks[j] + int(tokens[i]) <= cap:
                break
            skipped.append((load, j))
        else:
            return None
        part[i] = j
        loads[j] = load + float(cost[i])
        counts[j] += 1
        toks[j] += int(tokens[i])
        missing -= counts[j] <= 1
        remaining -= 1
        if not needy:
            heapq.heappush(heap, (loads[j], j))
        for item in skipped:
            heapq.heappush(heap, item)
    return part


def _lpt_parked(cost: np.ndarray, k: int, tokens: np.ndarray, cap: int) -> np.ndarray | None:
    """FreeState.lpt (parking full parts), as free_assign runs it, before refinement."""
    order = sort_order(cost)
    st = FreeState(cost[order].astype(np.float64), tokens[order], k)
    if not st.lpt(range(cost.size - 1, -1, -1), 1, cost.size, cap):
        return None
    out = np.empty(cost.size, np.int64)
    out[order] = st.part
    return out


def test_parked_lpt_matches_the_repopping_one() -> None:
    # Parking a part too full for an item (FreeState.lpt) against popping and re-pushing
    # it for every item: the same labels, or None for both.
    rng = np.random.default_rng(4)
    for trial in range(400):
        n = int(rng.integers(1, 150))
        tokens = rng.integers(0, 60, n) if trial % 4 else np.full(n, int(rng.integers(1, 30)))
        cost = tokens.astype(np.float64) ** 2 + 5 * tokens if trial % 3 else rng.integers(0, 5, n)
        cap = int(tokens.max() + rng.integers(0, 80))
        k = int(rng.integers(1, n + 1))
        got, ref = _lpt_parked(cost, k, tokens, cap), _lpt_repopping(cost, k, tokens, cap)
        assert (got is None) == (ref is None) and (got is None or np.array_equal(got, ref)), (trial, n, k, cap)
    # One-sample micro-batches with the full ones lightest (the 12.7M-pop shape), at N = 2,000.
    lens = np.random.default_rng(1).integers(1, 8192, 2000)
    cost = QWEN2_0_5B.of_lengths(lens)
    for k in (1003, 1010, 1030):
        got, ref = _lpt_parked(cost, k, lens, 8191), _lpt_repopping(cost, k, lens, 8191)
        assert (got is None) == (ref is None) and (got is None or np.array_equal(got, ref)), k


def test_karmarkar_karp_many_parts_matches_the_textbook() -> None:
    # The sparse states (k > 32) against the heap of k-lists, part by part: one state
    # absorbing single units, small states meeting a large one (and the reverse),
    # zero costs (empty and non-empty parts of sum 0), ties, equal sizes.
    rng = np.random.default_rng(5)
    for trial in range(20):
        n = int(rng.integers(150, 360))
        k = int(rng.choice([33, 40, 64, n // 4, n // 2, n - 1]))
        lens = rng.integers(1, 300, n)
        cost = [lens.astype(np.float64) ** 2 + 7 * lens, lens * 3, np.minimum(lens, 40), lens % 3 + 1.0][trial % 4]
        if trial % 2 == 0:
            cost = np.where(rng.random(n) < 0.3, 0, cost)
        labels = kk_labels(cost, k)
        assert [np.flatnonzero(labels == j).tolist() for j in range(k)] == kk_free(cost.tolist(), k), (trial, n, k)
    for seed in range(10):  # few distinct costs and zeros: states of equal parts meet sets of cost 0
        few = np.random.default_rng(seed)
        cost = np.where(few.random(100) < 0.4, 0.0, few.integers(1, 3, 100).astype(np.float64))
        labels = kk_labels(cost, 33)
        assert [np.flatnonzero(labels == j).tolist() for j in range(33)] == kk_free(cost.tolist(), 33), seed
    for k, rows in ((40, 6), (50, 3), (64, 2)):
        cost = np.where(rng.random(k * rows) < 0.2, 0.0, rng.lognormal(0.0, 1.0, k * rows))
        labels = kk_labels(cost, k, equal=True)
        assert [np.flatnonzero(labels == j).tolist() for j in range(k)] == kk_equal(cost.tolist(), k), k
    zero = np.zeros(50)
    assert [np.flatnonzero(kk_labels(zero, 40) == j).tolist() for j in range(40)] == kk_free(zero.tolist(), 40)


def _first_fit_scan(head: np.ndarray, rows: np.ndarray, cap: int | None, max_rows: int | None) -> list[list[int]]:
    """First-fit decreasing by scanning every open micro-batch (what the tree replaces)."""
    order = np.lexsort((np.arange(head.size), -rows, -head)).tolist()
    first: list[int] = []
    used: list[int] = []
    out: list[list[int]] = []
    for u in order:
        r = int(rows[u])
        for m, (h0, n0) in enumerate(zip(first, used, strict=True)):
            if (cap is None or (n0 + r) * h0 <= cap) and (max_rows is None or n0 + r <= max_rows):
                used[m] += r
                out[m].append(u)
                break
        else:
            first.append(int(head[u]))
            used.append(r)
            out.append([u])
    return out


def _split_scan(head: np.ndarray, rows: np.ndarray, c: np.ndarray, cap: int | None, max_rows: int | None,
                k: int) -> list[list[int]]:
    """First fit split up to ``k``, the split that saves most first, rescanning every micro-batch."""
    ffd = _first_fit_scan(head, rows, cap, max_rows)
    while len(ffd) < k:
        best = None
        for m, units in enumerate(ffd):
            for t in range(1, len(units)):
                gain = float(rows[units[t:]].sum()) * float(c[units[0]] - c[units[t]])
                if best is None or gain > best[0]:
                    best = (gain, m, t)
        assert best is not None
        _, m, t = best
        ffd.append(ffd[m][t:])
        ffd[m] = ffd[m][:t]
    return ffd


def _reference_pack(head: np.ndarray, rows: np.ndarray, c: np.ndarray, cap: int | None, max_rows: int | None,
                    k: int) -> list[list[int]] | None:
    """:func:`pack_padded_groups` with the scans: the cheaper of length runs and first fit split up."""
    order = np.lexsort((np.arange(head.size), -head))
    cands = []
    cuts = segment_padded(c[order], rows[order], max_ends(head[order], rows[order], cap, max_rows), k)
    if cuts is not None:
        cands.append([order[a:b].tolist() for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
    if len(_first_fit_scan(head, rows, cap, max_rows)) <= k:
        cands.append(_split_scan(head, rows, c, cap, max_rows, k))
    total = lambda mbs: sum(float(rows[m].sum()) * float(c[m[0]]) for m in mbs)  # noqa: E731
    return min(cands, key=total) if cands else None


def test_first_fit_and_its_splits_match_the_scans() -> None:
    rng = np.random.default_rng(6)
    for trial in range(120):
        n = int(rng.integers(1, 90))
        head = rng.integers(0, 100, n) if trial % 2 else np.minimum(rng.zipf(1.3, n), 300)
        rows = rng.integers(1, 5, n)
        cap = None if trial % 5 == 0 else int((rows * head).max() + rng.integers(0, 500))
        max_rows = None if trial % 3 == 0 else int(rows.max() + rng.integers(0, 6))
        ffd = first_fit_padded(head, rows, cap, max_rows)
        assert ffd == _first_fit_scan(head, rows, cap, max_rows)
        c = head.astype(np.float64) ** 2 + 3 * head
        for k in {len(ffd), int(rng.integers(len(ffd), n + 1)), n}:
            got = pack_padded_groups(head, rows, c, cap, max_rows, k)
            assert got is not None and len(got) == k and all(got)
            assert got == _reference_pack(head, rows, c, cap, max_rows, k), (trial, k)


@pytest.mark.parametrize(("n", "k"), [(4000, 2000), (N, N // 4)])
def test_padded_pairs(n: int, k: int) -> None:
    lengths = np.random.default_rng(0).integers(1, 4096, n)
    groups = _pairs(n)
    plan = plan_micro_batches(lengths, padded=True, groups=groups, num_micro_batches=k, cost=QWEN2_0_5B)
    _check(plan, lengths, None, groups, padded=True)
    assert plan.num_micro_batches == k
    assert plan.bound <= plan.objective <= plan.objective_before
    if k == n // 2:  # every pair alone: each micro-batch pads its pair to the longer one
        costs = QWEN2_0_5B.of_lengths(lengths.reshape(-1, 2).max(axis=1)) * 2
        assert plan.objective == pytest.approx(costs.sum(), rel=1e-12)


def test_padded_pairs_under_a_budget() -> None:
    lengths = np.random.default_rng(0).integers(1, 4096, N)
    groups = _pairs(N)
    plan = plan_micro_batches(lengths, padded=True, groups=groups, max_tokens=16384, cost=QWEN2_0_5B)
    _check(plan, lengths, 16384, groups, padded=True)
    assert plan.token_bound <= plan.num_micro_batches
    assert plan.num_micro_batches <= len(first_fit_padded(*_pair_units(lengths), 16384, None))
    assert plan.objective <= plan.objective_before


def _pair_units(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return lengths.reshape(-1, 2).max(axis=1), np.full(lengths.size // 2, 2)


@pytest.mark.parametrize("k", [500, 250])
def test_dispatch_padded_pairs(k: int) -> None:
    lengths = np.random.default_rng(0).integers(1, 4096, 4000)
    groups = _pairs(4000)
    plan = plan_dispatch(lengths, 4, padded=True, groups=groups, num_micro_batches=k)
    assert plan.num_micro_batches == k and plan.micro_batches is not None
    seen = sorted(i for rank in plan.micro_batches for m in rank for i in m)
    assert seen == list(range(4000)), "every sample once"
    for rank, share in zip(plan.micro_batches, plan.ranks, strict=True):
        assert len(rank) == k and sorted(i for m in rank for i in m) == share
        for m in rank:
            assert np.unique(groups[m]).size * 2 == len(m), "pairs stay together"
    if k == 500:  # 2,000 micro-batches of 2,000 pairs: each pair alone, padded to its longer sample
        assert plan.loads.sum() == pytest.approx(2 * lengths.reshape(-1, 2).max(axis=1).sum(), rel=1e-12)


def test_large_first_fit_is_first_fit() -> None:
    # Thousands of open micro-batches: the tree's choice is the scan's.
    rng = np.random.default_rng(8)
    head = rng.integers(1, 4096, 3000)
    rows = rng.integers(1, 4, 3000)
    for cap, max_rows in ((8192, None), (16384, 6), (None, 5)):
        assert first_fit_padded(head, rows, cap, max_rows) == _first_fit_scan(head, rows, cap, max_rows)


def test_split_ties_take_the_first_micro_batch_and_position() -> None:
    # Equal lengths and costs: every split saves nothing, so the order of ties is the whole answer.
    head = np.full(12, 10)
    rows = np.array([1, 2, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1])
    c = np.full(12, 4.0)
    for k in range(1, 13):
        got = pack_padded_groups(head, rows, c, None, 4, k)
        if k < 4:  # 16 rows, 4 a micro-batch
            assert got is None and _reference_pack(head, rows, c, None, 4, k) is None
        else:
            assert got == _reference_pack(head, rows, c, None, 4, k), k
