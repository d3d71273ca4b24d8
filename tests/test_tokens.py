"""`TokenBatch`: padded and packed token batches shuffled like KJT batches.

Every sample carries ids ``1 + rank * 1000 + i`` in its tokens (token ``t`` of
sample ``i``: ``id * 100 + t``) and its per-sample fields, so a test can follow
it; only valid tokens may arrive, padding must be zeros.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from balancer import TokenBatch
from balancer._layout import wire_layout
from balancer.shuffler import BatchShuffler
from balancer.testing import HostReadRecorder, run_workers
from tests.test_exchange import simulate


def token_batch(rank: int, b: int, real: int, seed: int, packed: bool, max_len: int = 9,
                pad_multiple: int = 1) -> TokenBatch:
    rng = np.random.default_rng([seed, rank])
    lens = np.zeros(b, np.int64)
    lens[:real] = rng.integers(0, max_len + 1, real)
    ids = [1 + rank * 1000 + i for i in range(b)]
    per_token = [[ids[i] * 100 + t for t in range(lens[i])] for i in range(b)]
    if packed:
        flat = [x for row in per_token for x in row]
        tokens = {"input_ids": torch.tensor(flat, dtype=torch.int64).reshape(-1),
                  "pos3": torch.tensor([[x, -x, 2 * x] for x in flat], dtype=torch.int32).reshape(-1, 3)}
    else:
        ids_t = torch.zeros(b, max_len, dtype=torch.int64)
        pos3 = torch.zeros(b, max_len, 3, dtype=torch.int32)
        for i, row in enumerate(per_token):
            ids_t[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
            pos3[i, : len(row)] = torch.tensor([[x, -x, 2 * x] for x in row], dtype=torch.int32).reshape(-1, 3)
        tokens = {"input_ids": ids_t, "pos3": pos3}
    reward = torch.tensor([float(ids[i]) if i < real else 0.0 for i in range(b)])
    return TokenBatch(batch_size=b, seq_lens=torch.from_numpy(lens), tokens=tokens, packed=packed,
                      samples={"reward": reward}, actual_batch_size=real, pad_multiple=pad_multiple)


def token_rows(batch: TokenBatch) -> list[tuple[Any, ...]]:
    """Every real sample as (id, valid tokens of each field, per-sample values); checks padding is zero."""
    lens = batch.seq_lens.tolist()
    out = []
    starts = np.concatenate([[0], np.cumsum(lens)])
    for i in range(batch.batch_size):
        fields = []
        for name, t in batch.tokens.items():
            data = t[starts[i] : starts[i + 1]] if batch.packed else t[i, : lens[i]]
            fields.append((name, tuple(data.reshape(-1).tolist())))
            if not batch.packed:
                assert not t[i, lens[i]:].any(), (name, i)  # padded slots are zero
        sample = tuple((n, tuple(v[i].reshape(-1).tolist())) for n, v in batch.samples.items())
        if i >= (batch.actual_batch_size or 0):
            assert lens[i] == 0 and not any(any(v) for _, v in sample), i
            continue
        out.append((tuple(fields), sample))
    return out


def test_token_batch_validates_shapes() -> None:
    ok = token_batch(0, 4, 3, seed=0, packed=False)
    assert ok.max_len == 9 and ok.attention_mask().sum().item() == int(ok.seq_lens.sum())
    assert token_batch(0, 4, 3, seed=0, packed=True).cu_seqlens().tolist()[-1] == int(ok.seq_lens.sum())
    for kwargs, text in (
        ({"batch_size": 0}, r"batch_size=0, expected an int >= 1"),
        ({"seq_lens": torch.zeros(3, dtype=torch.int64)}, r"seq_lens: shape \(3,\) and dtype torch.int64, expected"),
        ({"seq_lens": torch.zeros(4)}, r"seq_lens: shape \(4,\) and dtype torch.float32, expected an integer"),
        ({"tokens": {}}, "tokens is empty"),
        # a list was an AttributeError ('list' object has no attribute 'items')
        ({"tokens": [torch.zeros(4, 5)]}, r"tokens: a list, expected a dict of name -> tensor"),
        ({"samples": [torch.zeros(4)]}, r"samples: a list, expected a dict of name -> tensor"),
        ({"tokens": {0: torch.zeros(4, 5)}}, r"tokens: key 0 \(int\), expected str names"),
        ({"tokens": {"a": torch.zeros(4, 5), "b": torch.zeros(4, 6)}}, "different leading shapes"),
        ({"tokens": {"a": torch.zeros(3, 5)}}, r"tokens\['a'\]: shape \(3, 5\).*expected \[batch_size=4, L, ...\]"),
        ({"samples": {"r": torch.zeros(5)}}, r"samples\['r'\]: shape \(5,\).*expected \[batch_size=4, ...\]"),
        ({"actual_batch_size": 5}, "actual_batch_size=5, expected"),
        # accepted once (2.5, True) or a TypeError from a comparison ("2")
        ({"actual_batch_size": 2.5}, r"actual_batch_size=2.5, expected an int with 0 <= actual_batch_size"),
        ({"actual_batch_size": True}, "actual_batch_size=True, expected an int"),
        ({"actual_batch_size": "2"}, "actual_batch_size='2', expected an int"),
        ({"pad_multiple": 0}, "pad_multiple=0, expected an int >= 1"),
        # a misspelt field was a silent no-op, and -100 in a uint8 field would wrap
        ({"pad_values": {"label": -100}}, r"pad_values: key 'label' names no token field, expected one of \['a'\]"),
        ({"pad_values": [("a", 1)]}, "pad_values: a list, expected a dict"),
        ({"tokens": {"a": torch.zeros(4, 5, dtype=torch.uint8)}, "pad_values": {"a": -100}},
         r"pad_values\['a'\]=-100 \(int\), expected a Python number that tokens\['a'\]'s dtype torch.uint8 holds"),
        ({"tokens": {"a": torch.zeros(4, 5, dtype=torch.int64)}, "pad_values": {"a": 0.5}}, r"pad_values\['a'\]=0.5"),
        ({"tokens": {"a": torch.zeros(4, 5, dtype=torch.int64)}, "pad_values": {"a": True}}, r"pad_values\['a'\]=True"),
        ({"tokens": {"a": torch.zeros(4, 5, dtype=torch.bool)}, "pad_values": {"a": 0}}, r"pad_values\['a'\]=0"),
        ({"tokens": {"a": torch.zeros(4, 5, dtype=torch.float16)}, "pad_values": {"a": 1e5}}, r"pad_values\['a'\]=100000.0"),
        ({"pad_values": {"a": torch.tensor(1.0)}}, r"pad_values\['a'\]=tensor\(1.\) \(Tensor\)"),
    ):
        args = dict(batch_size=4, seq_lens=torch.zeros(4, dtype=torch.int64), tokens={"a": torch.zeros(4, 5)})
        args.update(kwargs)
        with pytest.raises(ValueError, match=text):
            TokenBatch(**args)  # type: ignore[arg-type]
    numpy_count = TokenBatch(batch_size=4, seq_lens=torch.zeros(4, dtype=torch.int64), tokens={"a": torch.zeros(4, 5)},
                             actual_batch_size=np.int64(3))  # type: ignore[arg-type]
    assert numpy_count.actual_batch_size == 3 and type(numpy_count.actual_batch_size) is int
    with pytest.raises(ValueError, match=r"pad: batch_size=4.0, expected an int >= the batch's 4"):
        numpy_count.pad(4.0)  # type: ignore[arg-type]
    # a numpy count (as pad_batch takes), a plain int in the result
    grown = numpy_count.pad(np.int64(6))  # type: ignore[arg-type]
    assert grown.batch_size == 6 and type(grown.batch_size) is int and tuple(grown.tokens["a"].shape) == (6, 5)
    labelled = TokenBatch(batch_size=2, seq_lens=torch.tensor([3, 0]), actual_batch_size=1,
                          tokens={"ids": torch.ones(2, 4, dtype=torch.int64), "m": torch.ones(2, 4, 2, dtype=torch.bool),
                                  "x": torch.ones(2, 4, dtype=torch.bfloat16)},
                          pad_values={"ids": -100, "m": False, "x": float("nan")})
    grown = labelled.pad(3)  # the new padding sample's rows hold the pad values
    assert grown.tokens["ids"][2].tolist() == [-100] * 4 and not grown.tokens["m"][2].any()
    assert grown.tokens["x"][2].isnan().all() and grown.tokens["ids"][:2].eq(1).all()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("comm", ["all2all", "allgather"])
def test_simulated_token_exchange(packed: bool, comm: str) -> None:
    rng = np.random.default_rng(1)
    for case in range(8):
        w, b = 3, int(rng.choice([2, 5]))
        # Padded batches may be padded to a different L on every rank.
        batches = [token_batch(r, b, int(rng.integers(0, b + 1)), seed=case, packed=packed,
                               max_len=9 + (3 * r if case % 3 == 0 else 0), pad_multiple=[1, 4][case % 2])
                   for r in range(w)]
        dest = rng.permutation(np.repeat(np.arange(w), b))
        outs = simulate(batches, dest, comm)
        for r, out in enumerate(outs):
            want = [token_rows(batches[g // b])[g % b] for g in np.flatnonzero(dest == r)
                    if g % b < batches[g // b].actual_batch_size]
            assert token_rows(out) == want, (case, r)
            assert out.batch_size == b and out.packed == packed
            if not packed:
                longest = int(out.seq_lens.max())
                assert out.max_len == -(-longest // out.pad_multiple) * out.pad_multiple  # re-padded


def _token_worker(rank: int, w: int) -> list[tuple[Any, ...]]:
    out = []
    cost = lambda b: b.seq_lens.double() ** 2 * 1e-6  # noqa: E731 - any unit: only ratios matter
    for packed in (False, True):
        for comm in ("all2all", "allgather"):
            s = BatchShuffler(cost, comm=comm)
            for case in range(4):
                batch = token_batch(rank, 6, [6, 4, 0, 6][case] if rank == 1 else 6, seed=10 + case,
                                    packed=packed, max_len=7 + 2 * rank, pad_multiple=8)
                with HostReadRecorder() as reads:
                    h = s.start_shuffle_async(batch)
                    got = s.finish_shuffle(batch, h)
                    got.cu_seqlens()
                assert reads.calls == [], reads.calls
                out.append((packed, comm, token_rows(batch), token_rows(got), h.stats.comm,
                            h.stats.imbalance_before, h.stats.imbalance_after))
            s.close()
    errors = {}
    bad = token_batch(rank, 6, 6, seed=1, packed=True)
    if rank == 1:  # one token too few for its seq_lens
        bad.tokens = {k: v[:-1] for k, v in bad.tokens.items()}
    try:
        BatchShuffler(cost).shuffle(bad)
    except ValueError as e:
        errors["short"] = str(e)
    mixed = token_batch(rank, 6, 6, seed=1, packed=rank == 1)
    try:
        BatchShuffler(cost).shuffle(mixed)
    except ValueError as e:
        errors["layout"] = str(e)
    out.append(("errors", errors))
    return out


def test_token_batches_shuffle_between_ranks() -> None:
    per_rank = run_workers(_token_worker, 3, timeout=300)
    n = len(per_rank[0]) - 1
    for i in range(n):
        packed, comm = per_rank[0][i][:2]
        before = Counter(x for r in per_rank for x in r[i][2])
        after = Counter(x for r in per_rank for x in r[i][3])
        assert before == after, (packed, comm, i)  # every real sample exactly once, tokens intact
        assert per_rank[0][i][6] <= per_rank[0][i][5] + 1e-12
    assert any(r[i][4] != "none" for r in per_rank for i in range(n))  # samples did move
    for res in per_rank:
        errors = res[-1][1]
        assert "tokens['input_ids'] has" in errors["short"] and "expected sum(seq_lens) = " in errors["short"]
        assert "(rank 1)" in errors["short"] and errors["short"] == per_rank[0][-1][1]["short"]
        assert "'layout': ranks [0, 2]: 'padded'; rank 1: 'packed'" in errors["layout"], errors["layout"]


def _empty_slots_worker(rank: int, w: int, comm: str, everywhere: bool) -> dict[str, Any]:
    """Rank 0 (or every rank) holds a padded batch of length L = 0; sample ids ride in ``samples``."""
    b = 3
    sid = torch.tensor([1.0, 2.0, 3.0]) + 10 * rank
    if everywhere or rank == 0:
        lens = torch.zeros(b, dtype=torch.int64)
        ids = torch.zeros(b, 0, dtype=torch.int64)
    else:
        lens = torch.tensor([4, 4, 1])
        ids = torch.zeros(b, 4, dtype=torch.int64)
        for i, n in enumerate(lens.tolist()):
            ids[i, :n] = int(sid[i]) * 100 + torch.arange(n)
    batch = TokenBatch(batch_size=b, seq_lens=lens, tokens={"ids": ids}, samples={"sid": sid})
    # Costs that move samples: by length, or by id where every sequence is empty.
    cost = (lambda t: t.samples["sid"].double() ** 3) if everywhere else (lambda t: t.seq_lens.double() ** 2 + 1)
    shuffler = BatchShuffler(cost, comm=comm)
    out = shuffler.shuffle(batch)
    shuffler.close()
    a = int(out.actual_batch_size)
    got = []
    for i in range(a):
        n, s = int(out.seq_lens[i]), int(out.samples["sid"][i])
        assert out.tokens["ids"][i, :n].tolist() == [s * 100 + j for j in range(n)], "a sample's tokens moved"
        assert not out.tokens["ids"][i, n:].any(), "padding slots are zero"
        got.append((s, n))
    return {"got": got, "shape": tuple(out.tokens["ids"].shape)}


@pytest.mark.parametrize("everywhere", [False, True])
@pytest.mark.parametrize("comm", ["all2all", "allgather"])
def test_padded_batches_of_length_zero_shuffle(comm: str, everywhere: bool) -> None:
    # A padded batch with L = 0 was planned as a packed one (stride 0): with
    # all2all its rank raised after the collective and the samples sent to it
    # were lost; with allgather the ranks' sizes differed and gloo aborted.
    outs = run_workers(_empty_slots_worker, 2, comm, everywhere, timeout=120)
    got = sorted(pair for o in outs for pair in o["got"])
    lens = {0: [0, 0, 0], 1: [0, 0, 0] if everywhere else [4, 4, 1]}
    assert got == sorted((i + 1 + 10 * r, lens[r][i]) for r in range(2) for i in range(3))
    for o in outs:
        assert o["shape"][0] == 3 and o["shape"][1] == max((n for _, n in o["got"]), default=0)


def _still_worker(rank: int, w: int, length: int, capacity: int | None) -> dict[str, Any]:
    """Identical padded batches on every rank: nothing moves."""
    lens = torch.tensor([5, 3])
    ids = torch.zeros(2, length, dtype=torch.int64)
    for i, n in enumerate(lens.tolist()):
        ids[i, :n] = 100 * (i + 1) + torch.arange(n)
    batch = TokenBatch(batch_size=2, seq_lens=lens, tokens={"ids": ids, "nothing": torch.zeros(2, length, 0)},
                       pad_multiple=4)
    shuffler = BatchShuffler(lambda t: t.seq_lens.double(), capacity=capacity)
    handle = shuffler.start_shuffle_async(batch)
    out = shuffler.finish_shuffle(batch, handle)
    shuffler.close()
    return {"comm": handle.stats.comm, "shape": tuple(out.tokens["ids"].shape),
            "zero": tuple(out.tokens["nothing"].shape), "ids": out.tokens["ids"][:2, :5].tolist(),
            "tail": int(out.tokens["ids"][:, 5:].abs().sum())}


@pytest.mark.parametrize("capacity", [None, 3])
@pytest.mark.parametrize("length", [5, 12])
def test_pad_multiple_holds_when_nothing_moves(length: int, capacity: int | None) -> None:
    # A batch that stayed put kept its own L (5 or 12), not the longest sample
    # rounded up to pad_multiple (8) that every moved batch gets.
    for out in run_workers(_still_worker, 2, length, capacity, timeout=120):
        assert out["comm"] == "none"
        assert out["shape"] == (capacity or 2, 8) and out["zero"] == (capacity or 2, 8, 0)
        assert out["ids"] == [[100, 101, 102, 103, 104], [200, 201, 202, 0, 0]] and out["tail"] == 0


PADS = {"input_ids": -100, "pos3": 7}


def _pad_worker(rank: int, w: int) -> list[tuple[Any, ...]]:
    """Padded batches whose padding positions hold garbage (-5): the output's
    padding holds ``pad_values`` (0 for ``pos3`` where not given), samples
    moved or not, with and without ``capacity``; its valid tokens are the input's."""
    out = []
    cost = lambda b: b.seq_lens.double() ** 2  # noqa: E731
    for comm in ("all2all", "allgather"):
        for capacity in (None, 8):
            for pads in (PADS, {"input_ids": -100}):
                s = BatchShuffler(cost, comm=comm, capacity=capacity)
                for still in (False, True):
                    seed = 3 if still else 20 + rank  # the same batch everywhere: nothing moves
                    src = token_batch(0 if still else rank, 6, 6 if still or rank != 1 else 4, seed=seed,
                                      packed=False, max_len=8 + 3 * (0 if still else rank), pad_multiple=4)
                    tokens = {k: v.masked_fill(~_valid(src, v), -5) for k, v in src.tokens.items()}
                    batch = dataclasses.replace(src, tokens=tokens, pad_values=dict(pads))
                    with HostReadRecorder() as reads:
                        h = s.start_shuffle_async(batch)
                        got = s.finish_shuffle(batch, h)
                    assert reads.calls == [], reads.calls
                    assert batch.tokens["input_ids"].eq(-5).any()  # the caller's tensors are not written
                    holds = {name: bool(t.masked_select(~_valid(got, t)).eq(pads.get(name, 0)).all())
                             for name, t in got.tokens.items()}
                    clean = dataclasses.replace(got, tokens={k: v.masked_fill(~_valid(got, v), 0)
                                                             for k, v in got.tokens.items()})
                    out.append((comm, capacity, still, h.stats.comm, holds, token_rows(src), token_rows(clean)))
                s.close()
    return out


