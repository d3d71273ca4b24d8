"""BatchShuffler on real gloo collectives (forkserver ranks), plus its local paths.

Every sample carries a unique id ``1 + rank * 10000 + i`` in its KJT values,
weights, labels and dense rows, so a test can follow it across ranks.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer.batch import BaseBatch
from balancer.partition import PartitionWorker
from balancer.shuffler import BatchShuffler, IdentityBatchShuffler
from balancer.testing import WorkerError, run_workers, run_workers_outcomes
from tests.reference import greedy, scale_free

KEYS = ["a", "b", "c"]


@dataclasses.dataclass(kw_only=True)
class TaggedBatch(BaseBatch):
    dense: torch.Tensor  # [B, 3] float32: (id, id + 0.5, -id)
    extra: KeyedJaggedTensor  # key "e", int32 lengths and values, no weights


def sid(rank: int, i: int) -> int:
    return 1 + rank * 10000 + i


def make_batch(rank: int, b: int, real: int, seed: int, labels: str = "kjt",
               zero_frac: float = 0.2, keys: list[str] | None = None) -> TaggedBatch:
    keys = keys or KEYS
    rng = np.random.default_rng([seed, rank])
    lens = np.zeros((len(keys), b), np.int64)
    lens[:, :real] = rng.integers(0, 3 + 4 * rank, size=(len(keys), real))
    lens[:, :real][:, rng.random(real) < zero_frac] = 0  # real samples with no data
    vals, wts = [], []
    for k in range(len(keys)):
        for i in range(b):
            vals += [sid(rank, i) * 1000 + k * 100 + p for p in range(lens[k, i])]
            wts += [sid(rank, i) * 4 + k + p / 128 for p in range(lens[k, i])]
    features = KeyedJaggedTensor(keys=keys, values=torch.tensor(vals, dtype=torch.int64),
                                 weights=torch.tensor(wts, dtype=torch.float32),
                                 lengths=torch.from_numpy(lens.reshape(-1)))
    elen = np.zeros(b, np.int32)
    elen[:real] = rng.integers(0, 3, size=real)
    evals = [sid(rank, i) * 10 + p for i in range(b) for p in range(elen[i])]
    extra = KeyedJaggedTensor(keys=["e"], values=torch.tensor(evals, dtype=torch.int32),
                              lengths=torch.from_numpy(elen))
    ids = torch.tensor([sid(rank, i) if i < real else 0 for i in range(b)], dtype=torch.float32)
    dense = torch.stack([ids, torch.where(ids > 0, ids + 0.5, 0.0), -ids], dim=1)
    lab: Any = None
    if labels == "kjt":
        lab = KeyedJaggedTensor(keys=["y"], values=ids[:real].clone(),
                                lengths=(ids > 0).to(torch.int64))
    elif labels == "dense":
        lab = ids.clone()
    return TaggedBatch(features=features, batch_size=b, feature_to_max_seqlen={"a": 7},
                       actual_batch_size=real, labels=lab, dense=dense, extra=extra)


def token_count(batch: BaseBatch) -> torch.Tensor:
    f = batch.features
    return f.lengths().view(len(f.keys()), batch.batch_size).sum(0)


def rows(batch: BaseBatch) -> list[tuple[Any, ...]]:
    """Every sample as a hashable tuple of all its data (KJTs per key, dense rows)."""
    b = batch.batch_size
    out: list[list[Any]] = [[] for _ in range(b)]
    for name, kjt in batch.kjt_fields().items():
        lengths = kjt.lengths().view(len(kjt.keys()), b).tolist()
        vals, w = kjt.values().tolist(), kjt.weights_or_none()
        wl = w.tolist() if w is not None else None
        off = 0
        for k in range(len(kjt.keys())):
            for i in range(b):
                n = lengths[k][i]
                out[i].append((name, k, tuple(vals[off : off + n]), tuple(wl[off : off + n]) if wl is not None else None))
                off += n
    for name, t in batch.dense_fields().items():
        for i, r in enumerate(t.reshape(b, -1).tolist()):
            out[i].append((name, tuple(r)))
    return [tuple(r) for r in out]


def assert_identical(x: BaseBatch, y: BaseBatch) -> None:
    """Bit-identical batches: same fields, dtypes, lengths, values, weights, rows."""
    assert type(x) is type(y) and x.batch_size == y.batch_size
    assert x.actual_batch_size == y.actual_batch_size
    assert x.feature_to_max_seqlen == y.feature_to_max_seqlen
    for (n, a), (_, c) in zip(x.kjt_fields().items(), y.kjt_fields().items(), strict=True):
        assert a.keys() == c.keys(), n
        for ta, tc in ((a.lengths(), c.lengths()), (a.values(), c.values())):
            assert ta.dtype == tc.dtype and torch.equal(ta, tc), n
        wa, wc = a.weights_or_none(), c.weights_or_none()
        assert (wa is None) == (wc is None) and (wa is None or torch.equal(wa, wc)), n
    for (n, a), (_, c) in zip(x.dense_fields().items(), y.dense_fields().items(), strict=True):
        assert a.dtype == c.dtype and a.shape == c.shape and torch.equal(a, c), n


# ------------------------------------------------------------- conservation
_VARIANTS = ("blind", "local", "default", "thread")


def _conservation_worker(rank: int, w: int) -> list[dict[str, Any]]:
    results = []
    rng = np.random.default_rng(123)  # same draws on every rank
    ag = BatchShuffler(token_count, comm="allgather", partition=greedy, locality=False)
    shufflers = {"blind": BatchShuffler(token_count, comm="all2all", partition=greedy, locality=False),
                 "local": BatchShuffler(token_count, partition=greedy, locality=True),
                 "default": BatchShuffler(token_count),  # balanced_partition in a child process
                 "thread": BatchShuffler(token_count, executor="thread")}
    for case in range(15):
        b = int(rng.choice([1, 4, 9]))
        pattern = case % 5
        reals = {0: [b] * w, 1: rng.integers(0, b + 1, size=w).tolist(),
                 2: [0 if r == 1 else b for r in range(w)], 3: [0] * w,
                 4: rng.integers(0, b + 1, size=w).tolist()}[pattern]
        batch = make_batch(rank, b, int(reals[rank]), seed=case, labels=["kjt", "dense", None][case % 3],
                           zero_frac=0.9 if pattern == 4 else 0.2)
        res: dict[str, Any] = dict(b=b, real=int(batch.actual_batch_size or 0), rows_in=rows(batch),
                                   workloads=token_count(batch).tolist())
        outs: dict[str, BaseBatch] = {}
        for name, shuffler in shufflers.items():
            handle = shuffler.start_shuffle_async(batch)
            out = shuffler.finish_shuffle(batch, handle)
            if name == "blind":
                assert_identical(out, ag.shuffle(batch))  # both paths, bit for bit
            outs[name] = out
            # The stats' loads, recomputed from the batches themselves.
            assert handle.stats.load_before[rank] == float(token_count(batch)[: batch.actual_batch_size].sum())
            assert handle.stats.load_after[rank] == float(token_count(out)[: out.actual_batch_size].sum())
            res[name] = dict(rows=rows(out), real=int(out.actual_batch_size or 0),
                             stats=dataclasses.asdict(handle.stats),
                             dest=handle._job.result().dest.tolist())  # type: ignore[union-attr]
        assert_identical(outs["thread"], outs["default"])  # same partition in a thread and a child
        results.append(res)
    return results


def _expected_real_rows(ins: list[dict[str, Any]], w: int) -> list[list[tuple[Any, ...]]]:
    """Independent reference: partition the gathered global sample list, in Python;
    rank r gets the real samples of part r in ascending global order."""
    b = ins[0]["b"]
    real = lambda g: g % b < ins[g // b]["real"]  # noqa: E731
    workloads = np.array([ins[g // b]["workloads"][g % b] if real(g) else 0 for g in range(w * b)])
    q = scale_free(workloads)  # what the shuffler's partition function receives
    parts = greedy(q, w)
    home = [list(range(r * b, (r + 1) * b)) for r in range(w)]
    max_load = lambda ps: max(sum(int(q[g]) for g in p) for p in ps)  # noqa: E731
    if max_load(parts) > max_load(home):
        parts = home  # the shuffler never worsens the max load
    return [[ins[g // b]["rows_in"][g % b] for g in sorted(p) if real(g)] for p in parts]


def _check_padding(rs: list[tuple[Any, ...]]) -> None:
    for row in rs:
        for item in row:
            if len(item) == 2:  # dense row
                assert not any(item[1]), item
            else:
                assert item[2] == () and item[3] in ((), None), item


@pytest.mark.parametrize("world_size", [2, 4])
def test_conservation_reference_and_paths(world_size: int) -> None:
    per_rank = run_workers(_conservation_worker, world_size)
    moved = {v: 0.0 for v in _VARIANTS}
    for case in range(len(per_rank[0])):
        ins = [per_rank[r][case] for r in range(world_size)]
        b = ins[0]["b"]
        real_in = [row for d in ins for row in d["rows_in"][: d["real"]]]
        for v in _VARIANTS:
            outs = [d[v] for d in ins]
            real_out = [row for o in outs for row in o["rows"][: o["real"]]]
            assert Counter(real_out) == Counter(real_in), (case, v)  # every sample once, intact
            for o in outs:
                assert len(o["rows"]) == b
                _check_padding(o["rows"][o["real"] :])
            stats = [o["stats"] for o in outs]
            assert all(o["dest"] == outs[0]["dest"] for o in outs)  # one partition everywhere
            assert stats[0]["max_after"] <= stats[0]["max_before"]
            assert stats[0]["max_after"] >= stats[0]["lower_bound"] - 1e-9
            assert sum(s["samples_sent"] for s in stats) == sum(s["samples_received"] for s in stats)
            assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)
            moved[v] += stats[0]["moved_fraction"]
        for r, exp in enumerate(_expected_real_rows(ins, world_size)):
            assert ins[r]["blind"]["rows"][: ins[r]["blind"]["real"]] == exp, (case, r)
        assert ins[0]["local"]["stats"]["max_after"] <= ins[0]["blind"]["stats"]["max_after"]
    assert moved["local"] <= moved["blind"]


@dataclasses.dataclass(kw_only=True)
class OddBatch(BaseBatch):
    small: torch.Tensor  # [B, 2] int8
    flag: torch.Tensor  # [B] bool
    half: torch.Tensor  # [B, 3] float16
    codes: KeyedJaggedTensor  # uint8 values, float16 weights


def _odd_batch(rank: int, b: int, real: int, seed: int) -> OddBatch:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    lengths = torch.randint(0, 4 + 3 * rank, (2, b), generator=g)
    lengths[:, real:] = 0
    n = int(lengths.sum())
    features = KeyedJaggedTensor(keys=["x", "y"], values=torch.randn(n, generator=g, dtype=torch.float64),
                                 weights=torch.rand(n, generator=g, dtype=torch.float64), lengths=lengths.view(-1))
    clen = lengths[0].clamp(max=2)
    codes = KeyedJaggedTensor(keys=["c"], values=torch.randint(0, 255, (int(clen.sum()),), generator=g).to(torch.uint8),
                              weights=torch.rand(int(clen.sum()), generator=g).half(), lengths=clen)
    live = (torch.arange(b) < real).unsqueeze(1)
    small = torch.randint(-100, 100, (b, 2), generator=g).to(torch.int8) * live
    half = torch.randn(b, 3, generator=g).half() * live
    flag = torch.rand(b, generator=g) > 0.5
    flag[real:] = False
    return OddBatch(features=features, batch_size=b, feature_to_max_seqlen={}, actual_batch_size=real,
                    labels=None, small=small, flag=flag, half=half, codes=codes)


def _odd_dtypes_worker(rank: int, w: int) -> list[tuple[list[Any], list[Any]]]:
    a2a = BatchShuffler(token_count, comm="all2all")
    ag = BatchShuffler(token_count, comm="allgather")
    out = []
    for seed in range(6):
        batch = _odd_batch(rank, 5, [5, 3, 0, 5, 1, 4][seed] if rank else 5, seed)
        got = a2a.shuffle(batch)
        assert_identical(got, ag.shuffle(batch))
        out.append((rows(batch)[: batch.actual_batch_size], rows(got)[: got.actual_batch_size]))
    return out


def test_uncommon_dtypes_both_paths() -> None:
    """float64 / uint8 values, float16 / float64 weights, int8 / bool / float16 dense rows."""
    per_rank = run_workers(_odd_dtypes_worker, 2)
    for case in range(len(per_rank[0])):
        real_in = [row for r in per_rank for row in r[case][0]]
        real_out = [row for r in per_rank for row in r[case][1]]
        assert Counter(real_out) == Counter(real_in), case


# ------------------------------------------------------------------ async
def _boom_once() -> Any:
    calls = []

    def partition(workloads: np.ndarray, n: int) -> list[list[int]]:
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("partitioner failed")
        return greedy(workloads, n)

    return partition


def _async_worker(rank: int, w: int) -> dict[str, Any]:
    s = BatchShuffler(token_count, partition=greedy, locality=False, log_interval=1)
    ref = BatchShuffler(token_count, partition=greedy, locality=False)
    batches = [make_batch(rank, 6, 6 - rank, seed=j) for j in range(3)]
    handles = [s.start_shuffle_async(x) for x in batches]  # three in flight
    outs = [s.finish_shuffle(x, h) for x, h in zip(batches, handles, strict=True)]
    for x, o in zip(batches, outs, strict=True):
        assert_identical(o, ref.shuffle(x))
    errors: dict[str, str] = {}
    h0, h1 = s.start_shuffle_async(batches[0]), s.start_shuffle_async(batches[1])
    for name, fn in (("stats", lambda: h0.stats), ("order", lambda: s.finish_shuffle(batches[1], h1)),
                     ("foreign", lambda: ref.finish_shuffle(batches[0], h0))):
        try:
            fn()
        except RuntimeError as e:
            errors[name] = str(e)
    s.finish_shuffle(batches[0], h0)
    s.finish_shuffle(batches[1], h1)
    try:
        s.finish_shuffle(batches[1], h1)
    except RuntimeError as e:
        errors["twice"] = str(e)
    dropped = s.start_shuffle_async(batches[2])
    del dropped
    gc.collect()
    s.shuffle(batches[2])  # a dropped handle does not block later ones
    with BatchShuffler(token_count, partition=_boom_once(), locality=False) as boom:
        try:
            boom.shuffle(batches[0])
        except ZeroDivisionError as e:
            errors["partition"] = str(e)
        boom.shuffle(batches[0])  # still usable
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("balancer.shuffler").addHandler(handler)
    logging.getLogger("balancer.shuffler").setLevel(logging.INFO)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        s.shuffle(batches[0])
    names = {e.name for e in prof.events()}
    h = s.start_shuffle_async(batches[0])
    s.close()
    for name, fn in (("closed_finish", lambda: s.finish_shuffle(batches[0], h)),
                     ("closed_start", lambda: s.start_shuffle_async(batches[0]))):
        try:
            fn()
        except RuntimeError as e:
            errors[name] = str(e)
    ranges = sorted(n for n in names if n.startswith("## balancer"))
    return dict(errors=errors, logs=logs, ranges=ranges, seqs=[h0.seq, h1.seq])


def test_async_handles_and_errors() -> None:
    outs = run_workers(_async_worker, 2)
    for rank, o in enumerate(outs):
        e, (s0, s1) = o["errors"], o["seqs"]
        assert f"handle #{s0} has no stats" in e["stats"]
        assert f"handle #{s1} while handle(s) #[{s0}]" in e["order"]
        assert "not started by this BatchShuffler" in e["foreign"]
        assert f"handle #{s1} was already finished" in e["twice"]
        assert e["partition"] == "partitioner failed"
        assert "closed" in e["closed_finish"] and "closed" in e["closed_start"]
        assert "## balancer.shuffle.phase1 ##" in o["ranges"]
        assert "## balancer.shuffle.phase2 ##" in o["ranges"]
        assert bool(o["logs"]) == (rank == 0)
        assert all("max/mean load" in line for line in o["logs"])


# -------------------------------------------------------------- bad input
def _bad_input_worker(rank: int, w: int) -> list[tuple[str, str, str, float]]:
    mode = {"m": ""}
    bad = w - 1

    def workloads(batch: BaseBatch) -> Any:
        t = token_count(batch)
        m = mode["m"] if rank == bad else ""
        if m == "shape":
            return t[:-1]
        if m == "negative":
            t = t.clone()
            t[3] = -5
        if m == "nan":
            t = t.double()
            t[2] = float("nan")
        if m == "raise":
            raise KeyError("no such feature")
        if m == "complex":
            return t.to(torch.complex64)
        return t

    s = BatchShuffler(workloads, partition=greedy, locality=False)
    good = make_batch(rank, 8, 8, seed=1)
    cases = [("first_batch_size", make_batch(rank, 6 if rank == bad else 8, 4, seed=1), ""),
             ("good", good, ""),
             ("batch_size", make_batch(rank, 6 if rank == bad else 8, 4, seed=1), ""),
             ("schema", make_batch(rank, 8, 8, seed=1, keys=["a", "b"] if rank == bad else None), ""),
             ("shape", good, "shape"), ("negative", good, "negative"), ("nan", good, "nan"),
             ("raise", good, "raise"), ("complex", good, "complex"),
             ("all_resize", make_batch(rank, 5, 5, seed=2), ""), ("good_again", good, "")]
    out = []
    for name, batch, m in cases:
        mode["m"] = m
        t0 = time.perf_counter()
        try:
            s.shuffle(batch)
            out.append((name, "ok", "", time.perf_counter() - t0))
        except ValueError as e:
            cause = type(e.__cause__).__name__ if e.__cause__ else ""
            out.append((name, str(e), cause, time.perf_counter() - t0))
    return out


def test_bad_input_on_one_rank_raises_on_every_rank() -> None:
    w = 4
    results = run_workers(_bad_input_worker, w)
    b = w - 1
    expect = {"first_batch_size": f"'batch_size': ranks [0, 1, 2]: '8'; rank {b}: '6'",
              "batch_size": f"'batch_size': ranks [0, 1, 2]: '8'; rank {b}: '6'; every rank's batch must have "
                            "one batch_size (pad_batch or TokenBatch.pad pads a short one; BalancedLoader(batch_size=...) pads each "
                            "rank's batches to it)",
              "schema": f"'features.keys': ranks [0, 1, 2]: \"['a', 'b', 'c']\"; rank {b}: \"['a', 'b']\"",
              "shape": f"workloads has shape (7,) and dtype torch.int64, expected [batch_size=8] of an "
                       f"integer or floating dtype (rank {b})",
              "negative": f"workloads[3] = -5.0, expected >= 0 for real samples (rank {b})",
              "nan": f"workloads[2] = nan, expected a finite value (rank {b})",
              "raise": f"workload_fn raised KeyError: 'no such feature' (rank {b})",
              "complex": "dtype torch.complex64"}
    for rank, res in enumerate(results):
        by = {name: (msg, cause, dt) for name, msg, cause, dt in res}
        for name in ("good", "all_resize", "good_again"):
            assert by[name][0] == "ok", (rank, name, by[name])
        messages = {name: by[name][0] for name in expect}
        for name, text in expect.items():
            msg, cause, dt = by[name]
            assert text in msg and f"[{b}]" in msg, (rank, name, msg)
            assert msg == results[0][[n for n, *_ in res].index(name)][1], "the same text on every rank"
            assert dt < 10, (rank, name, dt)
        assert by["raise"][1] == ("KeyError" if rank == b else ""), "the cause is chained where it happened"
        assert len(set(messages.values())) == len(messages)


def _uncaught_worker(rank: int, w: int) -> None:
    s = BatchShuffler(token_count, partition=greedy, locality=False)
    s.shuffle(make_batch(rank, 4, 4, seed=0))
    s.shuffle(make_batch(rank, 4, 4, seed=0, keys=["a"] if rank == 0 else None))


def test_bad_input_every_rank_worker_error() -> None:
    outs = run_workers_outcomes(_uncaught_worker, 2, timeout=60)
    assert all(isinstance(o, WorkerError) and o.type_name == "ValueError" for o in outs), outs
    assert all("'features.keys': rank 0: \"['a']\"; rank 1: \"['a', 'b', 'c']\"" in o.message for o in outs)


def _exhausted_worker(rank: int, w: int) -> dict[str, Any]:
    from balancer.batch import padding_like

    out: dict[str, Any] = {}
    real = make_batch(rank, 4, 4, seed=5)
    empty = padding_like(real)
    for name, grouped in (("plain", None), ("grouped", 2)):
        kw: dict[str, Any] = {"group_size": grouped} if grouped else {"partition": greedy}
        with BatchShuffler(token_count, locality=False, executor="thread", **kw) as s:
            flags = []
            for done in ((False, False, True), (True, False, True), (True, True, True)):
                mine = done[rank]
                h = s.start_shuffle_async(empty if mine else real, exhausted=mine)
                got = s.finish_shuffle(empty if mine else real, h)
                flags.append((h.stats.world_exhausted, sum(h.stats.world_real_before), got.actual_batch_size))
            out[name] = flags
    with BatchShuffler(token_count, partition=greedy, locality=False) as s:
        try:  # rank 0 says its data ran out, yet sends real samples
            s.shuffle(real) if rank else s.finish_shuffle(real, s.start_shuffle_async(real, exhausted=True))
            out["real"] = "ok"
        except ValueError as e:
            out["real"] = str(e)
        # Not a bool on one rank: it raised TypeError there alone, before phase 1,
        # and its peers waited in phase 1 for the timeout.
        h = s.start_shuffle_async(real, exhausted=1 if rank == 1 else False)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"invalid shuffle input on rank\(s\) \[1\]: start_shuffle_async: "
                                             r"exhausted=1, expected a bool \(rank 1\)$") as info:
            s.finish_shuffle(real, h)
        assert isinstance(info.value.__cause__, TypeError) == (rank == 1)
        out["after"] = s.shuffle(real).actual_batch_size  # still usable
    return out


def test_every_rank_reads_every_ranks_exhausted_flag() -> None:
    # BalancedLoader learnt that every rank's data had run out from an extra
    # all-reduce on a gloo group of its own; the flag now rides in the phase-1
    # header, with and without group_size (whose groups gather full messages
    # within the group only: the flags come from every rank's header).
    outs = run_workers(_exhausted_worker, 3, timeout=120)
    flags = [[False, False, True], [True, False, True], [True, True, True]]
    for rank, res in enumerate(outs):
        for name in ("plain", "grouped"):
            got = res[name]
            assert [f for f, _, _ in got] == flags, (rank, name, got)
            assert [r for _, r, _ in got] == [8, 4, 0], (rank, name, got)  # nothing lost or invented
        assert sum(o[name][1][2] for o in outs) == 4
        assert res["real"].endswith("invalid shuffle input on rank(s) [0]: exhausted=True with actual_batch_size=4: "
                                    "a rank whose data has run out shuffles a batch of no real sample "
                                    "(padding_like) (rank 0)"), res["real"]
        assert res["after"] + sum(o["after"] for o in outs if o is not res) == 12
    for fn in (None, token_count):
        ident = IdentityBatchShuffler(fn)
        batch = make_batch(0, 4, 0, seed=5)
        h = ident.start_shuffle_async(batch, exhausted=True)
        ident.finish_shuffle(batch, h)
        assert h.stats.world_exhausted == [True]
        h = ident.start_shuffle_async(batch)
        ident.finish_shuffle(batch, h)
        assert h.stats.world_exhausted == [False]
        with pytest.raises(ValueError, match=r"exhausted=True with actual_batch_size=3: a rank whose data has run out "
                                             r"shuffles a batch of no real sample \(padding_like\) \(rank 0\)$"):
            real = make_batch(0, 4, 3, seed=5)
            ident.finish_shuffle(real, ident.start_shuffle_async(real, exhausted=True))


# ------------------------------------------------------- local paths, W = 1
def _forbid_collectives(monkeypatch_target: Any) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective was issued")

    for name in ("all_gather_single", "all_gather_into_tensor", "all_to_all_single", "all_gather",
                 "all_reduce", "broadcast", "barrier"):
        if hasattr(monkeypatch_target, name):
            setattr(monkeypatch_target, name, refuse)


def _single_rank_worker(rank: int, w: int) -> dict[str, Any]:
    _forbid_collectives(dist)
    batch = make_batch(0, 5, 3, seed=0)
    out: dict[str, Any] = {}
    for comm in ("all2all", "allgather"):
        s = BatchShuffler(token_count, comm=comm, partition=greedy, locality=False)
        assert s.shuffle(batch) is batch
        h0, h1 = s.start_shuffle_async(batch), s.start_shuffle_async(batch)
        try:
            s.finish_shuffle(batch, h1)
        except RuntimeError as e:
            out["order"] = str(e)
        assert s.finish_shuffle(batch, h0) is batch and s.finish_shuffle(batch, h1) is batch
        out["stats"] = dataclasses.asdict(h1.stats)
    bad = BatchShuffler(lambda b: -token_count(b) - 1, partition=greedy, locality=False)
    try:
        bad.shuffle(batch)
    except ValueError as e:
        out["bad"] = str(e)
    ident = IdentityBatchShuffler(token_count)
    assert ident.shuffle(batch) is batch
    return out


def test_world_size_one_issues_no_collective() -> None:
    (out,) = run_workers(_single_rank_worker, 1)
    assert "handle #2 while handle(s) #[1]" in out["order"]
    stats = out["stats"]
    assert stats["world_size"] == 1 and stats["bytes_sent"] == 0 and stats["moved_fraction"] == 0
    real_load = sum(token_count(make_batch(0, 5, 3, seed=0)).tolist()[:3])
    assert stats["load_before"] == stats["load_after"] == [real_load]
    assert "workloads[0] = -" in out["bad"] and "expected >= 0 for real samples (rank 0)" in out["bad"]


def test_without_process_group_and_identity() -> None:
    assert not dist.is_initialized()
    batch = make_batch(1, 4, 2, seed=3)
    with BatchShuffler(token_count, partition=greedy, locality=False) as s:
        assert s.shuffle(batch) is batch
    ident = IdentityBatchShuffler(token_count)
    h = ident.start_shuffle_async(batch)
    assert ident.finish_shuffle(batch, h) is batch
    assert h.stats.comm == "identity" and h.stats.load_before == [int(token_count(batch)[:2].sum())]
    plain = IdentityBatchShuffler()
    thing = object()
    assert plain.shuffle(thing) is thing  # any batch type, no workloads
    with pytest.raises(RuntimeError, match="already finished"):
        ident.finish_shuffle(batch, h)
    ident.close()
    with pytest.raises(RuntimeError, match="closed"):
        ident.start_shuffle_async(batch)


def test_one_rank_bad_input_is_the_same_value_error() -> None:
    # With one rank the local job built its message from bad input's empty
    # sizes: IndexError from numpy, where two ranks raise this ValueError.
    assert not dist.is_initialized()
    zero = make_batch(0, 4, 4, seed=3)
    zero.batch_size = 0  # set after construction
    for s in (BatchShuffler(token_count, executor="thread"), IdentityBatchShuffler(token_count)):
        name = type(s).__name__
        with pytest.raises(ValueError, match=rf"^{name}: shuffle #0: invalid shuffle input on rank\(s\) \[0\]: "
                                             r"batch is a NoneType, expected a BaseBatch or a TokenBatch \(rank 0\)$"):
            s.shuffle(None)
        with pytest.raises(ValueError, match=r"batch_size=0 \(int\), expected an int >= 1 \(rank 0\)$"):
            s.shuffle(zero)
        good = make_batch(0, 4, 4, seed=3)
        assert s.shuffle(good) is good  # still usable


def test_config_validation() -> None:
    for kwargs, text in (({"comm": "nccl"}, r"BatchShuffler: comm='nccl', expected one of \['all2all', 'allgather'\]"),
                         ({"log_interval": -1}, "log_interval=-1, expected an int >= 0"),
                         ({"locality": 1}, "locality=1, expected a bool"),
                         ({"partition": 3}, "partition=3, expected a callable")):
        with pytest.raises(ValueError, match=text):
            BatchShuffler(token_count, **kwargs)
    with pytest.raises(ValueError, match=r"executor='fork', expected one of \['auto', 'process', 'thread'\]"):
        BatchShuffler(token_count, executor="fork")
    with pytest.raises(ValueError, match=r"executor='process' runs balanced_partition.*partition='greedy' needs executor='thread'"):
        BatchShuffler(token_count, partition=greedy, executor="process")
    assert BatchShuffler(token_count, partition=greedy).executor == "thread"
    assert BatchShuffler(token_count).executor == "process"
    # 1e10 passed the check once and failed at the first shuffle (threading.TIMEOUT_MAX).
    for bad in (0, -1.0, float("inf"), True, "5", 1e10):
        with pytest.raises(ValueError, match=r"timeout=.*, expected a number of seconds > 0 and <= 1e\+08"):
            BatchShuffler(token_count, timeout=bad)  # type: ignore[arg-type]
    assert BatchShuffler(token_count, timeout=1e8).timeout == 1e8
    with pytest.raises(ValueError, match="workload_fn=None, expected a callable"):
        BatchShuffler(None)  # type: ignore[arg-type]


@pytest.mark.cuda
def test_cuda_single_rank() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    batch = make_batch(0, 6, 4, seed=0).to(torch.device("cuda"))
    s = BatchShuffler(token_count, partition=greedy, locality=False)
    h = s.start_shuffle_async(batch)
    assert s.finish_shuffle(batch, h) is batch
    assert h.stats.load_before == [int(token_count(batch)[:4].sum())]


@pytest.mark.cuda
@pytest.mark.parametrize("costs_on", ["cuda", "cpu"])
def test_cuda_costs_on_another_device_than_the_batch(costs_on: str) -> None:
    # Costs computed on the device for a host batch (the pipeline's phase 1 sees the
    # host batch) came back by a non_blocking copy that nothing waited for, and were
    # read before they landed; host costs for a device batch went there and back.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    host = make_batch(0, 6, 4, seed=0)
    want = [float(token_count(host)[:4].sum())]
    on_device = token_count(host).double().cuda()

    def device_costs(b: Any) -> torch.Tensor:
        torch.cuda._sleep(10**9)  # still queued behind this when phase 1 returns
        return on_device * 1.0

    batch = host if costs_on == "cuda" else host.to(torch.device("cuda"))
    fn = device_costs if costs_on == "cuda" else (lambda b: token_count(host))
    s = BatchShuffler(fn, partition=greedy, locality=False)
    h = s.start_shuffle_async(batch)
    s.finish_shuffle(batch, h)
    assert h.stats.load_before == want
    s.close()


# ------------------------------------------------------------- edge cases
def _edge_worker(rank: int, w: int) -> dict[str, Any]:
    from balancer.workloads import PolynomialCost

    out: dict[str, Any] = {}
    # Saturated estimator costs (MAX_COST each) and huge float costs: their
    # total exceeds int64, so the shuffler scales them; nothing is lost.
    saturated = PolynomialCost(KEYS, a=1e30)
    huge_float = lambda b: token_count(b).double() * 1e30  # noqa: E731
    for name, fn in (("saturated", saturated), ("float", huge_float)):
        s = BatchShuffler(fn)
        batch = make_batch(rank, 8, 6 - rank, seed=5)
        shuffled = s.shuffle(batch)
        out[name] = ([r for r in rows(batch)[: batch.actual_batch_size]],
                     [r for r in rows(shuffled)[: shuffled.actual_batch_size]],
                     shuffled.batch_size)
        s.close()
    # A rank-local mistake in finish_shuffle leaves the handle usable.
    s = BatchShuffler(token_count)
    batch = make_batch(rank, 6, 6, seed=7)
    h = s.start_shuffle_async(batch)
    if rank == 0:
        try:
            s.finish_shuffle(make_batch(rank, 6, 4, seed=7), h)
        except ValueError as e:
            out["wrong_batch"] = str(e)
        # A dense field of another batch size (replaced after start) used to
        # fail an assert inside phase 2, with the handle used up.
        bad = dataclasses.replace(batch)
        bad.dense = batch.dense[:5]  # the constructor checks shapes; an assignment is not checked
        try:
            s.finish_shuffle(bad, h)
        except ValueError as e:
            out["wrong_dense"] = str(e)
    out["retry"] = s.finish_shuffle(batch, h).batch_size
    # Equal workloads on full batches: nothing moves, so phase 2 issues no
    # collective at all.
    flat = BatchShuffler(lambda b: torch.ones(b.batch_size, dtype=torch.int64))
    batch = make_batch(rank, 6, 6, seed=9)
    h = flat.start_shuffle_async(batch)
    while not h.partition_done():  # phase 1's own all-gather runs in the background
        time.sleep(0.001)
    saved = {n: getattr(dist, n) for n in ("all_to_all_single", "all_gather_single", "all_gather_into_tensor")
             if hasattr(dist, n)}
    _forbid_collectives(dist)
    try:
        res = flat.finish_shuffle(batch, h)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    out["still"] = (res is batch, h.stats.bytes_sent, h.stats.samples_sent, h.stats.comm)
    return out


def test_saturated_workloads_retry_and_nothing_moves() -> None:
    outs = run_workers(_edge_worker, 2)
    for name in ("saturated", "float"):
        before = Counter(r for o in outs for r in o[name][0])
        after = Counter(r for o in outs for r in o[name][1])
        assert before == after and sum(before.values()) == 6 + 5, name
        assert all(o[name][2] == 8 for o in outs)
    assert outs[0]["wrong_batch"] == ("finish_shuffle: batch has actual_batch_size=4, the started one 6; "
                                      "it is not the batch handle #0 was started with")
    assert outs[0]["wrong_dense"] == ("finish_shuffle: dense: shape (5, 3), expected [batch_size=6, ...]; "
                                      "it is not the batch handle #0 was started with")
    assert [o["retry"] for o in outs] == [6, 6]
    assert [o["still"] for o in outs] == [(True, 0, 0, "none"), (True, 0, 0, "none")]


def _child_lifecycle_worker(rank: int, w: int) -> tuple[bool, bool, int | None]:
    s = BatchShuffler(token_count)
    batch = make_batch(rank, 4, 4, seed=1)
    h = s.start_shuffle_async(batch)
    time.sleep(1.5)  # the caller's work: neither partition time nor waiting
    s.finish_shuffle(batch, h)
    st = h.stats
    assert 0 < st.partition_s < 1.5 and st.partition_s <= st.background_s, st
    # The wait excludes the caller's 1.5 s (the background work overlapped it): what is left of
    # the background time after it, whatever the load (a fixed 1.5 s bound failed on a busy box).
    assert st.wait_s <= max(0.0, st.background_s - 1.5) + 0.5, st
    assert st.host_blocked_s == st.wait_s + st.collective_s, st
    worker = s._worker
    assert worker is not None
    alive = worker._proc.poll() is None
    s.close()
    return alive, worker._proc.poll() is not None, s._worker


def test_close_stops_the_partition_child() -> None:
    assert run_workers(_child_lifecycle_worker, 2) == [(True, True, None)] * 2


def _dead_child_worker(rank: int, w: int) -> list[tuple[bool, int]]:
    s = BatchShuffler(token_count)  # child process
    ref = BatchShuffler(token_count, executor="thread")
    out = []
    real_submit = PartitionWorker.submit_call

    def dying_submit(self: PartitionWorker, *args: Any, **kwargs: Any) -> Any:
        # The child dies while a partition is requested (e.g. the OOM killer).
        self._proc.kill()
        self._proc.wait()
        return real_submit(self, *args, **kwargs)

    for step in range(4):
        batch = make_batch(rank, 9, 9 - step, seed=20 + step)
        PartitionWorker.submit_call = dying_submit if rank == 0 and step in (1, 2) else real_submit  # type: ignore[method-assign]
        try:
            res = s.shuffle(batch)
        finally:
            PartitionWorker.submit_call = real_submit  # type: ignore[method-assign]
        assert_identical(res, ref.shuffle(batch))  # same partition as everywhere else
        out.append((s._worker is not None and s._worker.alive(), res.actual_batch_size))
    return out


def test_dead_partition_child_falls_back_and_restarts() -> None:
    outs = run_workers(_dead_child_worker, 2, timeout=60)
    # Rank 0's child was killed at steps 1 and 2: it partitioned in-process,
    # and started a new child at the next start.
    assert [alive for alive, _ in outs[0]] == [True, False, False, True]
    assert all(alive for alive, _ in outs[1])


def _complex_dense_worker(rank: int, w: int) -> str:
    batch = make_batch(rank, 4, 4, seed=3)
    batch = dataclasses.replace(batch, dense=batch.dense.to(torch.complex128))  # 16-byte items
    try:
        BatchShuffler(token_count).shuffle(batch)
    except ValueError as e:
        return str(e)
    return "no error"


def test_unsupported_dtype_is_rejected_in_phase_1() -> None:
    for msg in run_workers(_complex_dense_worker, 2):
        assert "[0, 1]" in msg, msg  # every rank names both offending ranks
        for r in (0, 1):
            assert f"dense: torch.complex128 has 16-byte elements, expected one of [1, 2, 4, 8] bytes (rank {r})" in msg


def _unplain_field_worker(rank: int, w: int) -> tuple[str, int]:
    batch = make_batch(rank, 4, 4, seed=3)
    bad = {0: batch.dense, 1: batch.dense.to_sparse()}[rank]  # rank 1 only: a sparse COO field
    s = BatchShuffler(token_count, timeout=60)
    try:
        s.shuffle(dataclasses.replace(batch, dense=bad))
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    conj = dataclasses.replace(batch, dense=batch.dense.to(torch.complex64).conj())  # a lazy conjugate view
    try:
        s.shuffle(conj)
    except ValueError as e:
        msg += " | " + str(e)
    return msg, s.shuffle(batch).actual_batch_size  # still usable


def test_sparse_and_conjugate_view_fields_are_rejected_in_phase_1() -> None:
    # They passed phase 1 (dtype and per-sample shape only) and failed in phase 2's
    # pack: with one rank's field sparse, that rank blamed its peer and the peer
    # waited out the shuffler's timeout; with every rank's, the shuffler closed.
    for msg, real in run_workers(_unplain_field_worker, 2):
        first, second = msg.split(" | ")
        assert first.endswith("invalid shuffle input on rank(s) [1]: dense: a sparse_coo tensor, expected a "
                              "plain (strided) tensor (t.to_dense() gives one) (rank 1)"), first
        assert "dense: a conjugate-view tensor, expected a plain (strided) tensor (t.resolve_conj() gives one)" \
            in second and "[0, 1]" in second
        assert real == 4


def _partition_raises_worker(rank: int, w: int) -> tuple[str, int]:
    calls = [0]

    def flaky(workloads: list[float], num_parts: int) -> list[list[int]]:
        calls[0] += 1
        if rank == 1 and calls[0] == 1:
            raise RuntimeError("no memory left on rank 1")
        return greedy(workloads, num_parts)

    s = BatchShuffler(token_count, partition=flaky, locality=False, timeout=60)
    batch = make_batch(rank, 4, 4, seed=3)
    try:
        s.shuffle(batch)
        msg = "no error"
    except (ValueError, RuntimeError) as e:
        msg = f"{type(e).__name__}: {e}"
    return msg, s.shuffle(batch).actual_batch_size + s.shuffle(batch).actual_batch_size


def test_a_partition_raising_on_one_rank_raises_on_every_rank() -> None:
    # The failing rank raised at once and skipped the plan-digest exchange; its
    # peer waited out the shuffler's timeout, then blamed it as stalled or dead.
    t0 = time.perf_counter()
    (m0, n0), (m1, n1) = run_workers(_partition_raises_worker, 2)
    assert time.perf_counter() - t0 < 30
    assert m0 == ("ValueError: BatchShuffler: shuffle #0: partition=flaky raised on rank(s) [1] (see their "
                  "errors); nothing was moved (rank 0)")
    assert m1 == "RuntimeError: no memory left on rank 1"  # its own error, as where it raises everywhere
    assert n0 + n1 == 16, "both later shuffles move every sample"


# ------------------------------------------------------------------ long run
def test_many_shuffles_leak_no_thread_fd_child_or_memory() -> None:
    """400 shuffles with two handles in flight (benchmarks/bench_longrun.py runs 10,000)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_longrun import worker

    for recs in run_workers(worker, 2, 400, 50, timeout=300):
        run, closed = recs[:-1], recs[-1]
        steady = [r for r in run if r["shuffles"] > 200]  # both shufflers started (the 2nd at #100)
        for key in ("threads", "fds", "children"):
            assert len({r[key] for r in steady}) == 1, (key, [r[key] for r in run])
        assert steady[-1]["rss_mib"] - steady[0]["rss_mib"] < 8, [r["rss_mib"] for r in run]
        # close() stops the background thread and the planner process
        assert closed["threads"] < steady[-1]["threads"] and closed["children"] == 0, closed


