"""BalancedLoader on real gloo ranks (forkserver), plus its single-process paths.

Every sample carries a unique id per epoch (``_sid``) in its KJT values and
weights, its dense row and its label, so a test can follow it across ranks and
check that each arrives exactly once and intact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer import BalancedLoader, BaseBatch, BatchShuffler, TokenBatch, pad_batch
from balancer.testing import HostReadRecorder, run_workers
from tests.test_shuffler import rows
from tests.test_tokens import token_batch, token_rows

B = 4
# The partition in the shuffler's thread: the same partition as in the default
# child process (tests/test_shuffler.py), without a process start per loader.
FAST: dict[str, Any] = {"executor": "thread"}


@dataclasses.dataclass(kw_only=True)
class IdBatch(BaseBatch):
    dense: torch.Tensor  # [B, 2] float64: (id, -id)


def _sid(epoch: int, rank: int, step: int, i: int) -> int:
    return 1 + epoch * 1_000_000 + rank * 10_000 + step * 100 + i


def make(epoch: int, rank: int, step: int, n: int, weights: bool = True) -> IdBatch:
    """``n`` real samples (no padding); lengths grow with the rank (imbalance)."""
    rng = np.random.default_rng([epoch, rank, step])
    ids = [_sid(epoch, rank, step, i) for i in range(n)]
    lens = rng.integers(0, 2 + 6 * rank, size=(2, n))
    vals = [ids[i] * 1000 + 100 * k + p for k in range(2) for i in range(n) for p in range(lens[k, i])]
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor(vals, dtype=torch.int64),
                            weights=torch.tensor(vals, dtype=torch.float64) / 7 if weights else None,
                            lengths=torch.from_numpy(lens.reshape(-1)))
    t = torch.tensor(ids, dtype=torch.float64)
    return IdBatch(features=kjt, batch_size=n, feature_to_max_seqlen={"a": 16}, labels=t.clone(),
                   dense=torch.stack([t, -t], dim=1))


def padding() -> IdBatch:
    """An all-padding batch of the layout of ``make``'s."""
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.zeros(0, dtype=torch.int64),
                            weights=torch.zeros(0, dtype=torch.float64),
                            lengths=torch.zeros(2 * B, dtype=torch.int64))
    return IdBatch(features=kjt, batch_size=B, feature_to_max_seqlen={"a": 16},
                   labels=torch.zeros(B, dtype=torch.float64), dense=torch.zeros(B, 2, dtype=torch.float64),
                   actual_batch_size=0)


def cost(batch: BaseBatch) -> torch.Tensor:
    f = batch.features
    return (f.lengths().view(2, batch.batch_size).sum(0) + 1) ** 2


class Source:
    """One rank's loader: ``counts[epoch % len]`` batches, the last one incomplete
    (``B - 1`` samples); which samples come when depends on the epoch (as with a
    seeded sampler)."""

    def __init__(self, rank: int, counts: list[int], fail_at: int | None = None) -> None:
        self.rank, self.counts, self.fail_at, self.epoch = rank, counts, fail_at, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[IdBatch]:
        n = self.counts[self.epoch % len(self.counts)]
        order = np.random.default_rng([self.epoch, self.rank]).permutation(n).tolist()
        for step, k in enumerate(order):
            if step == self.fail_at:
                raise KeyError(f"sample file {k} is missing")
            yield make(self.epoch, self.rank, k, B - 1 if step == n - 1 else B)