def _valid(batch: TokenBatch, t: torch.Tensor) -> torch.Tensor:
    """[B, L, 1...] True on valid token positions, broadcastable to ``t``."""
    mask = batch.attention_mask()
    return mask.view(*mask.shape, *([1] * (t.dim() - 2)))


def test_padding_positions_hold_pad_values_whether_or_not_samples_moved() -> None:
    # The padding of a batch that stayed put was the caller's (whatever lay
    # beyond seq_lens), of a moved one zeros: labels padded with -100 came back
    # as token id 0 on moved samples only.
    per_rank = run_workers(_pad_worker, 3, timeout=300)
    for i, (comm, capacity, still, _, _, _, _) in enumerate(per_rank[0]):
        before = Counter(x for r in per_rank for x in r[i][5])
        after = Counter(x for r in per_rank for x in r[i][6])
        assert before == after, (comm, capacity, still)
        for r in per_rank:
            assert all(r[i][4].values()), (comm, capacity, still, r[i][4])
            assert (r[i][3] == "none") == still or capacity is not None, (comm, capacity, still, r[i][3])
    assert {r[i][3] for r in per_rank for i in range(len(r))} >= {"none", "all2all", "allgather"}


def test_pad_values_must_agree_across_ranks() -> None:
    ranks = [token_batch(r, 4, 4, seed=1, packed=False) for r in range(2)]
    a = wire_layout(dataclasses.replace(ranks[0], pad_values={"input_ids": -100}))
    b = wire_layout(ranks[1])
    assert a.fingerprint != b.fingerprint
    assert a.describe()["tokens['input_ids'] pad value"] == "-100" and b.describe()["tokens['input_ids'] pad value"] == "0"
    packed = [wire_layout(dataclasses.replace(token_batch(0, 4, 4, seed=1, packed=True), pad_values=p))
              for p in ({}, {"input_ids": -100})]
    assert packed[0].fingerprint == packed[1].fingerprint  # a packed batch has no padding positions