def _stride0_worker(rank: int, w: int, comm: str) -> tuple[list[Any], list[Any]]:
    batch = make_batch(rank, 6, 6, seed=11)
    if rank == 0:
        # Empty histories built from numpy: values of shape (0,) and stride (0,),
        # which phase 2 could not view as bytes (allgather raised on this rank only).
        f = batch.features
        empty = KeyedJaggedTensor(keys=f.keys(), values=torch.from_numpy(np.zeros(0, np.int64)),
                                  weights=torch.from_numpy(np.zeros(0, np.float32)),
                                  lengths=torch.zeros_like(f.lengths()))
        assert empty.values().stride() == (0,)
        batch = dataclasses.replace(batch, features=empty)
    shuffler = BatchShuffler(token_count, comm=comm, timeout=60.0)
    out = shuffler.shuffle(batch)
    shuffler.close()
    return rows(batch)[: batch.actual_batch_size], rows(out)[: out.actual_batch_size]


@pytest.mark.parametrize("comm", ["all2all", "allgather"])
def test_empty_values_with_stride_zero_shuffle(comm: str) -> None:
    outs = run_workers(_stride0_worker, 3, comm, timeout=120)
    assert Counter(r for before, _ in outs for r in before) == Counter(r for _, after in outs for r in after)


def _padding_lengths_worker(rank: int, w: int) -> tuple[str, str]:
    batch = make_batch(rank, 4, 4, seed=5, zero_frac=0.0)
    if rank == 0:
        # As a batch built on a GPU can be (its padding contents are checked at
        # construction only on the CPU): sample 3 becomes padding with its lengths.
        batch.actual_batch_size = 3
    try:
        BatchShuffler(token_count).shuffle(batch)
        return ("ok", "")
    except ValueError as e:
        return ("ValueError", str(e))


def test_a_padding_sample_with_lengths_fails_on_every_rank() -> None:
    lens = make_batch(0, 4, 4, seed=5, zero_frac=0.0).features.lengths().view(len(KEYS), 4)[:, 3].tolist()
    key = next(i for i, n in enumerate(lens) if n)
    for kind, msg in run_workers(_padding_lengths_worker, 2, timeout=120):
        assert kind == "ValueError" and f"padding sample 3 (actual_batch_size=3) has length {lens[key]} for key " \
            f"{KEYS[key]!r} of features, expected 0: samples from actual_batch_size on are padding and hold " \
            "no data; pad_batch appends such samples, or raise actual_batch_size to count it as real (rank 0)" \
            in msg, msg