def check_batch(batch: BaseBatch) -> list[int]:
    """The real ids of ``batch`` after checking that every field is intact and padding is zero."""
    assert batch.batch_size == B
    a = int(batch.actual_batch_size or 0)
    ids = batch.dense[:, 0].tolist()  # type: ignore[attr-defined]
    assert batch.dense[:, 1].tolist() == [-x for x in ids]  # type: ignore[attr-defined]
    assert batch.labels.tolist() == ids  # type: ignore[union-attr]
    assert all(x == 0 for x in ids[a:]), ids
    f = batch.features
    lens = f.lengths().view(2, B).tolist()
    vals, wts, off = f.values().tolist(), f.weights().tolist(), 0
    for k in range(2):
        for i in range(B):
            seg = vals[off : off + lens[k][i]]
            assert all(v // 1000 == ids[i] and v % 1000 // 100 == k for v in seg), (k, i, seg, ids)
            assert wts[off : off + lens[k][i]] == [v / 7 for v in seg]
            off += lens[k][i]
    return [int(x) for x in ids[:a]]


def real_ids(batches: Any) -> list[int]:
    return [int(x) for b in batches for x in b.dense[: b.actual_batch_size, 0].tolist()]


# ------------------------------------------------- conservation, reference
COUNTS = [[3, 5, 2], [4, 1, 4]]  # batches per rank, per epoch


def _conservation_worker(rank: int, w: int) -> dict[str, Any]:
    src = Source(rank, [c[rank] for c in COUNTS])
    out: dict[str, Any] = {"epochs": [], "ahead": {}, "source": []}
    # Epoch 1 of rank 1 is one incomplete batch: its pass needs batch_size (the
    # first batch's is learned per pass, as in a resumed run).
    with BalancedLoader(src, cost, ahead=2, batch_size=B) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            got = [(check_batch(b), loader.stats) for b in loader]
            assert loader.state_dict() == {"epoch": epoch, "consumed": len(got), "world_size": w}
            out["epochs"].append([ids for ids, _ in got])
            for _, s in got:
                assert s is not None and s.max_after <= s.max_before + 1e-9
            # Reference: the shuffler on the same steps (padding once exhausted),
            # as the in-pipeline shuffler would see them.
            ref = BatchShuffler(cost)
            batches = list(src)
            out["source"].append(real_ids(batches))
            for step, (ids, stats) in enumerate(got):
                x = pad_batch(batches[step], B) if step < len(batches) else padding()
                h = ref.start_shuffle_async(x)
                y = ref.finish_shuffle(x, h)
                assert check_batch(y) == ids, (epoch, step)
                assert (h.stats.load_before, h.stats.load_after) == (stats.load_before, stats.load_after)
            ref.close()
    src.set_epoch(1)
    for ahead in (0, 1, 2):
        with BalancedLoader(src, cost, ahead=ahead, batch_size=B, **FAST) as loader:
            loader.set_epoch(1)
            out["ahead"][ahead] = [rows(b) for b in loader]
    return out


def _empty_step_worker(rank: int, w: int) -> tuple[list[list[int]], int]:
    from balancer._comm import held_groups

    # Every rank's loader yields a batch of padding only at step 1, then more data:
    # no rank is exhausted there, so the pass goes on (the exhausted flag decides,
    # not the missing real samples).
    batches = [make(0, rank, 0, B), padding(), make(0, rank, 2, B - rank)]
    before = held_groups()
    with BalancedLoader(batches, cost, batch_size=B, **FAST) as loader:
        groups = (held_groups() or 0) - (before or 0)
        got = [check_batch(b) for b in loader]
    return got, groups


def _own_group_worker(rank: int, w: int) -> tuple[list[list[int]], list[bool]]:
    import torch.distributed as dist

    from balancer import _comm

    # Phase 2 of a device batch goes to the caller's group (NCCL) in a training loop's
    # shuffle; routed there for every batch here, as if these were device batches.
    _comm.ShuffleGroups.phase2_group = lambda self, device: self.user  # type: ignore[method-assign]
    on_callers: list[bool] = []
    real = dist.all_to_all_single

    def recording(*args: Any, group: Any = None, **kwargs: Any) -> Any:
        on_callers.append(group is None or group is dist.group.WORLD)
        return real(*args, group=group, **kwargs)

    dist.all_to_all_single = recording  # type: ignore[assignment]
    batches = [make(0, rank, 0, B), make(0, rank, 1, B - 2 * rank)]
    with BalancedLoader(batches, cost, batch_size=B, **FAST) as loader:
        got = [check_batch(b) for b in loader]
    return got, on_callers


def test_the_loader_never_moves_samples_on_the_callers_group() -> None:
    # Its shuffles run on the loader's own thread: a device batch's phase 2 on the
    # caller's NCCL group there could be paired with the training thread's collectives.
    res = run_workers(_own_group_worker, 2, timeout=120)
    assert sorted(i for got, _ in res for ids in got for i in ids) == sorted(
        _sid(0, r, s, i) for r in range(2) for s, n in enumerate((B, B - 2 * r)) for i in range(n))
    assert all(calls and not any(calls) for _, calls in res), [calls for _, calls in res]


def test_a_step_of_padding_on_every_rank_does_not_end_the_pass() -> None:
    outs = run_workers(_empty_step_worker, 2, timeout=120)
    for got, groups in outs:
        assert len(got) == 3 and got[1] == [], got
        assert groups == 2, "the shuffler's two gloo groups, no stop-signal group of the loader's own"
    ids = sorted(i for got, _ in outs for step in got for i in step)
    assert ids == sorted(_sid(0, r, s, i) for r in range(2) for s, n in ((0, B), (2, B - r)) for i in range(n))


def test_every_sample_once_per_epoch_matches_the_shuffler_and_ahead() -> None:
    w = 3
    outs = run_workers(_conservation_worker, w, timeout=120)
    for epoch in range(3):
        per_rank = [o["epochs"][epoch] for o in outs]
        counts = COUNTS[epoch % 2]
        assert {len(p) for p in per_rank} == {max(counts)}, "every rank yields as many batches"
        got = Counter(i for p in per_rank for ids in p for i in ids)
        drawn = sorted(i for o in outs for i in o["source"][epoch])
        assert len(drawn) == sum(B * c - 1 for c in counts if c)
        assert sorted(got.elements()) == drawn, epoch  # each exactly once
    for o in outs:
        assert o["ahead"][0] == o["ahead"][1] == o["ahead"][2]


# ---------------------------------------------------------- TokenBatch
TOKEN_COUNTS = [3, 1, 2]  # batches per rank: uneven, so ranks run out at different steps


PADS = {"input_ids": -100, "pos3": 7}


def _token_source(rank: int, packed: bool, pads: bool = False) -> Iterator[TokenBatch]:
    n = TOKEN_COUNTS[rank]
    for step in range(n):  # the last batch is incomplete; ids 1 + (10 * rank + step) * 1000 + i
        size = B - 1 if step == n - 1 else B
        batch = token_batch(10 * rank + step, size, size, seed=step, packed=packed)
        yield dataclasses.replace(batch, pad_values=PADS) if pads else batch


def _unpadded(b: TokenBatch) -> TokenBatch:
    """``b`` with its padding checked to hold ``PADS``, then zeroed (as ``token_rows`` wants)."""
    mask = b.attention_mask()
    tokens = {}
    for name, t in b.tokens.items():
        pad = ~mask.view(*mask.shape, *([1] * (t.dim() - 2))).expand_as(t)
        assert t[pad].eq(PADS[name]).all(), name
        tokens[name] = t.masked_fill(pad, 0)
    return dataclasses.replace(b, tokens=tokens)


def _token_loader_worker(rank: int, w: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for packed, pads in ((False, False), (True, False), (False, True)):
        drawn = [r for b in _token_source(rank, packed) for r in token_rows(b)]
        got, sizes = [], []
        with BalancedLoader(list(_token_source(rank, packed, pads)), lambda b: (b.seq_lens + 1) ** 2,
                            batch_size=B, **FAST) as loader:  # rank 1's only batch is incomplete
            for _ in range(2):  # two passes: the padding template is rebuilt per pass
                for b in loader:
                    assert isinstance(b, TokenBatch) and b.packed == packed
                    sizes.append(b.batch_size)
                    got.append(token_rows(_unpadded(b) if pads else b))
        out["pads" if pads else packed] = (drawn, got, sizes)
    # A rank with no batch at all reports it through a carrier of another kind: the same error everywhere.
    empty = [] if rank == 2 else list(_token_source(rank, False))
    with BalancedLoader(empty, lambda b: (b.seq_lens + 1) ** 2, batch_size=B, **FAST) as loader:
        out["empty"] = _outcome(loader)[:3]
    return out


def test_token_batches_every_sample_once_per_pass() -> None:
    # A TokenBatch loader used to fail at the end of every pass: the padding
    # template was built for BaseBatch only.
    outs = run_workers(_token_loader_worker, len(TOKEN_COUNTS), timeout=120)
    for packed in (False, True, "pads"):  # "pads": padded, padding positions hold pad_values
        drawn = sorted(r for o in outs for r in o[packed][0])
        assert len(drawn) == sum(B * c - 1 for c in TOKEN_COUNTS)
        steps = max(TOKEN_COUNTS)
        for o in outs:
            assert o[packed][2] == [B] * 2 * steps, o[packed][2]  # every rank yields the same count, padded
        for p in range(2):
            got = sorted(r for o in outs for batch in o[packed][1][p * steps:(p + 1) * steps] for r in batch)
            assert got == drawn, (packed, p)  # each exactly once per pass
    for o in outs:
        n, kind, msg = o["empty"]
        assert (n, kind) == (0, "ValueError") and "yielded no batch before step 0" in msg, o["empty"]
        assert "rank(s) [2]" in msg and msg == outs[0]["empty"][2]


# --------------------------------------------------------------- resume
RESUME_COUNTS = [[3, 2], [2, 4]]


def _resume_worker(rank: int, w: int) -> dict[str, Any]:
    src = Source(rank, [c[rank] for c in RESUME_COUNTS])

    def run(loader: BalancedLoader[IdBatch], epochs: range, limit: int | None = None) -> list[Any]:
        got: list[Any] = []
        for epoch in epochs:
            loader.set_epoch(epoch)
            for b in loader:
                got.append((epoch, rows(b)))
                if limit is not None and len(got) == limit:
                    return got
        return got

    with BalancedLoader(src, cost, ahead=2) as loader:
        full = run(loader, range(2))
    cases = {}
    for k in (0, 1, 3, 4, len(full)):  # start, mid-epoch, the epoch's end, the next epoch, the end
        with BalancedLoader(src, cost, ahead=1 + k % 2, **FAST) as first:
            head = run(first, range(2), limit=k)
            state = first.state_dict()
        with BalancedLoader(src, cost, ahead=2 - k % 2, **FAST) as second:
            second.load_state_dict(state)
            tail = run(second, range(state["epoch"], 2))
        cases[k] = (head + tail == full, state)
    return {"n": len(full), "cases": cases}


def test_resume_after_k_batches_matches_an_uninterrupted_run() -> None:
    outs = run_workers(_resume_worker, 2, timeout=120)
    for o in outs:
        assert o["n"] == 3 + 4  # max batches per epoch over ranks
        for k, (same, state) in o["cases"].items():
            assert same, (k, state)
    assert outs[0]["cases"] == outs[1]["cases"]


# --------------------------------------------------------------- errors
def _outcome(loader: BalancedLoader[Any]) -> tuple[int, str, str, list[str]]:
    """Batches yielded before the error, its type and text, and its cause chain."""
    n = 0
    try:
        for _ in loader:
            n += 1
    except Exception as e:  # noqa: BLE001 - compared across ranks
        chain, c = [], e.__cause__
        while c is not None:
            chain.append(type(c).__name__)
            c = c.__cause__
        return n, type(e).__name__, str(e), chain
    return n, "ok", "", []


class _Odd:
    """Rank ``odd``'s step 1 is replaced by ``fn(batch)``."""

    def __init__(self, src: Source, odd: bool, fn: Any) -> None:
        self.src, self.odd, self.fn = src, odd, fn

    def __iter__(self) -> Iterator[Any]:
        for step, b in enumerate(self.src):
            yield self.fn(b) if self.odd and step == 1 else b


class _IterFails:
    def __iter__(self) -> Iterator[Any]:
        raise OSError("shard file not found")


def _error_worker(rank: int, w: int, group_size: int | None) -> dict[str, Any]:
    odd = rank == w - 1
    src = Source(rank, [4])
    cases = {
        "loader_raises": Source(rank, [4], fail_at=1 if odd else None),
        "no_weights": _Odd(src, odd, lambda b: make(0, rank, 1, B, weights=False)),
        "batch_size": _Odd(src, odd, lambda b: make(0, rank, 1, B + 1)),
        "not_a_batch": _Odd(src, odd, lambda b: {"x": 1}),
        "empty_loader": Source(rank, [0 if odd else 3]),
        "iter_raises": _IterFails() if odd else Source(rank, [3]),
    }
    out = {}
    for name, source in cases.items():
        with BalancedLoader(source, cost, timeout=30.0, group_size=group_size, **FAST) as loader:
            out[name] = _outcome(loader)
    with BalancedLoader(src, cost, group_size=group_size, **FAST) as loader:
        out["after"] = _outcome(loader)
    return out


@pytest.mark.parametrize("group_size", [None, 2])  # 2: groups of 2 and 1 ranks
def test_bad_input_or_loader_failure_on_one_rank_raises_on_every_rank(group_size: int | None) -> None:
    w = 3
    outs = run_workers(_error_worker, w, group_size, timeout=120)
    expect = {
        # Once reported as "workload_fn raised WrappedLoaderError: ...", blaming the wrong callable.
        "loader_raises": "invalid shuffle input on rank(s) [2]: the wrapped loader raised KeyError at step 1: "
                         "'sample file",
        "no_weights": "'features.weights dtype': ranks [0, 1]: 'torch.float64'; rank 2: 'absent'",
        "batch_size": "the wrapped loader yielded a batch of batch_size=5 at step 1, more than BalancedLoader's "
                      "batch_size=4",
        "not_a_batch": "batch is a dict, expected a BaseBatch or a TokenBatch (rank 2)",
        "empty_loader": "the wrapped loader yielded no batch before step 0",
        "iter_raises": "the wrapped loader raised OSError at step 0: shard file not found",
    }
    for rank, out in enumerate(outs):
        assert out["after"][:2] == (4, "ok"), out["after"]
        for name, text in expect.items():
            n, kind, msg, chain = out[name]
            assert kind == "ValueError" and text in msg and "rank(s) [2]" in msg, (rank, name, msg)
            assert msg == outs[0][name][2], (rank, name)  # the same text everywhere
            assert n == (0 if name in ("empty_loader", "iter_raises") else 1), (rank, name, n)
        if rank == w - 1:  # the failing rank's error chains to its loader's exception
            assert out["loader_raises"][3] == ["WrappedLoaderError", "KeyError"]


def test_a_pass_without_a_batch_fails_in_one_process_as_on_many_ranks() -> None:
    # One process used to end such a pass silently (a smoke test passed where
    # torchrun raises); a pass that ends after some batches still just ends.
    with BalancedLoader(Source(0, [0, 3]), cost, **FAST) as loader:
        n, kind, msg, _ = _outcome(loader)
        assert (n, kind) == (0, "ValueError") and "the wrapped loader yielded no batch before step 0" in msg, msg
        loader.set_epoch(1)
        assert _outcome(loader)[:2] == (3, "ok")


class _Interrupted(Source):
    """``Source`` whose epoch 0 raises ``error`` (no ``Exception``) at step
    ``at``, or in ``iter()`` with ``at=None``."""

    def __init__(self, rank: int, error: BaseException | None, at: int | None) -> None:
        super().__init__(rank, [3])
        self.error, self.at = error, at

    def __iter__(self) -> Iterator[IdBatch]:
        if self.error is not None and self.epoch == 0 and self.at is None:
            raise self.error
        for step, b in enumerate(super().__iter__()):
            if self.error is not None and self.epoch == 0 and step == self.at:
                raise self.error
            yield b


INTERRUPTS: dict[str, tuple[BaseException, int | None, int]] = {  # error, step (None: iter()), ahead
    "CancelledError": (asyncio.CancelledError("loader cancelled"), 1, 0),
    "KeyboardInterrupt": (KeyboardInterrupt("stop"), 1, 2),
    "SystemExit": (SystemExit(3), 2, 1),
    "GeneratorExit": (GeneratorExit("closed"), 1, 0),
    "KeyboardInterrupt in iter()": (KeyboardInterrupt("stop"), None, 2),
}


def _base_exception_worker(rank: int, w: int) -> dict[str, Any]:
    out = {}
    for name, (error, at, ahead) in INTERRUPTS.items():
        src = _Interrupted(rank, error if rank == w - 1 else None, at)
        with BalancedLoader(src, cost, ahead=ahead, timeout=10.0, **FAST) as loader:
            n, first = 0, ("ok", "")
            try:
                for b in loader:
                    check_batch(b)
                    n += 1
            except BaseException as e:  # noqa: BLE001 - compared across ranks
                first = (type(e).__name__, str(e))
            loader.set_epoch(1)
            again = [check_batch(b) for b in loader]
            out[name] = (n, first, again, real_ids(list(src)))
    return out


def test_a_base_exception_of_one_rank_s_loader_keeps_the_ranks_in_step() -> None:
    # It once ended that rank's pass outside the step's shuffle: its shuffles
    # fell one behind, and its next epoch's paired with the peers' pending
    # ones (same numbers, same layout): the peers' epoch yielded another
    # epoch's samples and that rank's were lost, with no error anywhere.
    w = 3
    outs = run_workers(_base_exception_worker, w, timeout=120)
    for name, (_, at, _) in INTERRUPTS.items():
        for rank, out in enumerate(outs):
            n, (kind, msg), _, _ = out[name]
            assert n == (at or 0), (name, rank, n)  # the batches before it
            if rank == w - 1:  # raised as itself: an interrupt or exit is not swallowed
                assert kind == name.split()[0], (name, kind, msg)
            else:
                assert kind == "ValueError" and f"the wrapped loader raised {name.split()[0]} at step " in msg, msg
                assert "rank(s) [2]" in msg and msg == outs[0][name][1][1], (name, rank, msg)
        # The next epoch: every rank in step, every sample of it exactly once.
        assert {len(o[name][2]) for o in outs} == {3}, name
        got = sorted(i for o in outs for ids in o[name][2] for i in ids)
        assert got == sorted(i for o in outs for i in o[name][3]), name


class _Sized:
    """Rank ``rank``'s loader: in epoch ``e``, batches of ``sizes[min(e, len - 1)]`` samples."""

    def __init__(self, rank: int, sizes: list[list[int]]) -> None:
        self.rank, self.sizes, self.epoch = rank, sizes, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[IdBatch]:
        for step, n in enumerate(self.sizes[min(self.epoch, len(self.sizes) - 1)]):
            yield make(self.epoch, self.rank, step, n)


SIZED = {  # per case, per rank: batch sizes per epoch (the last entry for every later epoch)
    "smaller epoch 0": [[[3], [4, 4, 3]]] * 2,
    "rank 1 starts incomplete": [[[4, 4], [4, 4, 3]], [[3, 4], [4, 4, 3]]],  # epoch 0: the layout error
}


def _sized_pass(loader: BalancedLoader[Any], epoch: int) -> tuple[str, list[Any], list[int], int | None]:
    """Outcome of a pass (error text or "ok"), its (batch_size, rows) per batch, its real ids, ``batch_size`` after."""
    loader.set_epoch(epoch)
    got: list[Any] = []
    ids: list[int] = []
    try:
        for b in loader:
            got.append((b.batch_size, rows(b)))
            ids += real_ids([b])
        outcome = "ok"
    except ValueError as e:
        outcome = str(e)
    return outcome, got, ids, loader.batch_size


def _batch_size_per_pass_worker(rank: int, w: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for case, sizes in SIZED.items():
        for given in (None, 3, 4):
            src = _Sized(rank, sizes[rank])
            with BalancedLoader(src, cost, batch_size=given, **FAST) as loader:
                passes = [_sized_pass(loader, e) for e in range(3)]
            with BalancedLoader(src, cost, batch_size=given, **FAST) as fresh:
                fresh.load_state_dict({"epoch": 1, "consumed": 0})
                resumed = _sized_pass(fresh, 1)
            src.set_epoch(1)
            out[case, given] = (passes, resumed, real_ids(list(src)))
    return out


def test_batch_size_is_learned_in_every_pass_unless_given() -> None:
    # It was learned once, in the first pass: a later pass of larger batches
    # (or one after a rank's incomplete first batch) failed on every rank, in
    # every later pass, where a loader resumed into it ran fine.
    outs = run_workers(_batch_size_per_pass_worker, 2, timeout=120)
    bad_layout = "'batch_size': rank 0: '4'; rank 1: '3'"
    too_large = "batch of batch_size=4 at step 0, more than BalancedLoader's batch_size=3"
    for out in outs:
        for (case, given), (passes, resumed, _) in out.items():
            sizes = SIZED[case][0][0]  # rank 0's epoch 0
            outcomes = [x[0] for x in passes]
            if given == 3:  # a given batch_size stays: batches of 4 fail in every pass, resumed or not
                assert all(too_large in o for o in [*outcomes[1:], resumed[0]]), (case, outcomes)
                assert passes[2][3] == 3
                continue
            if case == "rank 1 starts incomplete" and given is None:  # the documented layout error
                assert bad_layout in outcomes[0], outcomes
            else:  # its own size, or padded to the given one
                assert outcomes[0] == "ok" and {n for n, _ in passes[0][1]} == {given or sizes[0]}, outcomes
            assert outcomes[1:] == ["ok", "ok"], (case, given, outcomes)
            # A pass after others (a failed one too) yields what a loader resumed into it yields.
            assert resumed[:2] == passes[1][:2], (case, given)
            assert passes[1][3] == passes[2][3] == resumed[3] == 4 and {n for n, _ in passes[2][1]} == {4}
    for case, given in outs[0]:
        if given != 3:  # epoch 1: every sample exactly once
            drawn = sorted(i for o in outs for i in o[case, given][2])
            assert sorted(i for o in outs for i in o[case, given][0][1][2]) == drawn, (case, given)


# ----------------------------------------------- threads, host reads
def _loader_threads(prefix: str = "balancer-loader") -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def _wait_for_no_loader_thread(limit: float = 10.0, prefix: str = "balancer-loader") -> bool:
    deadline = time.monotonic() + limit
    while _loader_threads(prefix) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _loader_threads(prefix)


def _threads_worker(rank: int, w: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    src = Source(rank, [6])
    loader = BalancedLoader(src, cost, ahead=2)
    it = iter(loader)
    with HostReadRecorder() as reads:
        for _ in range(3):
            next(it)
    out["reads"] = list(reads.calls)
    loader.close()
    out["after_close"] = _loader_threads("balancer")  # the shuffler's thread too
    try:
        iter(loader)
        out["iter_closed"] = "ok"
    except RuntimeError as e:
        out["iter_closed"] = str(e)
    # Dropped mid-epoch without close(): garbage collection stops the thread.
    loader = BalancedLoader(src, cost, ahead=2, **FAST)
    it = iter(loader)
    next(it)
    del it, loader
    gc.collect()
    out["after_gc"] = _wait_for_no_loader_thread(prefix="balancer")
    # A new pass after a break restarts the epoch.
    with BalancedLoader(src, cost, ahead=1, **FAST) as loader:
        first = [check_batch(b) for _, b in zip(range(2), loader, strict=False)]
        again = [check_batch(b) for b in loader]
        out["restart"] = first == again[:2] and len(again) == 6
    out["after_with"] = _loader_threads("balancer")
    return out


def test_close_and_gc_stop_the_thread_and_next_reads_no_tensor() -> None:
    for out in run_workers(_threads_worker, 2, timeout=120):
        assert out["reads"] == [], out["reads"]
        assert out["after_close"] == [] and out["after_with"] == []
        assert out["iter_closed"] == "BalancedLoader is closed"
        assert out["after_gc"] is True
        assert out["restart"] is True


# ----------------------------------------------------- single process
def test_single_process_pads_the_last_batch_and_surfaces_loader_errors() -> None:
    src = Source(0, [3], fail_at=None)
    with BalancedLoader(src, cost, ahead=0, pin_memory=True) as loader:  # pins only with CUDA
        got = [check_batch(b) for b in loader]
        assert [len(g) for g in got] == [B, B, B - 1]
        assert loader.stats is not None and loader.stats.world_size == 1
        assert loader.batch_size == B
    failing = Source(0, [3], fail_at=2)
    loader = BalancedLoader(failing, cost, ahead=2)
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(ValueError, match="the wrapped loader raised KeyError") as info:
        next(it)
    assert isinstance(info.value.__cause__, Exception) and isinstance(info.value.__cause__.__cause__, KeyError)
    with pytest.raises(StopIteration):
        next(it)  # the failure ended the pass
    assert _loader_threads() == []
    del it, loader
    gc.collect()


def test_state_and_settings_are_validated() -> None:
    src = Source(0, [2])
    with pytest.raises(ValueError, match="ahead=-1, expected an int >= 0"):
        BalancedLoader(src, cost, ahead=-1)
    with pytest.raises(ValueError, match="batch_size=0"):
        BalancedLoader(src, cost, batch_size=0)
    with pytest.raises(ValueError, match="comm='x'"):
        BalancedLoader(src, cost, comm="x")
    with BalancedLoader(src, cost) as loader:
        with pytest.raises(ValueError, match="consumed=None"):
            loader.load_state_dict({"epoch": 0})
        loader.load_state_dict({"epoch": 3, "consumed": 1})
        assert src.epoch == 3  # forwarded to the wrapped loader
        assert len(list(loader)) == 1 and loader.state_dict() == {"epoch": 3, "consumed": 2, "world_size": 1}
        loader.set_epoch(4)
        assert len(list(loader)) == 2


def test_a_worker_exception_never_hangs_the_gc_path() -> None:
    # Unconsumed failure, dropped iterator: the thread still ends.
    loader = BalancedLoader(Source(0, [3], fail_at=0), cost)
    it = iter(loader)
    del it, loader
    gc.collect()
    assert _wait_for_no_loader_thread()


def test_state_after_set_epoch_starts_the_new_epoch() -> None:
    # state_dict() once reported the last pass's count under the new epoch, and
    # a resume from it skipped that many batches of the epoch not yet started.
    def run(state: dict[str, int] | None, epochs: range) -> list[list[int]]:
        with BalancedLoader(Source(0, [3, 2]), cost, **FAST) as loader:
            if state is not None:
                loader.load_state_dict(state)
            out = []
            for e in epochs:
                loader.set_epoch(e)
                out += [check_batch(b) for b in loader]
            return out

    full = run(None, range(3))
    with BalancedLoader(Source(0, [3, 2]), cost, **FAST) as loader:
        head = [check_batch(b) for b in loader]
        assert loader.state_dict() == {"epoch": 0, "consumed": 3, "world_size": 1}
        loader.set_epoch(1)
        state = loader.state_dict()
    assert state == {"epoch": 1, "consumed": 0, "world_size": 1}
    assert head + run(state, range(1, 3)) == full
    with BalancedLoader(Source(0, [3, 2]), cost, **FAST) as loader:
        loader.load_state_dict({"epoch": 1, "consumed": 1})
        assert loader.state_dict() == {"epoch": 1, "consumed": 1, "world_size": 1}  # the loaded point, before any pass
        loader.set_epoch(1)
        assert loader.state_dict() == {"epoch": 1, "consumed": 1, "world_size": 1}  # the same epoch keeps it
        loader.set_epoch(2)
        assert loader.state_dict() == {"epoch": 2, "consumed": 0, "world_size": 1}


class _EpochBatchSampler:
    """A batch sampler with its own ``set_epoch`` and no ``sampler`` (length bucketing)."""

    def __init__(self) -> None:
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        order = np.random.default_rng(self.epoch).permutation(2 * B).tolist()
        return iter([order[:B], order[B:]])

    def __len__(self) -> int:
        return 2


class _EpochIterable(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.epoch * 100, self.epoch * 100 + 2 * B))


def _collate(ids: list[int]) -> IdBatch:
    t = torch.tensor(ids, dtype=torch.float64) + 1
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.zeros(0, dtype=torch.int64),
                            weights=torch.zeros(0, dtype=torch.float64),
                            lengths=torch.zeros(2 * len(ids), dtype=torch.int64))
    return IdBatch(features=kjt, batch_size=len(ids), feature_to_max_seqlen={"a": 16}, labels=t.clone(),
                   dense=torch.stack([t, -t], dim=1))


def test_set_epoch_reaches_a_batch_sampler_and_an_iterable_dataset() -> None:
    # Only the loader, its sampler and the batch sampler's sampler were asked once:
    # these two kept epoch -1 and yielded the same order every epoch.
    data = torch.utils.data
    bs = _EpochBatchSampler()
    by_sampler = data.DataLoader(list(range(2 * B)), batch_sampler=bs, collate_fn=_collate)
    ds = _EpochIterable()
    by_dataset = data.DataLoader(ds, batch_size=B, collate_fn=_collate)
    for source, target in ((by_sampler, bs), (by_dataset, ds)):
        with BalancedLoader(source, cost, **FAST) as loader:
            epochs = []
            for e in (3, 4):
                loader.set_epoch(e)
                assert target.epoch == e
                epochs.append(real_ids(loader))
            assert epochs[0] != epochs[1] and len(epochs[0]) == 2 * B


def test_a_batch_larger_than_batch_size_is_an_error() -> None:
    # It once went through as it was (every rank's batches equally large, so the
    # shuffle saw nothing wrong) while loader.batch_size said 2.
    with (BalancedLoader(Source(0, [3]), cost, batch_size=2, **FAST) as loader,
          pytest.raises(ValueError, match=r"yielded a batch of batch_size=4 at step 0, more than "
                                          r"BalancedLoader's batch_size=2")):
        next(iter(loader))


def _empty_pass_worker(rank: int, w: int) -> dict[str, str]:
    counts = [[2, 2], [2, 0]][rank]  # rank 1's loader yields nothing in epoch 1
    out = {}
    with BalancedLoader(Source(rank, counts), cost, **FAST) as loader:
        out["epoch 0"] = _outcome(loader)[1]
        loader.set_epoch(1)
        out["after epoch 0"] = _outcome(loader)[1]
    with BalancedLoader(Source(rank, counts), cost, **FAST) as loader:
        loader.load_state_dict({"epoch": 1, "consumed": 0})
        out["resumed"] = _outcome(loader)[1]
    return out


def test_a_pass_without_batches_on_a_rank_fails_alike_after_a_restart() -> None:
    # Epoch 1 once ran on the padding layout left by epoch 0, and failed only when
    # resumed into: the same state gave two outcomes.
    for out in run_workers(_empty_pass_worker, 2, timeout=120):
        assert out["epoch 0"] == "ok", out
        assert out["after epoch 0"] == out["resumed"] == "ValueError", out


class _SlowFrom(Source):
    """``Source`` whose batches from step ``slow_from`` on take 2 s to read."""

    def __init__(self, rank: int, counts: list[int], slow_from: int) -> None:
        super().__init__(rank, counts)
        self.slow_from = slow_from

    def __iter__(self) -> Iterator[IdBatch]:
        for step, b in enumerate(super().__iter__()):
            if step >= self.slow_from:
                time.sleep(2)
            yield b


def _ctrl_c_in_next(rank: int, world: int) -> dict[str, Any]:
    """Ctrl-C lands in rank 0's training step and in rank 1's next(), both after 2 batches."""
    loader = BalancedLoader(_SlowFrom(rank, [8], 2), cost, ahead=1, timeout=30.0, **FAST)
    consumed = 0
    try:
        for _ in loader:
            consumed += 1
            if consumed == 2:
                if rank == 0:
                    raise KeyboardInterrupt
                threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
    except KeyboardInterrupt:
        pass
    t0 = time.perf_counter()
    loader.close()
    took = time.perf_counter() - t0
    time.sleep(6 if rank == 0 else 0)  # rank 0 lives on (saving a checkpoint, say)
    return {"consumed": consumed, "close_s": took}


def test_a_ctrl_c_inside_next_does_not_leave_close_waiting_for_a_peer() -> None:
    # Once the interrupted next() kept the credit it had granted: rank 1's producer ran a
    # shuffle rank 0 never joined, and its close() waited until rank 0's process exited
    # (up to the timeout).
    outs = run_workers(_ctrl_c_in_next, 2, timeout=120)
    assert [o["consumed"] for o in outs] == [2, 2]
    assert all(o["close_s"] < 5 for o in outs), outs


def _close_interrupted(rank: int, world: int) -> dict[str, Any]:
    loader = BalancedLoader(_SlowFrom(rank, [6], 1), cost, ahead=1, timeout=30.0, **FAST)
    it = iter(loader)
    next(it)  # the producer now reads the slow second batch
    threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
    try:
        loader.close()
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    loader.close()  # again: finishes the job
    time.sleep(0.5)
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("balancer"))
    return {"interrupted": interrupted, "alive": alive}


def test_close_interrupted_by_ctrl_c_finishes_when_called_again() -> None:
    # Once the first close() marked the loader closed before joining the producer: the
    # retry returned at once, and the shuffler's thread and partition child leaked.
    for out in run_workers(_close_interrupted, 2, timeout=120):
        assert out == {"interrupted": True, "alive": []}, out


def _resume_elsewhere(rank: int, world: int) -> str:
    with BalancedLoader(Source(rank, [4]), cost, **FAST) as loader:
        assert loader.state_dict() == {"epoch": 0, "consumed": 0, "world_size": world}
        try:
            loader.load_state_dict({"epoch": 0, "consumed": 1, "world_size": 3})
        except ValueError as e:
            return str(e)
    return ""


def test_a_state_saved_by_another_number_of_ranks_is_refused() -> None:
    # Once loaded silently: 2 -> 3 ranks lost 8 samples and repeated 2.
    for msg in run_workers(_resume_elsewhere, 2, timeout=120):
        assert msg.startswith("BalancedLoader.load_state_dict: world_size=3, expected 2 (the state was saved by "
                              "another number of ranks"), msg


class _SlowToStart(Source):
    def __iter__(self) -> Iterator[IdBatch]:
        time.sleep(0.3)  # e.g. a DataLoader starting its workers
        return super().__iter__()


def test_passes_started_from_two_threads_leave_no_producer_behind() -> None:
    # Once both threads' iter() started a producer and the loader kept only the last:
    # the other was never stopped (alive after close()) and could take a sample from a pass.
    before = set(threading.enumerate())  # other tests' threads may still be winding down
    loader = BalancedLoader(_SlowToStart(0, [3]), cost, **FAST)
    start = threading.Barrier(2)
    kept, counts, errors = [], [], []  # the iterators stay referenced (dropping one stops its producer)

    def one_pass() -> None:
        start.wait()
        try:
            it = iter(loader)
            kept.append(it)
            counts.append(sum(1 for _ in it))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one_pass) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loader.close()
    time.sleep(0.2)
    # One pass ends the other (as a second iter() in one thread does); the later runs whole.
    assert errors == [] and max(counts) == 3, (errors, counts)
    assert [t.name for t in set(threading.enumerate()) - before if t.name.startswith("balancer")] == []