def _zero_width_worker(rank: int, w: int) -> dict[str, Any]:
    lens = torch.tensor([8, 7, 1]) if rank == 0 else torch.tensor([1, 1, 1])
    t = int(lens.sum())
    sid = torch.tensor([1.0, 2.0, 3.0]) + 10 * rank
    batch = TokenBatch(batch_size=3, seq_lens=lens, packed=True, samples={"sid": sid},
                       tokens={"ids": torch.arange(t), "empty": torch.zeros(t, 0)})
    shuffler = BatchShuffler(lambda b: b.seq_lens.double() ** 2)
    out = shuffler.shuffle(batch)
    shuffler.close()
    return {"lens": out.seq_lens.tolist(), "empty": tuple(out.tokens["empty"].shape),
            "ids": tuple(out.tokens["ids"].shape), "sid": out.samples["sid"][: out.actual_batch_size].tolist()}


def test_packed_field_of_width_zero_shuffles() -> None:
    # .view(-1, 0) cannot infer T: the shuffle aborted and closed the shuffler.
    outs = run_workers(_zero_width_worker, 2, timeout=120)
    assert sorted(s for o in outs for s in o["sid"]) == [1.0, 2.0, 3.0, 11.0, 12.0, 13.0]
    for o in outs:
        assert o["empty"] == (sum(o["lens"]), 0) and o["ids"] == (sum(o["lens"]),)


