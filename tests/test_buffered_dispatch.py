"""Tests for balancer.buffered_dispatch.BufferedDispatcher: no loss, bounded lag, better rounds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from balancer.buffered_dispatch import BufferedDispatcher


def _stream(dist: str, rounds: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rounds):
        if dist == "zipf":
            out.append(np.minimum(rng.zipf(1.2, size), 4096).astype(np.int64))
        else:
            out.append(np.clip(np.rint(rng.lognormal(6.0, 1.0, size)), 1, 8192).astype(np.int64))
    return out


def _run(window: int, dist: str, padded: bool, rounds: int = 24) -> tuple[list[int], list[dict], int]:
    w, b = 4, 16
    size = w * b
    kw = {"padded": True, "micro_batch_size": 4} if padded else {}
    disp = BufferedDispatcher(w, b, window=window, **kw)
    sent: list[int] = []
    metrics = []
    for t, lens in enumerate(_stream(dist, rounds, size, 7)):
        disp.put(lens, ids=np.arange(t * size, (t + 1) * size) + 1000)
        while disp.ready():
            rnd = disp.next()
            ids = (rnd.ids - 1000).tolist()
            # The q-th sample goes out by round q // S + window - 1.
            assert all(rnd.round <= q // size + window - 1 for q in ids)
            assert rnd.max_lag <= window - 1
            # Per-rank ids are exactly the round's ids, each once.
            per_rank = np.concatenate([rnd.rank_ids(r) for r in range(w)])
            assert sorted(per_rank.tolist()) == sorted(rnd.ids.tolist())
            assert [len(rnd.rank_ids(r)) for r in range(w)] == [b] * w
            sent += ids
            metrics.append(rnd.plan.metrics())
    rest = disp.drain()
    sent += [int(i) - 1000 for r in rest for i in r.ids]
    return sent, metrics, disp.pending


@pytest.mark.parametrize("padded", [False, True])
def test_every_sample_once_and_lag_bounded(padded: bool) -> None:
    for window in (1, 3):
        sent, _, pending = _run(window, "lognormal", padded)
        assert pending == 0
        assert sorted(sent) == list(range(24 * 64)), "no sample lost or sent twice"
    fifo, _, _ = _run(1, "lognormal", padded)
    assert fifo == list(range(24 * 64)) or sorted(fifo[:64]) == list(range(64)), "window=1 is FIFO"


def test_window_improves_padded_rounds_and_heavy_tail_balance() -> None:
    def mean(ms: list[dict], key: str) -> float:
        return float(np.mean([m[f"dispatch/{key}"] for m in ms]))

    _, one, _ = _run(1, "lognormal", True)
    _, four, _ = _run(4, "lognormal", True)
    assert mean(four, "padding_ratio") < mean(one, "padding_ratio") - 0.05
    assert mean(four, "imbalance") < mean(one, "imbalance")
    _, one, _ = _run(1, "zipf", False)
    _, four, _ = _run(4, "zipf", False)
    assert mean(four, "imbalance") <= mean(one, "imbalance")


def test_micro_batch_ids_and_flush() -> None:
    disp = BufferedDispatcher(2, 3, window=2, max_tokens=100)
    disp.put([10, 90, 20, 30, 40, 50, 60, 5])
    assert not disp.ready()
    rnd = disp.next(flush=True)
    mbs = [disp_ids.tolist() for r in range(2) for disp_ids in rnd.micro_batch_ids(r)]
    assert sorted(i for m in mbs for i in m) == sorted(rnd.ids.tolist())
    rest = disp.drain()
    assert [len(r.ids) for r in rest] == [2] and disp.pending == 0
    with pytest.raises(ValueError, match="0 samples buffered, a round needs 6"):
        disp.next(flush=True)


def test_errors() -> None:
    with pytest.raises(ValueError, match="padded=True needs micro_batch_size"):
        BufferedDispatcher(2, 4, padded=True)
    with pytest.raises(ValueError, match=r"window=0, expected an int >= 1 \(BufferedDispatcher\)"):
        BufferedDispatcher(2, 4, window=0)
    disp = BufferedDispatcher(2, 2)
    disp.put([1, 2], ids=[5, 6])
    with pytest.raises(ValueError, match=r"ids\[0\] = 5 is already buffered; ids must be unique among buffered "
                                         r"samples \(BufferedDispatcher.put\)"):
        disp.put([3], ids=[5])
    with pytest.raises(ValueError, match=r"ids\[2\] = 8 repeats ids\[0\]; ids must be unique"):
        disp.put([3, 4, 5], ids=[8, 9, 8])
    # micro_batch_size without padded once passed here and failed every round
    with pytest.raises(ValueError, match=r"BufferedDispatcher: micro_batch_size=2 bounds the rows of padded "
                                         r"micro-batches; pass padded=True or use max_tokens"):
        BufferedDispatcher(2, 2, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"2 samples buffered, a round needs 4 \(pass flush=True"):
        disp.next()
    with pytest.raises(ValueError, match=r"lengths\[0\] = -1, expected an integer >= 0"):
        disp.put([-1])
    disp.put([3, 4, 5], ids=[1, 2, 3])
    with pytest.raises(ValueError, match=r"ids\[0\] = 1.5, expected an integer"):
        disp.put([1], ids=[1.5])  # once truncated to 1, silently
    # Beyond +-2**62 ids were cast with wrap-around (uint64 2**64 - 1 became -1), and an
    # id of 2**63 - 1 made the next default ids overflow.
    for bad, shown in ((np.array([2**64 - 1], np.uint64), "18446744073709551615"), ([2**63 - 1], "9223372036854775807"),
                       (np.array([1e300]), "1e\\+300"), ([True], "True")):
        with pytest.raises(ValueError, match=rf"ids\[0\] = {shown}, expected an integer in \[-2\*\*62, 2\*\*62\)"):
            disp.put([1], ids=bad)
    with pytest.raises(ValueError, match=r"max_tokens=0, expected an int >= 1 \(BufferedDispatcher\)"):
        BufferedDispatcher(2, 2, max_tokens=0)
    with pytest.raises(ValueError, match=r"max_tokens=9223372036854775808, expected an int below 2\*\*63"):
        BufferedDispatcher(2, 2, max_tokens=2**63)
    assert BufferedDispatcher(2, 2, max_tokens=2**63 - 1) is not None  # the largest int64 is a budget
    # A sample over the budget was buffered, then failed every round as "sample 3"
    # of the round's subset, and stayed: no round could go out again.
    capped = BufferedDispatcher(2, 2, window=1, max_tokens=10)
    capped.put([4, 5], ids=[70, 71])
    with pytest.raises(ValueError, match=r"sample id 82 has 12 tokens, more than max_tokens=10: .*nothing of "
                                         r"this put\(\) was buffered"):
        capped.put([3, 12, 2], ids=[81, 82, 83])
    assert capped.pending == 2
    capped.put([3, 2], ids=[81, 83])
    rnd = capped.next()
    assert sorted(rnd.ids.tolist()) == [70, 71, 81, 83] and capped.pending == 0


@pytest.mark.parametrize("padded", [False, True])
def test_drain_sends_every_sample_even_fewer_than_ranks(padded: bool) -> None:
    # The leftover once raised ("1 samples for 2 ranks", or "not divisible by
    # world_size" when padded) and stayed in the buffer for good.
    kw = {"padded": True, "micro_batch_size": 2} if padded else {}
    for total in (3, 5, 9):
        disp = BufferedDispatcher(4, 2, window=1, **kw)
        disp.put(list(range(10, 10 + total)))
        rounds = disp.drain()
        assert disp.pending == 0
        sent = sorted(int(i) for rnd in rounds for r in range(4) for i in rnd.rank_ids(r))
        assert sent == list(range(total))
        last = rounds[-1]
        assert len(last.plan.ranks) == 4 and last.plan.loads.shape == (4,)
        empty = [r for r in range(4) if not last.plan.ranks[r]]
        assert len(empty) == max(0, 4 - (total % 8))  # fewer samples than ranks: the rest get none
        if padded:
            assert last.plan.micro_batches is not None
            assert all(last.plan.micro_batches[r] == [] for r in empty)


def test_drain_when_micro_batches_cannot_be_shared_evenly() -> None:
    # 7 one-row padded micro-batches for 3 ranks x 3: the last round once raised
    # "3 ranks x 3 micro-batches need 9 samples, only 7 given", then went to one
    # rank alone. Every rank now takes the same 3 passes, two of them empty.
    disp = BufferedDispatcher(3, 3, window=1, padded=True, micro_batch_size=1)
    disp.put([5, 9, 2, 7, 7, 1, 4])
    (rnd,) = disp.drain()
    assert disp.pending == 0
    assert sorted(int(i) for r in range(3) for i in rnd.rank_ids(r)) == list(range(7))
    mbs = rnd.plan.micro_batches
    assert mbs is not None and [len(rank) for rank in mbs] == [3, 3, 3]
    assert sorted(len(m) for rank in mbs for m in rank) == [0, 0] + [1] * 7
    for rank in mbs:  # the empty micro-batches come last
        real = [m for m in rank if m]
        assert rank == real + [[]] * (len(rank) - len(real))


@pytest.mark.parametrize("kw", [{"max_tokens": 100, "divisible_by": 2}, {"num_micro_batches": 2},
                                {"padded": True, "micro_batch_size": 1, "num_micro_batches": 2}])
def test_drain_sends_the_last_sample_with_fewer_samples_than_micro_batches(kw: dict[str, Any]) -> None:
    # 5 samples, rounds of 4: the last sample could never go out ("2 micro-batches
    # per rank but a rank has only 1 samples"), and the buffer kept it for good.
    disp = BufferedDispatcher(2, 2, window=1, **kw)
    disp.put([10, 20, 30, 40, 50])
    first = disp.next()
    (last,) = disp.drain()
    assert disp.pending == 0
    sent = sorted(int(i) for rnd in (first, last) for r in range(2) for i in rnd.rank_ids(r))
    assert sent == list(range(5))
    mbs = last.plan.micro_batches
    assert mbs is not None and [m for rank in mbs for m in rank if m] == [[0]]
    assert mbs[0] == [[0], []]  # one sample a micro-batch, the rest of the count empty


def test_an_empty_put_adds_nothing() -> None:
    # A producer with nothing new this round: put() once raised 'lengths is empty'.
    import torch

    disp, ref = BufferedDispatcher(2, 2, window=1), BufferedDispatcher(2, 2, window=1)
    disp.put([3, 1])
    for empty in ([], np.zeros(0, np.int64), torch.zeros(0, dtype=torch.int64)):
        disp.put(empty)
        disp.put(empty, ids=[])
    with pytest.raises(ValueError, match=r"ids has shape \(1,\), expected \(0,\) like lengths"):
        disp.put([], ids=[7])
    disp.put([4, 2])
    ref.put([3, 1, 4, 2])
    assert disp.pending == 4
    got, want = disp.next(), ref.next()
    assert got.ids.tolist() == want.ids.tolist() and got.plan.ranks == want.plan.ranks


def test_settings_a_round_cannot_take_are_refused() -> None:
    # groups=[0, 0, 1, 1] went to every round's plan_dispatch by position, so a
    # group's samples were split across rounds and ranks (236 of 240 rounds of a
    # GRPO-style loop); equal_count=False was ignored; a misspelt setting
    # failed only at the first round, with a TypeError.
    with pytest.raises(ValueError, match=r"groups=\[0, 0, 1, 1\] is not accepted: group ids are per sample, "
                                         r"and a round picks its samples from the window"):
        BufferedDispatcher(2, 2, groups=[0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"equal_count=False is not accepted: every rank gets samples_per_rank"):
        BufferedDispatcher(2, 2, equal_count=False)
    assert BufferedDispatcher(2, 2, equal_count=True) is not None  # the default, what every round does
    with pytest.raises(ValueError, match=r"max_token=5 is not accepted: expected one of cost, padded, "
                                         r"micro_batch_size, max_tokens, num_micro_batches"):
        BufferedDispatcher(2, 2, max_token=5)