class _SlowEnd(Source):
    def __iter__(self) -> Iterator[IdBatch]:
        time.sleep(0.3)
        yield from super().__iter__()
        time.sleep(1.0)  # the end of the pass takes a while to notice


def test_a_pass_ending_on_one_thread_leaves_the_next_pass_alone() -> None:
    # Once the thread whose pass ended stopped whichever pass was current by then: the one
    # another thread had just started yielded 1 of its 2 batches and a plain StopIteration.
    loader = BalancedLoader(_SlowEnd(0, [2]), cost, ahead=0, **FAST)
    first = iter(loader)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.extend(first))
    t.start()
    time.sleep(0.6)  # the thread has its batches and waits for the (slow) end
    second = list(iter(loader))
    t.join()
    loader.close()
    assert len(second) == 2


def _interrupted_then_continued(rank: int, world: int) -> dict[str, Any]:
    """ahead=0: rank 0's third next() is interrupted (its step is running), then retried."""
    loader = BalancedLoader(_SlowFrom(rank, [8], 2), cost, ahead=0, timeout=30.0, **FAST)
    it = iter(loader)
    got = [next(it), next(it)]
    if rank == 0:
        threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        try:
            got.append(next(it))
        except KeyboardInterrupt:
            got.append(next(it))  # carry on with the same iterator
    else:
        got.append(next(it))
    t0 = time.perf_counter()
    loader.close()
    took = time.perf_counter() - t0
    time.sleep(6 if rank == 1 else 0)
    return {"consumed": len(got), "close_s": took}