def test_the_cuda_tiers_token_worker_on_cpu() -> None:
    # tests/test_cuda.py's worker, with CPU tensors: its checks run on every
    # machine, so the CUDA tier's token test is known to check the right thing.
    from tests.test_cuda import _token_cuda_worker, check_conserved

    check_conserved(run_workers(_token_cuda_worker, 2, "cpu", timeout=300))


def _replaced_fields_worker(rank: int, w: int) -> dict[str, Any]:
    """Rank 1 (every rank for pad_multiple, which ranks compare) changes one field of its
    batch after construction; every rank reports what it raised."""
    cost = lambda b: b.seq_lens.double()  # noqa: E731
    changes: dict[str, Any] = {"pad_multiple": 0, "batch_size": np.int64(6), "tokens": {}}
    out: dict[str, Any] = {}
    s = BatchShuffler(cost)
    for name, value in changes.items():
        batch = token_batch(rank, 6, 6, seed=3, packed=name == "tokens", pad_multiple=4)
        if rank == 1 or name == "pad_multiple":
            setattr(batch, name, value)
        try:
            s.shuffle(batch)
            out[name] = ("ok", "")
        except Exception as e:  # noqa: BLE001 - the kind is part of the result
            out[name] = (type(e).__name__, str(e))
    good = s.shuffle(token_batch(rank, 6, 6, seed=4, packed=False, pad_multiple=4))
    out["after"] = good.max_len % 4
    s.close()
    return out


