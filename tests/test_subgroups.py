"""Shuffling within data-parallel groups that are subgroups of the world (DP x TP, DP x PP).

Real gloo process groups throughout; every sample of a group must end in that group exactly once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from balancer import BatchShuffler, IdentityBatchShuffler
from balancer.testing import run_workers
from tests.test_shuffler import make_batch, rows, token_count


def _groups(parts: list[list[int]], rank: int) -> Any:
    """Create every group of ``parts`` (all ranks call ``new_group`` for each) and return this rank's."""
    mine = None
    for p in parts:
        g = dist.new_group(p)
        if rank in p:
            mine = g
    return mine


def _shuffled(sh: BatchShuffler, rank: int, group: Any, seed: int) -> tuple[list[Any], list[Any]]:
    x = make_batch(rank, 4, 3, seed=seed)
    out = sh.shuffle(x, group)
    return rows(x)[: x.actual_batch_size], rows(out)[: out.actual_batch_size]


def _pipeline_stages(rank: int, world: int) -> dict[str, Any]:
    """DP x PP: DP groups [0, 1] and [2, 3] are pipeline stages; only stage 0 balances its inputs,
    then every rank shuffles over the world (an evaluation loader, say)."""
    dp = _groups([[0, 1], [2, 3]], rank)
    dp_sh, world_sh = BatchShuffler(token_count, timeout=20), BatchShuffler(token_count, timeout=20)
    out: dict[str, Any] = {}
    if rank in (0, 1):
        out["dp"] = _shuffled(dp_sh, rank, dp, seed=1)
    out["world"] = _shuffled(world_sh, rank, None, seed=2)
    dp_sh.close()
    world_sh.close()
    dist.barrier()  # rank 0 hosts the store: it leaves last
    return out


def _conserved(pairs: list[tuple[list[Any], list[Any]]]) -> None:
    sent = Counter(r for before, _ in pairs for r in before)
    got = Counter(r for _, after in pairs for r in after)
    assert sent == got and sum(sent.values()) == 3 * len(pairs)


def test_a_world_shuffle_after_only_some_groups_shuffled() -> None:
    # Once the world shuffler's gloo groups never met: torch names a group created with
    # use_local_synchronization by the count of groups its process holds (pytorch#173608),
    # which the stage-0 ranks had raised by the DP shuffler's two groups; every rank got a
    # ShuffleAbortedError blaming a peer that 'never started its first shuffle'.
    outs = run_workers(_pipeline_stages, 4, timeout=120)
    _conserved([o["dp"] for o in outs[:2]])
    _conserved([o["world"] for o in outs])


def _within(rank: int, world: int) -> tuple[list[Any], list[Any]]:
    """DP x TP: DP groups [0, 2] and [1, 3]; each shuffles within itself."""
    dp = _groups([[0, 2], [1, 3]], rank)
    sh = BatchShuffler(token_count, timeout=20)
    got = _shuffled(sh, rank, dp, seed=3)
    sh.close()
    dist.barrier()
    return got


def test_samples_stay_within_their_group() -> None:
    outs = run_workers(_within, 4, timeout=120)
    for members in ([0, 2], [1, 3]):
        _conserved([outs[r] for r in members])


def _outcome(sh: BatchShuffler, shuffle: Callable[[], Any], catch: type[Exception] = ValueError) -> str:
    """'ok', or the message of the ``catch`` that ``shuffle()`` raised; then ``sh`` is closed and
    every rank waits for the others (rank 0 hosts the store: it leaves last)."""
    try:
        shuffle()
        return "ok"
    except catch as e:
        return str(e)
    finally:
        sh.close()
        dist.barrier()


def _not_a_member(rank: int, world: int) -> str:
    g = dist.new_group([0, 1])
    sh = BatchShuffler(token_count, timeout=20)
    return _outcome(sh, lambda: _shuffled(sh, rank, g, seed=4))


def test_a_rank_outside_the_group_is_refused_at_once() -> None:
    # Once rank 2 built groups over [0, 1] anyway and failed ~the timeout later with
    # 'aborted in phase 1 on rank -1: ... Connection closed by peer'.
    outs = run_workers(_not_a_member, 3, timeout=120)
    assert outs[:2] == ["ok", "ok"]
    assert "BatchShuffler: this process (global rank 2) is not a member of the process group passed; " \
           "call it only on the group's members" in outs[2], outs[2]


def _bad_batch_size(rank: int, world: int) -> str:
    dp = _groups([[0, 1, 3], [2]], rank)
    sh = BatchShuffler(token_count, timeout=20)
    return _outcome(sh, lambda: sh.shuffle(make_batch(rank, 7 if rank == 3 else 6, 3, seed=5), dp))


def test_errors_in_a_subgroup_say_which_global_ranks_they_mean() -> None:
    # Once: 'rank(s) [2] differ' on global ranks 0, 1 and 3, where global rank 2 is in
    # another group and healthy; the culprit, global rank 3, is rank 2 of the group.
    outs = run_workers(_bad_batch_size, 4, timeout=120)
    assert outs[2] == "ok"
    for r in (0, 1, 3):
        assert "rank numbers here are within the process group passed, whose global ranks are [0, 1, 3]" in outs[r], \
            outs[r]



def _identity(rank: int, world: int) -> tuple[int, int, int]:
    dp = _groups([[0, 2], [1, 3]], rank)
    sh = IdentityBatchShuffler(token_count)
    x = make_batch(rank, 4, 3, seed=6)
    h = sh.start_shuffle_async(x, dp)
    sh.finish_shuffle(x, h, dp)
    sh.close()
    dist.barrier()
    return h.rank, h.world_size, h.stats.rank


def test_the_identity_shuffler_reports_the_rank_within_its_group() -> None:
    # Once the global rank: 'rank 3 of 1'.
    assert run_workers(_identity, 4, timeout=120) == [(0, 1, 0), (0, 1, 0), (1, 1, 1), (1, 1, 1)]


def _uneven_membership(rank: int, world: int) -> str:
    """Rank 0 holds one more group than rank 2 (it is in [0, 1]); both shuffle over [0, 2]."""
    dist.new_group([0, 1])
    dp = _groups([[0, 2], [1, 3]], rank)
    sh = BatchShuffler(token_count, timeout=3)
    return _outcome(sh, lambda: _shuffled(sh, rank, dp, seed=7), catch=Exception)  # a ShuffleAbortedError


def test_uneven_group_membership_is_explained_when_the_groups_cannot_meet() -> None:
    # torch's naming (pytorch#173608) stays; the setup error once blamed a peer that
    # 'never started its first shuffle' and nothing else.
    outs = run_workers(_uneven_membership, 4, timeout=120)
    for r in (0, 2):
        assert "whose global ranks are [0, 2]); over a subgroup this also happens where its ranks hold " \
               "different numbers of process groups" in outs[r], outs[r]
        # Both reached the setup (the store says so): no peer is blamed.
        assert "every rank reported that the groups could not be created" in outs[r], outs[r]