def test_a_retried_next_does_not_grant_twice() -> None:
    # With ahead=0 the interrupted next()'s credit was in use and could not be taken back;
    # the retried next() once granted another, so rank 0's producer ran a shuffle rank 1
    # never joined and close() waited until rank 1's process exited.
    outs = run_workers(_interrupted_then_continued, 2, timeout=120)
    assert [o["consumed"] for o in outs] == [3, 3]
    assert all(o["close_s"] < 5 for o in outs), outs


def _close_from_a_signal_handler(rank: int, world: int) -> dict[str, Any]:
    loader = BalancedLoader(_SlowFrom(rank, [6], 1), cost, ahead=1, **FAST)
    it = iter(loader)
    next(it)  # the producer now reads the slow second batch
    signal.signal(signal.SIGUSR1, lambda *_: loader.close())  # e.g. a preemption handler
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    try:
        iter(loader)  # ends the first pass: waits for its credited step; closed meanwhile
        outcome = "new pass"
    except RuntimeError as e:
        outcome = str(e)
    time.sleep(0.3)
    return {"outcome": outcome, "alive": [t.name for t in threading.enumerate() if t.name.startswith("balancer")]}


def test_close_from_a_signal_handler_while_a_pass_ends() -> None:
    # Once the handler's close() emptied the list of passes being ended under the outer
    # call: IndexError from iter(); before that, iter() started a pass on a closed loader.
    assert run_workers(_close_from_a_signal_handler, 1, timeout=120) == [
        {"outcome": "BalancedLoader is closed", "alive": []}]