def test_fields_replaced_after_construction_fail_on_every_rank() -> None:
    # pad_multiple=0 raised ZeroDivisionError on every rank after phase 1; a
    # numpy batch_size raised on its own rank only (rebuilding the batch), and
    # an empty packed tokens dict raised StopIteration.
    outs = run_workers(_replaced_fields_worker, 3, timeout=120)
    expect = {"pad_multiple": "pad_multiple=0, expected an int >= 1 (rank 0)",
              "batch_size": f"batch_size={np.int64(6)!r} (int64), expected an int >= 1 (rank 1)",  # numpy 1.x: "6"
              "tokens": "tokens is empty, expected at least one per-token tensor (rank 1)"}
    for o in outs:
        assert o["after"] == 0
        for name, text in expect.items():
            kind, msg = o[name]
            assert kind == "ValueError" and text in msg, (name, kind, msg)
            assert msg == outs[0][name][1]


def _too_long_worker(rank: int, w: int, width: int) -> tuple[str, str]:
    lens = torch.tensor([5, 1, 1]) if rank == 0 else torch.tensor([1, 1, 1])
    tokens = {"e": torch.zeros(3, 4, width)}  # L = 4: rank 0's first sample does not fit
    try:
        BatchShuffler(lambda b: b.seq_lens.double() ** 2).shuffle(TokenBatch(batch_size=3, seq_lens=lens,
                                                                             tokens=tokens))
        return ("ok", "")
    except ValueError as e:
        return ("ValueError", str(e))


