"""Balancing within groups of ranks (``BatchShuffler(group_size=...)``): pure parts and real gloo runs.

The reference forms the groups and partitions each group's samples on its own
(groups written here, independently of ``balancer._groups``), and every run is
checked against it sample by sample: every sample exactly once, never outside
its group, on the rank the reference puts it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from balancer._agreement import Agreement, decide, describe_failure
from balancer._groups import form_groups, group_message_words, members_of, widen_splits
from balancer._header import H_PREV_DIGEST, H_PREV_GROUP, H_PREV_SEQ, HEADER_LEN
from balancer._stats import format_stats
from balancer.batch import pad_batch
from balancer.config import BalancerConfig
from balancer.errors import ShuffleAbortedError
from balancer.loader import BalancedLoader
from balancer.partition import balanced_partition
from balancer.shuffler import BatchShuffler
from balancer.testing import HostReadRecorder, WorkerError, run_workers, run_workers_outcomes
from tests.reference import greedy, scale_free
from tests.test_faults import TIMEOUT, _leave_together
from tests.test_loader import FAST, Source, check_batch, padding, real_ids
from tests.test_loader import B as LOADER_B
from tests.test_loader import cost as loader_cost
from tests.test_protocol import _headers
from tests.test_shuffler import assert_identical, make_batch, rows, token_count
from tests.test_tokens import token_batch, token_rows


# ------------------------------------------------------------------ pure parts
def _reference_groups(loads: list[float], g: int) -> list[list[int]]:
    """Ranks by load, heaviest first (ties: lower rank first), dealt round-robin."""
    w = len(loads)
    m = -(-w // g)
    order = sorted(range(w), key=lambda r: (-loads[r], r))
    return [sorted(order[i::m]) for i in range(m)]


def test_form_groups_deals_ranks_by_load() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        w = int(rng.integers(1, 40))
        g = int(rng.integers(2, 12))
        loads = rng.integers(0, 5, w).astype(np.float64)  # many ties
        gid = form_groups(loads, g)
        groups = [members_of(gid, int(r)).tolist() for r in range(w)]
        expect = _reference_groups(loads.tolist(), g)
        for r in range(w):
            assert groups[r] in expect and r in groups[r]
        sizes = [len(x) for x in expect]
        assert max(sizes) <= g and max(sizes) - min(sizes) <= 1
    # The docstring's example.
    gid = form_groups(np.array([5.0, 9.0, 1.0, 7.0]), 2)
    assert members_of(gid, 0).tolist() == [0, 1] and members_of(gid, 2).tolist() == [2, 3]


def test_widen_splits_and_message_size() -> None:
    assert widen_splits((8, 24), np.array([1, 3]), 5) == (0, 8, 0, 24, 0)
    with pytest.raises(ValueError):
        widen_splits((8,), np.array([1, 3]), 5)
    assert group_message_words(8, 2, 18, 40) == 7 * 19 + 1 * 58
    assert group_message_words(3, 8, 18, 40) == 2 * 19 + 2 * 58  # a group of at most W ranks


def test_plan_digests_are_compared_within_the_planning_group() -> None:
    def headers(digests: list[int], planners: list[int]) -> np.ndarray:
        h = _headers(len(digests), Agreement(4, 2, 7))
        h[:, H_PREV_SEQ] = 3
        h[:, H_PREV_DIGEST] = digests
        h[:, H_PREV_GROUP] = planners
        return h

    # Two groups planned shuffle 3 with different plans: fine.
    assert decide(headers([7, 9, 7, 9], [0, 1, 0, 1]), Agreement(4, 2, 7)).kind == "ok"
    # Rank 2 differs from the rest of its group: the same error on every rank.
    h = headers([7, 9, 8, 9], [0, 1, 0, 1])
    verdict = decide(h, Agreement(4, 2, 7))
    assert verdict.kind == "error" and verdict.problems == ("plan",)
    text, odd = describe_failure(verdict, h, [])
    assert odd == [2] and "the partition of shuffle #3 differed on rank(s) [2]" in text
    # Without groups (-1 everywhere) every digest is compared, as before.
    assert decide(headers([7, 9, 7, 9], [-1] * 4), Agreement(4, 2, 7)).problems == ("plan",)


def test_group_size_validation() -> None:
    for bad in (0, 1, 2.0, True, "4"):
        with pytest.raises(ValueError, match=rf"BatchShuffler: group_size={bad!r}, expected None or an int >= 2"):
            BatchShuffler(token_count, group_size=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=rf"BalancerConfig: group_size={bad!r}, expected None or an int >= 2"):
            BalancerConfig(group_size=bad)  # type: ignore[arg-type]
    clashes = [(dict(comm="allgather"), "comm='allgather'"), (dict(partition=greedy), "partition='greedy'"),
               (dict(capacity=16), "capacity=16"), (dict(calibrate=True), "calibrate=True"),
               (dict(token_cap=1.05), "token_cap=1.05")]
    for kwargs, text in clashes:
        with pytest.raises(ValueError, match=f"group_size=4 balances within groups .*; got {text}$"):
            BatchShuffler(token_count, group_size=4, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got online_calibration=True$"):
        BalancerConfig(group_size=4, online_calibration=True)
    BatchShuffler(token_count, group_size=4, executor="thread", locality=False).close()
    with pytest.raises(ValueError, match=r"BatchShuffler: group_size=1, expected None or an int >= 2"):
        BalancedLoader([], token_count, group_size=1)


# ------------------------------------------------------------------ real runs
def _grouped_worker(rank: int, w: int, group_size: int) -> list[dict[str, Any]]:
    results = []
    rng = np.random.default_rng(7)  # same draws on every rank
    grouped = {"local": BatchShuffler(token_count, group_size=group_size),
               "blind": BatchShuffler(token_count, group_size=group_size, locality=False, executor="thread")}
    for case in range(12):
        b = int(rng.choice([1, 3, 8]))
        reals = rng.integers(0, b + 1, size=w).tolist() if case % 3 else [b] * w
        batch = make_batch(rank, b, int(reals[rank]), seed=100 + case, labels=["kjt", "dense", None][case % 3])
        res: dict[str, Any] = dict(b=b, real=int(batch.actual_batch_size or 0), rows_in=rows(batch),
                                   workloads=token_count(batch).tolist())
        for name, shuffler in grouped.items():
            handle = shuffler.start_shuffle_async(batch)
            out = shuffler.finish_shuffle(batch, handle)
            res[name] = dict(rows=rows(out), real=int(out.actual_batch_size or 0),
                             stats=dataclasses.asdict(handle.stats), log=format_stats(handle.stats),
                             job_imbalance=handle.stats.world_imbalance_before)
        results.append(res)
    for s in grouped.values():
        s.close()
    return results


def _expected(ins: list[dict[str, Any]], w: int, group_size: int) -> tuple[list[list[int]], list[list[Any]]]:
    """The reference: groups from every rank's load, then each group's samples
    partitioned among its members as the shuffler's default partition does."""
    b = ins[0]["b"]
    loads = [float(sum(d["workloads"][: d["real"]])) for d in ins]
    groups = _reference_groups(loads, group_size) if w > group_size else [list(range(w))]
    out: list[list[Any]] = [[] for _ in range(w)]
    for members in groups:
        x = np.array([ins[r]["workloads"][i] if i < ins[r]["real"] else 0 for r in members for i in range(b)])
        q = scale_free(x)
        parts = balanced_partition(q, len(members))
        home = [list(range(i * b, (i + 1) * b)) for i in range(len(members))]
        if max(sum(int(q[j]) for j in p) for p in parts) > max(sum(int(q[j]) for j in p) for p in home):
            parts = home  # never worse than staying
        for i, part in enumerate(parts):
            src = [(members[j // b], j % b) for j in sorted(part)]
            out[members[i]] = [ins[r]["rows_in"][k] for r, k in src if k < ins[r]["real"]]
    return groups, out


@pytest.mark.parametrize(("world_size", "group_size"), [(4, 2), (3, 2), (4, 3), (8, 3)])
def test_grouped_shuffles_match_the_reference(world_size: int, group_size: int) -> None:
    per_rank = run_workers(_grouped_worker, world_size, group_size)
    mixed = 0  # cases where one group moved samples and another moved none (it joins phase 2 empty)
    for case in range(len(per_rank[0])):
        ins = [per_rank[r][case] for r in range(world_size)]
        groups, expected = _expected(ins, world_size, group_size)
        group_of = {r: tuple(g) for g in groups for r in g}
        real_in = Counter(row for d in ins for row in d["rows_in"][: d["real"]])
        where = {row: r for r, d in enumerate(ins) for row in d["rows_in"][: d["real"]]}
        cost = {row: d["workloads"][i] for d in ins for i, row in enumerate(d["rows_in"][: d["real"]])}
        for variant in ("local", "blind"):
            outs = [d[variant] for d in ins]
            assert Counter(row for o in outs for row in o["rows"][: o["real"]]) == real_in, (case, variant)
            for r, o in enumerate(outs):
                st, mine = o["stats"], o["rows"][: o["real"]]
                assert tuple(st["group"]) == group_of[r] and st["world_size"] == world_size and st["rank"] == r
                assert all(group_of[where[row]] == group_of[r] for row in mine), (case, r)  # never leaves
                assert st["max_after"] <= st["max_before"] + 1e-9
                assert st["load_after"][st["group"].index(r)] == float(sum(cost[row] for row in mine))
                # the job's view, from every rank's header: each rank's real samples and load
                assert st["world_real_before"] == [d["real"] for d in ins], (case, r)
                assert st["world_load_before"] == [float(sum(d["workloads"][: d["real"]])) for d in ins]
                job = st["world_load_before"]
                ratio = max(job) * world_size / sum(job) if sum(job) else 1.0
                assert o["job_imbalance"] == pytest.approx(ratio)
                assert f"W={world_size}, group of {len(st['group'])}, job imbalance before {ratio:.3f}" in o["log"]
                if variant == "blind":
                    assert o["rows"][: o["real"]] == expected[r], (case, r)
            for g in groups:
                stats = [outs[r]["stats"] for r in g]
                assert sum(s["samples_sent"] for s in stats) == sum(s["samples_received"] for s in stats)
                assert all(s["load_after"] == stats[0]["load_after"] for s in stats)  # one plan per group
            mixed += len({outs[g[0]]["stats"]["comm"] for g in groups}) > 1
    if world_size == 3:
        assert mixed >= 4, mixed


def _same_as_global_worker(rank: int, w: int) -> list[bool]:
    plain, wide = BatchShuffler(token_count), BatchShuffler(token_count, group_size=w)
    same = []
    for case in range(4):
        batch = make_batch(rank, 8, 8 - case, seed=200 + case)
        a, h = plain.shuffle(batch), wide.start_shuffle_async(batch)
        bb = wide.finish_shuffle(batch, h)
        assert_identical(a, bb)
        same.append(h.stats.group == [] and h.stats.world_load_before == h.stats.load_before
                    and h.stats.world_real_before == h.stats.real_before)
    return same


def test_group_size_of_at_least_w_is_global_balancing() -> None:
    assert run_workers(_same_as_global_worker, 3) == [[True] * 4] * 3


def _bad_input_worker(rank: int, w: int) -> list[tuple[str, str]]:
    s = BatchShuffler(token_count, group_size=2)
    out = []
    for case in range(3):
        batch = make_batch(rank, 6, 6, seed=300 + case)
        if case == 1 and rank == 2:
            batch.actual_batch_size = 9  # invalid on one rank only
        try:
            s.shuffle(batch)
            out.append(("ok", ""))
        except ValueError as e:
            out.append(("ValueError", str(e)))
    s.close()
    return out


def test_bad_input_on_one_rank_raises_on_every_rank_with_groups() -> None:
    outs = run_workers(_bad_input_worker, 4)
    for out in outs:
        assert out[0] == out[2] == ("ok", "")
        assert out[1][0] == "ValueError" and out[1][1] == outs[0][1][1]
        assert "actual_batch_size=9, expected 0 <= actual_batch_size <= batch_size=6 (rank 2)" in out[1][1]


def _stall_worker(rank: int, w: int, where: str) -> tuple[str, Any]:
    s = BatchShuffler(token_count, group_size=2, timeout=TIMEOUT)
    s.shuffle(make_batch(rank, 8, 8, seed=2))
    batch = make_batch(rank, 8, 8, seed=3)
    h = s.start_shuffle_async(batch)
    try:
        if rank == 3:  # started, then stalls until the others gave up: never takes part in phase 2
            _leave_together(where, rank, w)
            return "slept", None
        s.finish_shuffle(batch, h)
        return "ok", None
    except ShuffleAbortedError as e:
        _leave_together(where, rank, w)  # rank 0 hosts the store the others read
        return "aborted", (e.phase, e.missing)


def test_a_stalled_peer_is_named_with_groups(tmp_path: Path) -> None:
    outs = run_workers_outcomes(_stall_worker, 4, str(tmp_path), timeout=60)
    assert not any(isinstance(o, WorkerError) for o in outs), outs
    for r in range(3):
        assert outs[r] == ("aborted", ("phase 2", [3])), (r, outs[r])


def _group_size_mismatch_worker(rank: int, w: int) -> dict[str, tuple[str, str]]:
    out = {}
    for name, mine, others in (("none_vs_2", None, 2), ("2_vs_none", 2, None), ("3_vs_4", 3, 4)):
        s = BatchShuffler(token_count, group_size=mine if rank == 0 else others, timeout=20.0)
        batch = make_batch(rank, 6, 6, seed=7)
        try:
            s.shuffle(batch)
            out[name] = ("ok", "")
        except ValueError as e:
            out[name] = ("ValueError", str(e))
        s.close()
    return out


def test_ranks_that_disagree_on_group_size_raise_on_every_rank() -> None:
    # A grouped rank first gathers headers and loads, an ungrouped one whole
    # messages: gloo aborted a process on the size mismatch (SIGABRT) and the
    # others raised ShuffleAbortedError. Now the first gathers have one size.
    outs = run_workers(_group_size_mismatch_worker, 4, timeout=120)
    for name, (mine, others) in {"none_vs_2": ("None", "2"), "2_vs_none": ("2", "None"),
                                 "3_vs_4": ("3", "4")}.items():
        for out in outs:
            kind, msg = out[name]
            assert kind == "ValueError" and msg == outs[0][name][1], (name, out)
            assert f"'group_size': rank 0: '{mine}'; ranks [1, 2, 3]: '{others}'" in msg, msg


def _bytes_worker(rank: int, w: int) -> int:
    """Words this rank received in phase 1 (counted on the collectives' outputs)."""
    import balancer._comm as comm

    got = [0]
    rows_fn, group_fn = comm.gather_rows, comm.gather_group

    def rows_counted(msg: np.ndarray, groups: Any) -> np.ndarray:
        out = rows_fn(msg, groups)
        got[0] += out.size - msg.size
        return out

    def group_counted(msg: np.ndarray, members: np.ndarray, groups: Any) -> np.ndarray:
        out = group_fn(msg, members, groups)
        got[0] += out.size - msg.size
        return out

    comm.gather_rows, comm.gather_group = rows_counted, group_counted  # type: ignore[assignment]
    s = BatchShuffler(token_count, group_size=2)
    batch = make_batch(rank, 8, 8, seed=5)
    s.shuffle(batch)  # first shuffle: agrees on the size (headers only, then the group's messages)
    got[0] = 0
    s.shuffle(batch)
    s.close()
    return got[0]


def test_phase_one_receives_headers_and_the_group_only() -> None:
    w, b, k = 4, 8, 5  # make_batch: 3 feature keys, "e" and the labels' "y"
    payload = b + (k * b + 1) // 2
    counts = run_workers(_bytes_worker, w)
    assert counts == [group_message_words(w, 2, HEADER_LEN, payload)] * w
    # against a global all-gather: (W - 1) full messages
    assert counts[0] < (w - 1) * (HEADER_LEN + payload)


# ------------------------------------------- the loader and token batches
def sample_rank(sid: int) -> int:
    """The rank a ``tests.test_loader`` sample id was drawn on."""
    return sid % 1_000_000 // 10_000


def _loader_and_tokens_worker(rank: int, w: int) -> dict[str, Any]:
    # BalancedLoader(group_size=2) against the shuffler with the same groups,
    # step by step (as tests/test_loader.py checks the global loader).
    src = Source(rank, [5, 3, 4, 2][rank : rank + 1])
    out: dict[str, Any] = {"loader": [], "source": [], "tokens": []}
    with BalancedLoader(src, loader_cost, group_size=2, **FAST) as loader:
        got = [(check_batch(b), loader.stats) for b in loader]
    ref = BatchShuffler(loader_cost, group_size=2, executor="thread")
    batches = list(src)
    out["source"] = real_ids(batches)
    for step, (ids, stats) in enumerate(got):
        x = pad_batch(batches[step], LOADER_B) if step < len(batches) else padding()
        h = ref.start_shuffle_async(x)
        assert check_batch(ref.finish_shuffle(x, h)) == ids, step
        assert stats is not None and (h.stats.group, h.stats.load_after) == (stats.group, stats.load_after)
        out["loader"].append((ids, stats.group))
    ref.close()
    # Token batches, padded and packed, grouped: no host read on the caller's thread.
    cost = lambda b: b.seq_lens.double() ** 2 + 1  # noqa: E731
    for packed in (False, True):
        s = BatchShuffler(cost, group_size=2)
        for case in range(4):
            batch = token_batch(rank, 6, [6, 2, 0, 6][case] if rank == 3 else 6, seed=30 + case,
                                packed=packed, max_len=4 + 4 * rank)
            with HostReadRecorder() as reads:
                h = s.start_shuffle_async(batch)
                got_t = s.finish_shuffle(batch, h)
            assert reads.calls == [], reads.calls
            out["tokens"].append((token_rows(batch), token_rows(got_t), h.stats.group,
                                  h.stats.max_before, h.stats.max_after))
        s.close()
    return out


def test_loader_and_token_batches_balance_within_groups() -> None:
    w = 4
    outs = run_workers(_loader_and_tokens_worker, w, timeout=120)
    # The loader: every drawn sample exactly once, never outside the group it was drawn in.
    drawn = sorted(i for o in outs for i in o["source"])
    assert sorted(i for o in outs for ids, _ in o["loader"] for i in ids) == drawn
    for r, o in enumerate(outs):
        for ids, group in o["loader"]:
            assert r in group and len(group) == 2
            assert all(sample_rank(i) in group for i in ids), (r, group, ids)
    # Token batches: the same, from the sample ids carried in the tokens.
    for case in range(len(outs[0]["tokens"])):
        runs = [o["tokens"][case] for o in outs]
        assert Counter(x for run in runs for x in run[0]) == Counter(x for run in runs for x in run[1])
        for r, (_, after, group, max_before, max_after) in enumerate(runs):
            assert r in group and max_after <= max_before + 1e-9
            assert all((int(row[1][0][1][0]) - 1) // 1000 in group for row in after), (case, r)  # reward: id
