"""Pure planning (balancer._destinations, _plan, _plan_layout), run for every rank in one process."""

from __future__ import annotations

import numpy as np
import pytest

from balancer._destinations import destinations, partition, validate_partition
from balancer._layout import wire_layout
from balancer._plan import Gathered, plan_digest, plan_rank
from balancer._plan_layout import sample_bytes
from balancer.partition import PartitionWorker, balanced_partition, localize, lower_bound
from tests.reference import greedy
from tests.test_layout import layout_batch


def _random_case(rng: np.random.Generator, w: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    dest = rng.permutation(np.repeat(np.arange(w), b))
    real = rng.integers(0, b + 1, size=w)
    real[rng.integers(0, w)] = rng.choice([0, b])
    return dest, real


def test_plans_are_globally_consistent() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        w, b = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        dest, real = _random_case(rng, w, b)
        plans = [plan_rank(dest, b, real, r) for r in range(w)]
        seen = []
        for r, p in enumerate(plans):
            assert p.send_counts.sum() == real[r] == p.send_order.size
            assert p.num_out <= b
            # the send order groups this rank's real samples by destination
            assert sorted(p.send_order.tolist()) == list(range(real[r]))
            assert (np.diff(dest[r * b + p.send_order]) >= 0).all()
            for d in range(w):
                assert p.send_counts[d] == plans[d].recv_counts[r], (r, d)
                group = p.send_order[p.send_counts[:d].sum() : p.send_counts[: d + 1].sum()]
                got = plans[d].sources[plans[d].recv_counts[:r].sum() : plans[d].recv_counts[: r + 1].sum()]
                assert (r * b + group).tolist() == got.tolist(), (r, d)
            assert (np.diff(p.sources) > 0).all()
            seen += p.sources.tolist()
        expected = [g for g in range(w * b) if g % b < real[g // b]]
        assert sorted(seen) == expected  # every real sample exactly once, padding never


def test_plan_docstring_example() -> None:
    dest, real = np.array([0, 1, 1, 0, 0, 1]), np.array([3, 2])
    p0, p1 = plan_rank(dest, 3, real, 0), plan_rank(dest, 3, real, 1)
    assert (p0.send_order.tolist(), p0.send_counts.tolist(), p0.recv_counts.tolist(),
            p0.sources.tolist()) == ([0, 1, 2], [1, 2], [1, 2], [0, 3, 4])
    assert (p1.send_order.tolist(), p1.send_counts.tolist(), p1.recv_counts.tolist(),
            p1.sources.tolist()) == ([0, 1], [2, 0], [2, 0], [1, 2])


def test_validate_partition() -> None:
    assert [p.tolist() for p in validate_partition([[1, 0], [3, 2]], 2, 2)] == [[1, 0], [3, 2]]
    with pytest.raises(ValueError, match="3 parts, expected num_parts=2"):
        validate_partition([[0], [1], [2, 3]], 2, 2)
    with pytest.raises(ValueError, match="part 0 has 1 indices, expected batch_size=2"):
        validate_partition([[0], [1, 2, 3]], 2, 2)
    with pytest.raises(ValueError, match="an index repeats"):
        validate_partition([[0, 1], [1, 3]], 2, 2)
    with pytest.raises(ValueError, match=r"expected \[0, 4\)"):
        validate_partition([[0, 1], [2, 4]], 2, 2)
    # Cast to int64 these were read as [[0, 1], [2, 3]] and [[1, 0], [3, 2]]: a silent, wrong plan.
    with pytest.raises(ValueError, match=r"part 0 has dtype float64, expected integer sample indices"):
        validate_partition([[0.5, 1.5], [2.5, 3.5]], 2, 2)
    with pytest.raises(ValueError, match=r"part 1 has dtype bool, expected integer sample indices"):
        validate_partition([[1, 0], [True, False]], 2, 2)
    assert validate_partition([np.array([3, 2], np.uint8), [1, 0]], 2, 2).tolist() == [[3, 2], [1, 0]]
    d = destinations(validate_partition([[3, 0], [1, 2]], 2, 2), 4)
    assert d.tolist() == [0, 1, 1, 0]


def _gathered(workloads: np.ndarray, w: int, b: int, real: np.ndarray | None = None) -> Gathered:
    real = np.full(w, b) if real is None else real
    return Gathered(workloads.astype(np.float64), np.ones((w, 2, b), np.int64), real)


def test_partition_never_worsens_the_max_load_and_bounds_it() -> None:
    rng = np.random.default_rng(1)
    layout = wire_layout(layout_batch(["a", "b"], b=4)).plan_layout()
    for _ in range(30):
        w, b = 3, 4
        workloads = rng.integers(0, 20, size=w * b)
        for fn in (greedy, None):
            out = partition(_gathered(workloads, w, b), layout, fn=fn, worker=None, locality=fn is None,
                            localize=localize, lower_bound=lower_bound)
            loads = np.bincount(out.dest, weights=workloads, minlength=w)
            assert loads.max() <= workloads.reshape(w, b).sum(1).max()
            assert loads.max() >= out.lower_bound - 1e-9
            assert np.bincount(out.dest).tolist() == [b] * w
    # a partition worse than the current placement is not applied
    workloads = np.array([1, 9, 5, 5, 1, 9])
    out = partition(_gathered(workloads, 2, 3), layout, fn=lambda wl, n: [[1, 3, 5], [0, 2, 4]], worker=None,
                    locality=False, localize=localize, lower_bound=lower_bound)
    assert out.dest.tolist() == [0, 0, 0, 1, 1, 1]


def test_child_thread_and_in_process_partitions_agree() -> None:
    """The child process, its in-process fallback and the thread path give the same destinations."""
    rng = np.random.default_rng(4)
    layout = wire_layout(layout_batch(["a", "b"], b=8)).plan_layout()
    worker = PartitionWorker()
    try:
        for _ in range(8):
            w, b = 4, 8
            g = Gathered(rng.lognormal(3, 1.5, w * b) * 1e-6, rng.integers(0, 9, (w, 2, b)), np.full(w, b))
            args = dict(locality=True, localize=localize, lower_bound=lower_bound)
            child = partition(g, layout, fn=None, worker=worker, **args)
            local = partition(g, layout, fn=None, worker=None, **args)
            thread = partition(g, layout, fn=balanced_partition, worker=None, **args)
            assert child.dest.tolist() == local.dest.tolist() == thread.dest.tolist()
            assert child.lower_bound == pytest.approx(lower_bound(g.workloads, w), rel=1e-12)
            assert plan_digest(child.dest) == plan_digest(local.dest.copy())
    finally:
        worker.close()


def test_plan_digest_tells_plans_apart() -> None:
    d = np.array([0, 1, 1, 0])
    assert plan_digest(d) == plan_digest(d.copy()) != plan_digest(np.array([1, 0, 1, 0]))


def test_sample_bytes() -> None:
    batch = layout_batch(["a", "b"])
    lay = wire_layout(batch).plan_layout()
    lengths = np.array([[[1, 2, 0, 0], [0, 3, 0, 0]]])  # one rank, 2 keys, B=4
    # per sample: int64 values + fp16 weights per element, a f32 label, 3 f64 dense
    assert sample_bytes(lay, lengths).tolist() == [10 + 4 + 24, 50 + 4 + 24, 28, 28]


def test_plan_step_in_the_planner_process_equals_in_process() -> None:
    """The planner process and the in-thread fallback return the same Step (dest, exchange, stats)."""
    from balancer._header import H_REAL, HEADER_LEN
    from balancer._step import plan_step

    rng = np.random.default_rng(9)
    layout = wire_layout(layout_batch(["a", "b"], b=8)).plan_layout()
    w, b = 3, 8
    rows = np.zeros((w, HEADER_LEN + b + b), np.int64)
    rows[:, H_REAL] = [8, 5, 8]
    rows[:, HEADER_LEN : HEADER_LEN + b] = (rng.lognormal(2, 1, (w, b)) * 1e-3).view(np.int64)
    rows[:, HEADER_LEN + b :] = rng.integers(0, 9, (w, 2 * b)).astype(np.int32).view(np.int64)
    worker = PartitionWorker()
    try:
        for rank in range(w):
            args = dict(rows=rows, layout=layout, seq=3, rank=rank, comm="all2all", locality=True)
            child, local = worker.submit_call(plan_step, **args).wait_call(), plan_step(**args)
            assert child.digest == local.digest and child.dest.tolist() == local.dest.tolist()
            assert child.exchange.send_splits == local.exchange.send_splits
            assert np.array_equal(child.exchange.blob.i64, local.exchange.blob.i64)
            assert child.stats.load_after == local.stats.load_after
    finally:
        worker.close()