@pytest.mark.parametrize("width", [2, 0])
def test_a_sample_longer_than_the_padded_length_fails_whatever_the_width(width: int) -> None:
    # Checked as tokens * width against the field's stride, which is 0 for a
    # zero-width field: the 5-token sample was accepted into a batch of L = 4.
    for kind, msg in run_workers(_too_long_worker, 2, width, timeout=120):
        assert kind == "ValueError" and "seq_lens has a sample of 5 tokens, longer than the padded length 4 of " \
            "tokens['e'] (rank 0)" in msg, msg


def test_a_negative_length_is_named_before_the_workload_it_made_negative() -> None:
    # workload_fn = seq_lens turned seq_lens[0] = -1 into workloads[0] = -1.0,
    # and that was the error reported instead of its cause.
    batch = token_batch(0, 4, 3, seed=1, packed=False)
    batch.seq_lens[0] = -1
    s = BatchShuffler(lambda b: b.seq_lens.double())
    with pytest.raises(ValueError, match=r"invalid shuffle input on rank\(s\) \[0\]: seq_lens\[0\] = -1, "
                                         r"expected 0 <= length < 2\*\*31 \(rank 0\)"):
        s.shuffle(batch)
    s.close()


def _padding_tokens_worker(rank: int, w: int) -> tuple[str, str]:
    # verl-style padding: a repeated real sample past actual_batch_size, seq_lens
    # left as they were. Kept where nothing moved, dropped where samples moved.
    lens = torch.tensor([2, 3, 4]) if rank == 1 else torch.tensor([5, 1, 0])
    tokens = {"ids": torch.arange(15).view(3, 5) + 1}
    batch = TokenBatch(batch_size=3, seq_lens=lens, tokens=tokens, actual_batch_size=2)
    try:
        BatchShuffler(lambda b: b.seq_lens.double() ** 2).shuffle(batch)
        return ("ok", "")
    except ValueError as e:
        return ("ValueError", str(e))