def _close_on_the_producer_thread(rank: int, world: int) -> bool:
    armed = threading.Event()

    def collecting_cost(batch: BaseBatch) -> torch.Tensor:
        if armed.is_set() and threading.current_thread().name == "balancer-loader":
            armed.clear()
            gc.collect()  # a collection that allocations on this thread happen to trigger
        return cost(batch)

    loader = BalancedLoader(_SlowFrom(rank, [6], 1), collecting_cost, ahead=1, **FAST)

    class Owner:  # cyclic garbage whose finalizer closes the loader
        def __init__(self) -> None:
            self.me, self.loader = self, loader

        def __del__(self) -> None:
            self.loader.close()

    gc.disable()
    try:
        it = iter(loader)
        next(it)
        Owner()
        armed.set()
        closer = threading.Thread(target=loader.close, daemon=True)
        closer.start()  # takes the lock, waits for the producer's credited step
        closer.join(20)
        return not closer.is_alive()
    finally:
        gc.enable()


def test_close_run_by_a_finalizer_on_the_producer_thread_does_not_deadlock() -> None:
    # Once the finalizer's close() waited for the lock that the other thread's close() held
    # while waiting for this very producer.
    assert run_workers(_close_on_the_producer_thread, 1, timeout=120) == [True]


# ------------------------------------------- threads of ours and the CUDA device
def _device_per_thread_worker(rank: int, w: int) -> list[tuple[str, str, int]]:
    import contextlib
    import threading

    # CUDA's current device is per thread, and a new thread starts on device 0: on
    # a node of several GPUs, CUDA calls on a thread of ours (pinning, an event's
    # synchronize, the user's loader and workload_fn on the loader's thread) ran on
    # GPU 0 whatever device the training thread had set (a stray context on GPU 0
    # from every rank, or tensors on the wrong GPU). A fake device per thread stands
    # in for CUDA's here: a CPU machine has no second GPU to see it on.
    local = threading.local()
    current = lambda: getattr(local, "device", 0)  # noqa: E731

    def set_device(d: int) -> None:
        local.device = int(d)

    @contextlib.contextmanager
    def device(d: int) -> Iterator[None]:
        before, local.device = current(), int(d)
        try:
            yield
        finally:
            local.device = before

    seen: set[tuple[str, str, int]] = set()

    def note(what: str) -> None:
        seen.add((threading.current_thread().name, what, current()))

    torch.cuda.is_initialized = lambda: True  # type: ignore[assignment]
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.current_device = current  # type: ignore[assignment]
    torch.cuda.set_device = set_device  # type: ignore[assignment]
    torch.cuda.device = device  # type: ignore[assignment,misc]
    torch.Tensor.pin_memory = lambda self, *a, **k: (note("pin_memory"), self.clone())[1]  # type: ignore[method-assign]
    set_device(rank + 1)  # the training thread's torch.cuda.set_device(local_rank)

    def workloads(b: Any) -> Any:
        note("workload_fn")
        return cost(b)

    s = BatchShuffler(workloads, executor="thread")
    for step in range(2):
        b = make(0, rank, step, B)
        s.finish_shuffle(b, s.start_shuffle_async(b))
    s.close()
    with BalancedLoader(Source(rank, [3]), workloads, ahead=1, batch_size=B, pin_memory=True, **FAST) as loader:
        assert sum(1 for _ in loader) == 3
    return sorted(seen)


def test_threads_of_ours_use_the_callers_cuda_device() -> None:
    for rank, seen in enumerate(run_workers(_device_per_thread_worker, 2, timeout=120)):
        assert {"balancer-shuffle", "balancer-loader"} <= {name for name, _, _ in seen}, seen
        assert all(dev == rank + 1 for _, _, dev in seen), seen
