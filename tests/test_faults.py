"""Every cross-rank disagreement is a clear error on every rank, in bounded time.

One test per way ranks can disagree (layout, configuration, partition,
shuffle order, a stalled peer), the scale of workloads, the edge shapes, and a
randomised fault test: a random bad field or setting on a random rank, 50
cases, every rank must raise the same ``ValueError`` and the group must stay
usable -- no hang, no abort.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer.errors import ShuffleAbortedError
from balancer.shuffler import BatchShuffler
from balancer.testing import WorkerError, run_workers, run_workers_outcomes
from tests.reference import greedy
from tests.test_shuffler import TaggedBatch, make_batch, rows, token_count

TIMEOUT = 3.0  # the shuffler timeout of the stall tests (grace: 1.5 s)


# The stall tests order their ranks by files in a shared directory, not by fixed
# sleeps: a flag outside torch.distributed, which the tests take down on purpose.
def _mark(where: str, name: str) -> None:
    Path(where, name).touch()


def _wait_for(where: str, name: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not Path(where, name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name!r} not marked in {where} within {limit:g} s")
        time.sleep(0.02)


def _leave_together(where: str, rank: int, w: int) -> None:
    """Wait until every rank got here: rank 0 hosts the store through which peers
    learn who is missing, so it stays up while they look (as a real job's ranks,
    still raising at that point, do)."""
    _mark(where, f"leaving{rank}")
    for r in range(w):
        _wait_for(where, f"leaving{r}")


def _outcome(fn: Any) -> tuple[str, str, float]:
    t0 = time.perf_counter()
    try:
        fn()
        return "ok", "", time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the test compares types and texts across ranks
        return type(e).__name__, str(e), time.perf_counter() - t0


def _home(workloads: np.ndarray, n: int) -> list[list[int]]:
    """Another valid partition: every sample stays home. The batches' loads
    differ by rank (lengths grow with the rank), so greedy always moves some."""
    b = workloads.size // n
    return [list(range(r * b, (r + 1) * b)) for r in range(n)]


# --------------------------------------------------- disagreements, one by one
def _with_lengths(batch: TaggedBatch, dtype: torch.dtype | None = None, weights: bool = True) -> TaggedBatch:
    f = batch.features
    kjt = KeyedJaggedTensor(keys=f.keys(), values=f.values(), lengths=f.lengths().to(dtype or f.lengths().dtype),
                            weights=f.weights() if weights else None)
    return dataclasses.replace(batch, features=kjt)


def _disagreement_worker(rank: int, w: int) -> dict[str, tuple[str, str, float]]:
    odd = rank == w - 1
    out: dict[str, tuple[str, str, float]] = {}
    shared = BatchShuffler(token_count)

    def data_case(name: str, batch: TaggedBatch) -> None:
        out[name] = _outcome(lambda: shared.shuffle(batch))

    b = make_batch(rank, 8, 8, seed=1)
    data_case("warm", b)
    wrong = make_batch(rank, 8, 8, seed=1)
    if odd:
        wrong.dense = torch.zeros(7, 3)  # replaced after construction
    data_case("dense_dim0", wrong)
    # Batches that cannot even be read used to raise in start_shuffle_async on
    # this rank only: its peers waited in phase 1, and the next step mixed.
    unreadable = make_batch(rank, 8, 8, seed=1)
    if odd:
        unreadable.batch_size = None  # type: ignore[assignment]
    data_case("batch_size_none", unreadable)
    nested = make_batch(rank, 8, 8, seed=1)
    if odd:
        nested.dense = torch.nested.nested_tensor([torch.zeros(3)] * 7 + [torch.zeros(2)])
    data_case("nested_dense", nested)
    numpy_real = make_batch(rank, 8, 6, seed=1)
    numpy_real.actual_batch_size = np.int64(6)  # type: ignore[assignment]  # accepted, as by the constructor
    data_case("numpy_real", numpy_real)
    data_case("lengths_dtype", _with_lengths(b, torch.int32) if odd else b)
    data_case("weights_one_rank", _with_lengths(b, weights=not odd))
    # Settings that stay on their rank (a received sample takes the receiver's) were not
    # compared: each rank kept its own, and the HSTU cost of contextual keys differed.
    data_case("max_seqlen", dataclasses.replace(b, feature_to_max_seqlen={"a": 2}) if odd else b)
    data_case("contextual", dataclasses.replace(b, contextual_feature_names=["b"]) if odd else b)
    data_case("after", b)

    def fresh(name: str, **kwargs: Any) -> None:
        s = BatchShuffler(token_count, **kwargs)
        out[name] = _outcome(lambda: s.shuffle(b))
        s.close()

    fresh("locality", locality=not odd)
    fresh("comm", comm="allgather" if odd else "all2all")

    def rank_dependent(workloads: np.ndarray, n: int) -> list[list[int]]:
        return _home(workloads, n) if odd else greedy(workloads, n)

    fresh("partition", partition=rank_dependent)
    return out


def test_disagreements_raise_the_same_clear_error_on_every_rank() -> None:
    w = 3
    outs = run_workers(_disagreement_worker, w, timeout=120)
    expect = {
        "dense_dim0": "dense: shape (7, 3), expected [batch_size=8, ...] (rank 2)",
        "batch_size_none": "batch_size=None (NoneType), expected an int >= 1 (rank 2)",
        "nested_dense": "the batch could not be read: RuntimeError: ",
        "lengths_dtype": "'features.lengths dtype': ranks [0, 1]: 'torch.int64'; rank 2: 'torch.int32'",
        "weights_one_rank": "'features.weights dtype': ranks [0, 1]: 'torch.float32'; rank 2: 'absent'",
        "max_seqlen": "'feature_to_max_seqlen': ranks [0, 1]: \"{'a': 7}\"; rank 2: \"{'a': 2}\"",
        "contextual": "'contextual_feature_names': ranks [0, 1]: '[]'; rank 2: \"['b']\"",
        "locality": "'locality': ranks [0, 1]: 'True'; rank 2: 'False'",
        "comm": "'comm': ranks [0, 1]: 'all2all'; rank 2: 'allgather'",
        "partition": "partition=rank_dependent returned different partitions on different ranks "
                     "(rank(s) [2] differ from rank 0)",
    }
    for rank, out in enumerate(outs):
        assert out["warm"][0] == out["after"][0] == out["numpy_real"][0] == "ok", (rank, out)
        for name, text in expect.items():
            kind, msg, dt = out[name]
            assert kind == "ValueError" and text in msg, (rank, name, msg)
            assert msg == outs[0][name][1], (rank, name)  # the same text everywhere
            assert dt < 30, (rank, name, dt)


# ------------------------------------------- interrupts in the user's code
def _interrupt_worker(rank: int, w: int) -> dict[str, tuple[str, str, float]]:
    """A ``KeyboardInterrupt`` / ``SystemExit`` in one rank's ``workload_fn`` or
    partition (user code) on rank ``w - 1``, then an ordinary shuffle."""
    odd = rank == w - 1
    out: dict[str, tuple[str, str, float]] = {}
    calls = {"n": 0}

    def interrupted(batch: TaggedBatch) -> torch.Tensor:
        calls["n"] += 1
        if odd and calls["n"] == 2:
            raise KeyboardInterrupt("ctrl-c in workload_fn")
        return token_count(batch)

    def exiting(workloads: np.ndarray, n: int) -> list[list[int]]:
        if odd:
            raise SystemExit(3)
        return greedy(workloads, n)

    b = make_batch(rank, 8, 8, seed=1)
    for name, s in (("workload_fn", BatchShuffler(interrupted, timeout=60)),
                    ("partition", BatchShuffler(token_count, partition=exiting, timeout=60))):
        if name == "workload_fn":
            s.shuffle(b)  # the agreement in place: the interrupt comes at a later step
        t0 = time.perf_counter()
        try:
            h = s.start_shuffle_async(b)  # never raises: the interrupt is the shuffle's to report
            s.finish_shuffle(b, h)
            out[name] = ("ok", "", time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - the test compares what each rank raised
            out[name] = (type(e).__name__, str(e), time.perf_counter() - t0)
        if name == "workload_fn":
            s.shuffle(b)  # still usable on every rank
            out["after"] = ("ok", "", 0.0)
        s.close()
    return out


def test_an_interrupt_in_user_code_on_one_rank_reaches_every_rank_at_once() -> None:
    """The peers of a rank whose ``workload_fn`` or partition raised a
    ``KeyboardInterrupt`` or ``SystemExit`` used to wait out the shuffler
    timeout; that rank still gets its own exception."""
    outs = run_workers(_interrupt_worker, 3, timeout=120)
    for rank, out in enumerate(outs):
        assert out["after"][0] == "ok", (rank, out)
        kind, msg, dt = out["workload_fn"]
        if rank == 2:
            assert (kind, msg) == ("KeyboardInterrupt", "ctrl-c in workload_fn"), out
        else:
            assert kind == "ValueError", out
            assert "workload_fn raised KeyboardInterrupt: ctrl-c in workload_fn (rank 2)" in msg, out
        kind, msg, dt2 = out["partition"]
        if rank == 2:
            assert (kind, msg) == ("SystemExit", "3"), out
        else:
            assert kind == "ValueError" and "rank(s) [2]" in msg, out
        assert max(dt, dt2) < 30, out  # not the 60 s timeout


# --------------------------------------------------------- stalls and skips
def _stall_worker(rank: int, w: int, mode: str, where: str) -> tuple[str, str, float, Any, Any]:
    s = BatchShuffler(token_count, timeout=TIMEOUT)
    s.shuffle(make_batch(rank, 8, 8, seed=2))  # groups and agreement in place
    batch = make_batch(rank, 8, 8, seed=3)  # imbalanced: samples move, so phase 2 communicates
    t0 = time.perf_counter()
    err: Any = None
    try:
        if mode == "no_start" and rank == 1:
            _wait_for(where, "gave_up")  # until rank 0 gave up on it
            _leave_together(where, rank, w)
            return "slept", "", 0.0, None, None
        h = s.start_shuffle_async(batch)
        if mode == "stall_after_start" and rank == 1:
            _wait_for(where, "gave_up")
        if mode == "skip_finish" and rank == 1:
            del h  # never finished on this rank
            h = s.start_shuffle_async(batch)
        s.finish_shuffle(batch, h)
        return "ok", "", time.perf_counter() - t0, None, None
    except ShuffleAbortedError as e:
        err = e
    finally:
        if rank == 0:
            _mark(where, "gave_up")
    dt = time.perf_counter() - t0
    later = _outcome(lambda: s.shuffle(batch))  # the shuffler is closed now
    _leave_together(where, rank, w)
    return type(err).__name__, str(err), dt, (err.phase, err.missing), later[:2]


def _first_start_worker(rank: int, w: int, where: str) -> tuple[Any, ...]:
    s = BatchShuffler(token_count, timeout=TIMEOUT)
    batch = make_batch(rank, 8, 8, seed=3)
    if rank == 1:  # never reaches its first shuffle (e.g. a slow first data load)
        _leave_together(where, rank, w)
        return ("slept",)
    t0 = time.perf_counter()
    h = s.start_shuffle_async(batch)  # does not raise: the error is finish_shuffle's
    try:
        s.finish_shuffle(batch, h)
        return ("ok",)
    except ShuffleAbortedError as e:
        later = _outcome(lambda: s.shuffle(batch))
        _leave_together(where, rank, w)
        return (type(e).__name__, e.phase, str(e), time.perf_counter() - t0, later[:2])


def test_a_peer_that_never_reaches_the_first_shuffle_is_reported_by_finish(tmp_path: Path) -> None:
    # The shuffler's groups are created at the first shuffle: a peer that never
    # came made start_shuffle_async itself raise a raw DistStoreError.
    out = run_workers(_first_start_worker, 2, str(tmp_path), timeout=60)[0]
    kind, phase, msg, dt, later = out
    assert (kind, phase) == ("ShuffleAbortedError", "phase 1"), out
    assert "the shuffler's groups were not set up within its timeout of 3 s: rank(s) [1] never started its " \
        "first shuffle" in msg, msg  # once "a rank never started", naming none
    assert dt < TIMEOUT + 10, dt
    assert later[0] == "RuntimeError" and "closed after an aborted shuffle" in later[1], later


def _two_setups_worker(rank: int, w: int, where: str) -> Any:
    first, second = BatchShuffler(token_count, timeout=TIMEOUT), BatchShuffler(token_count, timeout=TIMEOUT)
    batch = make_batch(rank, 8, 8, seed=3)
    if rank == 1:  # the first shuffler's setup fails here, rank 0 being absent
        err = _outcome(lambda: first.shuffle(batch))
        _mark(where, "first_failed")
        _leave_together(where, rank, w)  # never calls the second
        return err[:1]
    _wait_for(where, "first_failed")
    try:
        second.shuffle(batch)
        return ("ok",)
    except ShuffleAbortedError as e:
        return (type(e).__name__, e.missing, str(e))
    finally:
        _leave_together(where, rank, w)


def test_a_setup_diagnosis_is_not_confused_by_another_shufflers(tmp_path: Path) -> None:
    # Both shufflers' setup keys were the same (shuffle #0 over the same ranks), so
    # rank 1's key from the first made rank 0 report that every rank reached the
    # second one's setup.
    second, first = run_workers(_two_setups_worker, 2, str(tmp_path), timeout=90)  # rank 0: the second shuffler
    assert first == ("ShuffleAbortedError",), first
    kind, missing, msg = second
    assert (kind, missing) == ("ShuffleAbortedError", [1]) and "rank(s) [1] never started" in msg, second


def _late_first_worker(rank: int, w: int, where: str) -> tuple[Any, ...]:
    s = BatchShuffler(token_count, timeout=TIMEOUT)
    batch = make_batch(rank, 8, 8, seed=3)
    if rank == 1:  # its setup times out, rank 0 being late; then it lives on (a checkpoint, say)
        err = _outcome(lambda: s.shuffle(batch))
        _mark(where, "gave_up")
        _leave_together(where, rank, w)
        return err[0], err[1]
    _wait_for(where, "gave_up")
    got = _outcome(lambda: s.shuffle(batch))
    again = _outcome(lambda: s.shuffle(batch))
    _leave_together(where, rank, w)
    return got, again[:2]


def test_a_rank_late_for_the_first_shuffle_fails_at_once_when_its_peers_gave_up(tmp_path: Path) -> None:
    # The late rank created the groups anyway: gloo retried its connections to the live
    # peer's stale address for 15 s (five times the timeout of 3 s; about 25 min with the
    # default 300 s) before the abort.
    (kind, msg, dt), again = run_workers(_late_first_worker, 2, str(tmp_path), timeout=90)[0]
    assert kind == "ShuffleAbortedError", (kind, msg)
    assert "the shuffler's groups were not set up: 1 other rank(s) gave up creating them before this rank " \
        "started its first shuffle (their timeout of 3 s had passed: this rank is late" in msg, msg
    assert dt < TIMEOUT, dt
    assert again == ("RuntimeError", f"BatchShuffler is closed after an aborted shuffle: {msg}"), again


@pytest.mark.parametrize("mode", ["no_start", "stall_after_start", "skip_finish"])
def test_a_stalled_or_skipping_peer_is_named_within_the_timeout(mode: str, tmp_path: Path) -> None:
    outs = run_workers_outcomes(_stall_worker, 2, mode, str(tmp_path), timeout=60)
    assert not any(isinstance(o, WorkerError) for o in outs), outs
    kind, msg, dt, (phase, missing), later = outs[0]
    assert kind == "ShuffleAbortedError" and missing == [1], outs[0]
    assert phase == ("phase 1" if mode == "no_start" else "phase 2"), outs[0]
    assert f"rank(s) [1] did not take part within the shuffler's timeout of {TIMEOUT:g} s" in msg
    assert dt < TIMEOUT + 1.5 + 3, dt  # timeout + grace + slack: bounded, never the group's 30 min
    assert later[0] == "RuntimeError" and "closed after an aborted shuffle" in later[1]
    if mode == "skip_finish":  # the skipping rank waited in phase 1 of its next shuffle
        assert outs[1][0] == "ShuffleAbortedError" and outs[1][3] == ("phase 1", [0]), outs[1]


def _late_worker(rank: int, w: int, settle: bool, where: str) -> tuple[str, str, Any]:
    s = BatchShuffler(token_count, timeout=TIMEOUT)
    s.shuffle(make_batch(rank, 8, 8, seed=2))
    batch = make_batch(rank, 8, 8, seed=3)
    if rank == 1:
        _wait_for(where, "gave_up")  # gets there after rank 0 gave up
    try:
        handle = s.start_shuffle_async(batch)
        while settle and rank == 1 and not handle._job.done():  # type: ignore[union-attr]
            time.sleep(0.01)  # its phase 1 aborts before finish_shuffle is called
        s.finish_shuffle(batch, handle)
        return "ok", "", None
    except ShuffleAbortedError as e:
        if rank == 0:
            _mark(where, "gave_up")
        _leave_together(where, rank, w)
        return type(e).__name__, str(e), e.missing


@pytest.mark.parametrize("settle", [False, True])
def test_the_late_rank_is_not_told_that_every_rank_reached_it(settle: bool, tmp_path: Path) -> None:
    # The rank that stalled was told "every rank reached it, but the collective
    # failed: Connection closed by peer", pointing away from itself. (A guess from
    # the reports' wall-clock times told it that it was late, but also told an
    # on-time rank whose peer failed on its own: the message says both cases.)
    # settle: its phase 1 aborted before it called finish_shuffle, which then
    # raised RuntimeError "closed after an aborted shuffle" instead of the abort
    # (a CI run lost that race without settle).
    outs = run_workers(_late_worker, 2, settle, str(tmp_path), timeout=90)
    assert outs[0][0] == "ShuffleAbortedError" and outs[0][2] == [1], outs[0]
    kind, msg, missing = outs[1]
    assert kind == "ShuffleAbortedError" and missing == [], outs[1]
    assert "every rank reported a failure of the collective: " in msg and "(if this rank got there after the " \
        f"others' timeout of {TIMEOUT:g} s, their errors name it)" in msg, msg
    assert "every rank reached it" not in msg


def _dead_peer_worker(rank: int, w: int) -> tuple[str, str, Any, float]:
    s = BatchShuffler(token_count, timeout=60.0)
    s.shuffle(make_batch(rank, 8, 8, seed=2))
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)  # dies between shuffles
    t0 = time.perf_counter()
    try:
        s.shuffle(make_batch(rank, 8, 8, seed=3))
        return "ok", "", None, 0.0
    except ShuffleAbortedError as e:
        return type(e).__name__, str(e), e.missing, time.perf_counter() - t0


def test_a_dead_peer_is_not_reported_as_a_timeout() -> None:
    # Raised within seconds, the error said the peer "did not take part within the
    # shuffler's timeout of 60 s".
    outs = run_workers_outcomes(_dead_peer_worker, 2, timeout=90)
    kind, msg, missing, took = outs[0]
    assert kind == "ShuffleAbortedError" and missing == [1] and took < 30, outs[0]
    assert re.search(r"the collective failed after \d+\.\d s, before the shuffler's timeout of 60 s \(.*\); "
                     r"rank\(s\) \[1\] reported no failure of their own within 5 s \(dead, gone from the group, "
                     r"or still waiting in the collective\)", msg), msg


# ----------------------------------------------------------- workload scale
def _scale_worker(rank: int, w: int) -> list[tuple[Any, ...]]:
    out = []
    for scale in (1, 1e-9, 3e-7, 1e-3, 0.7, 1e3, 1e9, "int1000"):
        def fn(batch: Any, scale: Any = scale) -> torch.Tensor:
            t = token_count(batch)
            return t * 1000 if scale == "int1000" else t.double() * scale

        for comm in ("all2all", "allgather"):
            s = BatchShuffler(fn, comm=comm)
            for seed in range(3):
                batch = make_batch(rank, 8, 8 - seed, seed=40 + seed)
                h = s.start_shuffle_async(batch)
                got = s.finish_shuffle(batch, h)
                st = h.stats
                out.append((scale, comm, seed, rows(got), h._job.result().dest.tolist(),  # type: ignore[union-attr]
                            st.imbalance_before, st.imbalance_after, st.moved_fraction, st.load_after))
            s.close()
    return out


def test_partitions_and_stats_do_not_depend_on_the_workload_scale() -> None:
    """Costs in seconds (token_count * 1e-3) or FLOPs (* 1e9) balance exactly like token counts."""
    per_rank = run_workers(_scale_worker, 3, timeout=180)
    for res in per_rank:
        base = {(comm, seed): r for scale, comm, seed, *r in res if scale == 1}
        moved = 0.0
        for scale, comm, seed, got, dest, before, after, frac, loads in res:
            ref = base[(comm, seed)]
            assert got == ref[0] and dest == ref[1], (scale, comm, seed)
            assert before == pytest.approx(ref[2], rel=1e-12) and after == pytest.approx(ref[3], rel=1e-12)
            assert frac == ref[4]
            factor = 1000 if scale == "int1000" else scale
            assert loads == pytest.approx([factor * v for v in ref[5]], rel=1e-12)
            moved += frac
        assert moved > 0  # samples did move: small costs are not rounded away


# ------------------------------------------------------------- edge shapes
@dataclasses.dataclass(kw_only=True)
class _EdgeBatch(TaggedBatch):
    empty_dense: torch.Tensor  # [B, 0]
    no_keys: KeyedJaggedTensor  # a KJT with no keys


def _edge_batch(rank: int, b: int, real: int, seed: int, all_empty: bool) -> _EdgeBatch:
    base = make_batch(rank, b, real, seed=seed, labels="dense", zero_frac=1.0 if all_empty else 0.2)
    if all_empty:  # every KJT of the batch is empty
        f = base.features
        base = dataclasses.replace(base, features=KeyedJaggedTensor(
            keys=f.keys(), values=f.values()[:0], weights=f.weights()[:0], lengths=torch.zeros_like(f.lengths())),
            extra=KeyedJaggedTensor(keys=["e"], values=base.extra.values()[:0],
                                    lengths=torch.zeros(b, dtype=torch.int32)))
    labels = torch.zeros(b, 0)  # zero-width labels
    return _EdgeBatch(**{f.name: getattr(base, f.name) for f in dataclasses.fields(TaggedBatch)
                         if f.name != "labels"}, labels=labels, empty_dense=torch.zeros(b, 0, dtype=torch.int8),
                      no_keys=KeyedJaggedTensor(keys=[], values=torch.zeros(0), lengths=torch.zeros(0, dtype=torch.int64)))


def _edge_worker(rank: int, w: int) -> list[tuple[Any, ...]]:
    out = []
    flat = lambda batch: torch.arange(batch.batch_size, 0, -1) * (1 + batch.features.lengths().new_tensor(0))  # noqa: E731
    for comm in ("all2all", "allgather"):
        for all_empty in (False, True):
            s = BatchShuffler(token_count if not all_empty else flat, comm=comm)
            batch = _edge_batch(rank, 6, [6, 4, 6][rank], seed=5, all_empty=all_empty)
            h = s.start_shuffle_async(batch)
            got = s.finish_shuffle(batch, h)
            assert got.empty_dense.shape == (6, 0) and got.labels.shape == (6, 0)
            assert got.no_keys.keys() == [] and got.no_keys.lengths().numel() == 0
            out.append((comm, all_empty, rows(batch)[: batch.actual_batch_size],
                        rows(got)[: got.actual_batch_size], h.stats.comm))
            s.close()
    return out


def test_zero_width_fields_and_empty_kjts_on_both_paths() -> None:
    per_rank = run_workers(_edge_worker, 3, timeout=120)
    for case in range(len(per_rank[0])):
        before = Counter(r for res in per_rank for r in res[case][2])
        after = Counter(r for res in per_rank for r in res[case][3])
        assert before == after and sum(before.values()) == 16, per_rank[0][case][:2]
        assert per_rank[0][case][4] != "none", per_rank[0][case][:2]  # samples did move


# -------------------------------------------------------- randomised faults
_FAULTS = ("dense_dim0", "negative", "nan", "raise", "shape", "batch_size", "real_out_of_range",
           "lengths_dtype", "no_weights", "values_short", "complex", "locality", "comm", "partition")


def _fault_worker(rank: int, w: int, cases: int) -> list[tuple[str, int, str, str]]:
    rng = random.Random(2024)  # the same draws on every rank
    mode = {"fault": "", "bad": -1}
    me = lambda: mode["bad"] == rank  # noqa: E731

    def workloads(batch: Any) -> Any:
        t = token_count(batch).double()
        if me() and mode["fault"] == "negative":
            t[1] = -1.0
        if me() and mode["fault"] == "nan":
            t[0] = float("nan")
        if me() and mode["fault"] == "raise":
            raise RuntimeError("estimator failed")
        if me() and mode["fault"] == "shape":
            return t[:-2]
        return t

    shared = BatchShuffler(workloads)
    out = []
    for _ in range(cases):
        fault, bad = rng.choice(_FAULTS), rng.randrange(w)
        mode.update(fault=fault, bad=bad)
        batch = make_batch(rank, 8, 7, seed=rng.randrange(1000))
        s = shared
        if me():
            if fault == "dense_dim0":
                batch.dense = torch.zeros(9, 3)
            elif fault == "batch_size":
                batch = make_batch(rank, 6, 6, seed=0)
            elif fault == "real_out_of_range":
                batch.actual_batch_size = 11
            elif fault == "lengths_dtype":
                batch = _with_lengths(batch, torch.int32)
            elif fault == "no_weights":
                batch = _with_lengths(batch, weights=False)
            elif fault == "values_short":
                object.__setattr__(batch.extra, "_values", batch.extra.values()[:0])
            elif fault == "complex":
                batch.dense = batch.dense.to(torch.complex64)
        if fault in ("locality", "comm", "partition"):
            def partition(x: np.ndarray, n: int) -> list[list[int]]:
                return _home(x, n) if me() else greedy(x, n)

            kwargs = {"locality": {"locality": not me()}, "comm": {"comm": "allgather" if me() else "all2all"},
                      "partition": {"partition": partition}}[fault]
            s = BatchShuffler(workloads, **kwargs)
        kind, msg, _ = _outcome(lambda s=s, batch=batch: s.shuffle(batch))
        out.append((fault, bad, kind, msg))
        if s is not shared:
            s.close()
    kind, _, _ = _outcome(lambda: shared.shuffle(make_batch(rank, 8, 8, seed=1)))
    out.append(("good", -1, kind, ""))
    return out


def test_randomised_faults_never_hang_or_abort() -> None:
    w, cases = 4, 50
    per_rank = run_workers(_fault_worker, w, cases, timeout=300)  # a hang fails as a timeout
    faults = Counter(f for f, *_ in per_rank[0][:-1])
    assert len(faults) >= 10, faults  # most kinds were drawn
    for i in range(cases):
        fault, bad = per_rank[0][i][:2]
        msgs = {res[i][3] for res in per_rank}
        kinds = {res[i][2] for res in per_rank}
        assert kinds == {"ValueError"}, (i, fault, bad, [res[i] for res in per_rank])
        assert len(msgs) == 1, (i, fault, msgs)  # the same text on every rank
        (msg,) = msgs
        assert f"[{bad}]" in msg or f"rank {bad}" in msg, (i, fault, bad, msg)
    assert all(res[-1][2] == "ok" for res in per_rank)  # the shared shuffler is still usable


# ------------------------------------------------ phase 2 on the caller's group
def _phase2_on_callers_group_fails_worker(rank: int, w: int, where: str) -> dict[str, Any]:
    from balancer import _comm

    # Phase 2 of a CUDA batch runs on the caller's NCCL group, where no timeout of
    # ours applies; the caller's gloo group stands in for it here.
    _comm.ShuffleGroups.phase2_group = lambda self, device: self.user  # type: ignore[method-assign]
    s = BatchShuffler(token_count, partition=greedy, locality=False, timeout=20)
    batch = make_batch(rank, 6, 6, seed=1)
    h = s.start_shuffle_async(batch)
    out: dict[str, Any] = {}
    if rank == 1:
        def out_of_memory(*args: Any, **kwargs: Any) -> Any:
            raise torch.OutOfMemoryError("CUDA out of memory (injected while packing)")

        _comm.execute = out_of_memory  # type: ignore[assignment]
        try:
            s.finish_shuffle(batch, h)
        except torch.OutOfMemoryError as e:  # raised as itself, for the caller's handler
            out["raised"] = (type(e).__name__, getattr(e, "__notes__", []))
        try:
            s.start_shuffle_async(batch)
        except RuntimeError as e:
            out["next"] = str(e)
    _leave_together(where, rank, w)  # rank 0 hosts the store; its phase 1 is done once rank 1's is
    s.close()  # rank 0 leaves its phase 2 alone: on NCCL it would wait for the group's own timeout
    return out


def test_a_failure_around_phase_2_on_the_callers_group_closes_the_shuffler(tmp_path: Path) -> None:
    # It was raised, the shuffler left open: a rank that caught the out-of-memory error
    # and went on paired its next collective on that group with its peers' pending
    # all-to-all (on NCCL, a hang until the watchdog or wrong data).
    res = run_workers(_phase2_on_callers_group_fails_worker, 2, str(tmp_path), timeout=120)
    name, notes = res[1]["raised"]
    assert name == "OutOfMemoryError"
    want = ("BatchShuffler: phase 2 of shuffle #0 failed on rank 1 around its collective on the caller's "
            "process group; the other ranks may have issued theirs, so that group is out of step")
    if hasattr(BaseException, "add_note"):
        assert any(n.startswith(want) for n in notes), notes
    assert res[1]["next"].startswith("BatchShuffler is closed after an aborted shuffle: " + want), res[1]["next"]