def test_a_padding_sample_with_tokens_fails_on_every_rank() -> None:
    # The output depended on the plan: the padding sample kept its 4 tokens
    # (and its labels reached the loss) where nothing moved, and came back
    # empty where samples moved.
    for kind, msg in run_workers(_padding_tokens_worker, 2, timeout=120):
        assert kind == "ValueError" and "padding sample 2 (actual_batch_size=2) has seq_lens 4, expected 0: " \
            "samples from actual_batch_size on are padding and hold no data; TokenBatch.pad appends such " \
            "samples, or raise actual_batch_size to count it as real (rank 1)" in msg, msg


def _from_mask_reference(mask: torch.Tensor, t: torch.Tensor, pad: int | float) -> tuple[list[int], torch.Tensor]:
    """Row by row: the valid positions' tokens, in order, then ``pad``."""
    out = torch.full_like(t, pad)
    lens = []
    for i in range(mask.shape[0]):
        pos = [j for j in range(mask.shape[1]) if mask[i, j]]
        out[i, : len(pos)] = t[i, pos]
        lens.append(len(pos))
    return lens, out


@pytest.mark.parametrize("seed", range(4))
def test_from_mask_moves_each_rows_valid_tokens_to_its_front(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, length = 6, 9
    mask = torch.rand(b, length, generator=g) < 0.6  # left, right, mixed and empty rows
    mask[0] = torch.arange(length) >= 4  # left-padded
    mask[1] = torch.arange(length) < 3  # right-padded
    mask[2] = (torch.arange(length) >= 2) & (torch.arange(length) < 7)  # prompt left, response right
    mask[5] = False  # a padding sample
    ids = torch.randint(1, 1000, (b, length), generator=g)
    emb = torch.randn(b, length, 2, 3, generator=g)
    with HostReadRecorder() as reads:
        batch = TokenBatch.from_mask(mask.to(torch.int64), {"ids": ids, "emb": emb, "mask": mask},
                                     samples={"r": torch.arange(b)}, actual_batch_size=5, pad_values={"ids": -7})
    assert not reads.calls, reads.calls
    lens, want_ids = _from_mask_reference(mask, ids, -7)
    assert batch.seq_lens.tolist() == lens and lens[:3] == [5, 3, 5]
    assert torch.equal(batch.tokens["ids"], want_ids)
    assert torch.equal(batch.tokens["emb"], _from_mask_reference(mask, emb, 0.0)[1])
    assert torch.equal(batch.tokens["mask"], batch.attention_mask())  # right-padded now
    assert batch.actual_batch_size == 5 and batch.pad_values == {"ids": -7} and not batch.packed


def test_from_mask_errors() -> None:
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"attention_mask: shape \(6,\) and dtype torch.float32, expected \[B, L\]"):
        TokenBatch.from_mask(mask.view(-1), {"ids": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"tokens\['ids'\]: shape \(2, 4\) and dtype torch.int64, expected "
                                         r"\[B, L, \.\.\.\] with \[B, L\] = attention_mask's \(2, 3\)"):
        TokenBatch.from_mask(mask, {"ids": torch.zeros(2, 4, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"tokens\['ids'\] is on meta, expected attention_mask's cpu"):
        TokenBatch.from_mask(mask, {"ids": torch.zeros(2, 3, device="meta")})
    with pytest.raises(ValueError, match=r"pad_values: key 'labels' names no token field"):
        TokenBatch.from_mask(mask, {"ids": torch.zeros(2, 3)}, pad_values={"labels": -100})


def test_tensors_on_another_device_than_seq_lens_are_refused() -> None:
    # Accepted before: one rank returned a batch while its peer failed in phase 2.
    lens = torch.tensor([2, 1])
    with pytest.raises(ValueError, match=r"tokens\['ids'\] is on meta, expected seq_lens' device cpu"):
        TokenBatch(batch_size=2, seq_lens=lens, tokens={"ids": torch.zeros(2, 3, device="meta")})
    with pytest.raises(ValueError, match=r"samples\['r'\] is on meta, expected seq_lens' device cpu"):
        TokenBatch(batch_size=2, seq_lens=lens, tokens={"ids": torch.zeros(2, 3)},
                   samples={"r": torch.zeros(2, device="meta")})
