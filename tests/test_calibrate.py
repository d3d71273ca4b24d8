"""Online calibration: the fit, and a shuffler that learns the cost model from measured times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from balancer._calibrate import OnlineFit, features, nnls_small
from balancer.shuffler import BatchShuffler
from balancer.testing import run_workers
from tests.test_shuffler import make_batch, token_count


def test_nnls_small_is_exact_and_non_negative() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((40, 4))
    assert np.allclose(nnls_small(a, a @ np.array([1.0, 0.0, 2.0, 0.5])), [1.0, 0.0, 2.0, 0.5])
    coef = nnls_small(a, a @ np.array([1.0, -3.0, 2.0, 0.0]))
    assert (coef >= 0).all()
    # brute force over a grid agrees that no non-negative fit is better
    res = lambda c: float(np.sum((a @ c - a @ np.array([1.0, -3.0, 2.0, 0.0])) ** 2))  # noqa: E731
    assert all(res(coef) <= res(np.maximum(coef + d, 0)) + 1e-9 for d in rng.normal(0, 0.1, (200, 4)))


def _observations(rng: np.random.Generator, steps: int, w: int, fit: OnlineFit, truth: np.ndarray,
                  outliers: float = 0.0, equal_counts: bool = False, w_is_length: bool = False,
                  corrupt: Callable[[int, np.ndarray], None] | None = None) -> None:
    """``steps`` shuffles' features and noisy times; ``corrupt(seq, times)`` may
    change a step's times before they are observed."""
    for seq in range(steps):
        lengths = rng.zipf(1.3, w * 16).clip(1, 2048)
        dest = rng.permutation(np.repeat(np.arange(w), 16)) if equal_counts else rng.integers(0, w, w * 16)
        workloads = lengths.astype(float) if w_is_length else np.zeros(lengths.size)
        feats = features(workloads, lengths, dest, np.ones(lengths.size, bool), w)
        fit.record(seq, feats)
        times = 0.01 + feats @ truth
        times *= 1 + rng.normal(0, 0.02, w)
        times[rng.random(w) < outliers] *= 3  # a preempted rank
        if corrupt is not None:
            corrupt(seq, times)
        fit.observe(np.full(w, seq), times)


TRUTH = np.array([0.0, 2e-7, 3e-5, 1e-4])  # per sample: beta L^2 + gamma L + delta


def test_online_fit_recovers_the_model_despite_noise_and_outliers() -> None:
    fit = OnlineFit(min_observations=16)
    rng = np.random.default_rng(1)
    _observations(rng, 1, 8, fit, TRUTH)
    assert fit.fit() is None  # 8 observations: not enough yet
    _observations(rng, 40, 8, fit, TRUTH, outliers=0.1)
    model = fit.fit()
    assert model is not None and model.rel_error < 0.05
    # an uninformative workload_fn: the length terms carry the model (the
    # constants are ~1 % of a step here, at the noise level, and change no
    # partition of equal counts)
    np.testing.assert_allclose([model.beta, model.gamma], TRUTH[1:3], rtol=0.1)
    assert 200 < model.observations < 250  # the ~10 % outliers were dropped, little else
    # deterministic: the same observations give the same model, bit for bit
    again = OnlineFit(min_observations=16)
    rng = np.random.default_rng(1)
    _observations(rng, 1, 8, again, TRUTH)
    _observations(rng, 40, 8, again, TRUTH, outliers=0.1)
    assert again.fit() == model


@pytest.mark.parametrize("bad", [1e-9, 1e-200, 1e-310, 5e-324])
def test_a_misread_tiny_time_is_an_outlier_not_a_broken_fit(bad: float) -> None:
    # One rank reporting 5e-324 s once (record_compute takes any finite time
    # > 0) overflowed 1 / time to inf: every later fit raised LinAlgError and
    # every shuffle failed; 1e-200 made the fit find nothing (calibration off).
    def misread(seq: int, times: np.ndarray) -> None:
        if seq == 3:
            times[0] = bad

    clean, hit = OnlineFit(min_observations=16), OnlineFit(min_observations=16)
    _observations(np.random.default_rng(0), 10, 8, clean, TRUTH)
    _observations(np.random.default_rng(0), 10, 8, hit, TRUTH, corrupt=misread)
    model, ref = hit.fit(), clean.fit()
    assert model is not None and ref is not None
    assert model.observations == ref.observations - 1  # that one time dropped, every other kept
    np.testing.assert_allclose([model.beta, model.gamma], [ref.beta, ref.gamma], rtol=0.02)


def test_one_step_reported_far_too_short_costs_few_good_observations() -> None:
    # With two rejection rounds, one time 100x too short pulled the first fit
    # towards it and ~8 good observations were dropped in its place (cost
    # differences ~12 % off in the median of 20 seeds); rounds now run until
    # the kept set settles (~4 %).
    lengths_out = np.array([1, 16, 128, 512, 2048])
    want = TRUTH[1] * lengths_out**2 + TRUTH[2] * lengths_out
    errors, dropped = [], []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        fit = OnlineFit(min_observations=16)
        bad = int(rng.integers(0, 80))

        def too_short(seq: int, times: np.ndarray, bad: int = bad) -> None:
            if bad // 8 == seq:
                times[bad % 8] *= 0.01

        _observations(rng, 10, 8, fit, TRUTH, corrupt=too_short)
        model = fit.fit()
        assert model is not None
        got = model.costs(np.zeros(lengths_out.size), lengths_out)
        errors.append(float(np.max(np.abs((got[1:] - got[0]) - (want[1:] - want[0])) / (want[1:] - want[0]))))
        dropped.append(79 - model.observations)
    assert statistics.median(errors) < 0.06 and statistics.median(dropped) <= 2, (errors, dropped)


def test_unidentified_directions_do_not_change_what_balancing_sees() -> None:
    """With equal counts a per-sample constant is a per-step one, and with
    workload_fn = L its coefficient and gamma trade off: the fit may split them
    either way, but the cost differences between samples -- all that an
    equal-count partition depends on -- are the true ones."""
    fit = OnlineFit(min_observations=16)
    _observations(np.random.default_rng(2), 40, 8, fit, TRUTH, equal_counts=True, w_is_length=True)
    model = fit.fit()
    assert model is not None
    lengths = np.array([1, 16, 256, 2048])
    got = model.costs(lengths.astype(float), lengths)
    want = (TRUTH[1] * lengths + TRUTH[2]) * lengths + TRUTH[3]
    np.testing.assert_allclose(got - got[0], want - want[0], rtol=0.1)


def _true_seconds(batch: Any) -> float:
    """The compute time a rank 'measures': quadratic in the length (token_count is linear)."""
    lens = token_count(batch)[: batch.actual_batch_size].double()
    return float((lens**2 * 1e-4 + 1e-3).sum()) + 0.01


def _calibration_worker(rank: int, w: int) -> dict[str, Any]:
    true_cost = lambda b: token_count(b).double() ** 2 + 10  # noqa: E731 - the oracle knows the model
    shufflers = {"wrong": BatchShuffler(token_count),
                 "calibrated": BatchShuffler(token_count, calibrate=True, calibration_keys=["a", "b", "c"]),
                 "oracle": BatchShuffler(true_cost)}
    stragglers: dict[str, list[float]] = {k: [] for k in shufflers}
    models = []
    for step in range(40):
        batch = make_batch(rank, 16, 16, seed=200 + step, zero_frac=0.0)
        for name, s in shufflers.items():
            h = s.start_shuffle_async(batch)
            out = s.finish_shuffle(batch, h)
            t = torch.tensor([_true_seconds(out)])
            everyone = [torch.zeros(1) for _ in range(w)]
            torch.distributed.all_gather(everyone, t)
            times = [float(x) for x in everyone]
            stragglers[name].append(max(times) / statistics.mean(times))
            s.record_compute(h, _true_seconds(out))
            if name == "calibrated":
                models.append(h.stats.calibration)
    return {"stragglers": stragglers, "models": models}


def test_shuffler_learns_the_cost_model_from_measured_times() -> None:
    outs = run_workers(_calibration_worker, 3, timeout=300)
    models = outs[0]["models"]
    first = next(i for i, m in enumerate(models) if m is not None)
    assert first <= 12, first  # in use after a few steps of 3 ranks
    assert all(o["models"] == models for o in outs)  # the same model on every rank
    last = models[-1]
    assert last is not None and last.beta > 0 and last.rel_error < 0.05, last
    late = slice(25, 40)
    s = outs[0]["stragglers"]
    wrong, calibrated, oracle = (statistics.mean(s[k][late]) for k in ("wrong", "calibrated", "oracle"))
    assert calibrated <= oracle + 0.01 and calibrated < wrong - 0.01, (wrong, calibrated, oracle)


def test_calibration_keys_are_checked() -> None:
    for bad in ("a", [], {"a", "b"}, ["a", 1]):
        with pytest.raises(ValueError, match=r"calibration_keys=.*, expected None or a non-empty sequence of str"):
            BatchShuffler(token_count, calibrate=True, calibration_keys=bad)  # type: ignore[arg-type]
    # An iterator is read once: the check must not consume it (it once left no keys).
    it = BatchShuffler(token_count, calibrate=True, calibration_keys=iter(["a", "b"]))
    assert it.calibration_keys == ("a", "b") and it._config["calibration_keys"] == "('a', 'b')"
    # Without calibration they were accepted, then failed every multi-rank shuffle
    # (and never a single-rank one): refused at construction.
    with pytest.raises(ValueError, match=r"BatchShuffler: calibration_keys=\('a',\) name the features online "
                                         r"calibration measures L from; they need calibrate=True"):
        BatchShuffler(token_count, calibration_keys=["a"])
    from balancer.config import BalancerConfig
    with pytest.raises(ValueError, match=r"calibration_keys=\('a',\) .*need online_calibration=True"):
        BalancerConfig(calibration_keys=("a",))
    assert BalancerConfig(online_calibration=True, calibration_keys=("a",)).calibration_keys == ("a",)
    s = BatchShuffler(token_count, calibrate=True, calibration_keys=["a", "nope"])
    from balancer._layout import wire_layout

    with pytest.raises(ValueError, match=r"calibration_keys \['nope'\] are not keys .*\['a', 'b', 'c', 'e', 'y'\]"):
        s._length_rows(wire_layout(make_batch(0, 4, 4, seed=0)))


def test_record_compute_checks_its_input() -> None:
    s = BatchShuffler(token_count, calibrate=True)
    batch = make_batch(0, 4, 4, seed=0)
    h = s.start_shuffle_async(batch)
    with pytest.raises(ValueError, match="not a finished handle of this shuffler"):
        s.record_compute(h, 1.0)
    s.finish_shuffle(batch, h)
    for bad in (0.0, -1.0, float("nan"), True):
        s.record_compute(h, bad)  # type: ignore[arg-type]  # fails the next shuffle (on every rank)
        h2 = s.start_shuffle_async(batch)
        with pytest.raises(ValueError, match=r"invalid shuffle input on rank\(s\) \[0\]: record_compute: "
                                             r"seconds=.*, expected a finite number > 0 \(rank 0\)"):
            s.finish_shuffle(batch, h2)
    s.record_compute(h, 0.5)
    assert s._calibration.latest() == (h.seq, 0.5)
    BatchShuffler(token_count).record_compute(h, 1.0)  # without calibrate: ignored


def _unreadable_events_worker(rank: int, w: int) -> dict[str, Any]:
    s = BatchShuffler(token_count, calibrate=True, timeout=60)
    batch = make_batch(rank, 8, 8, seed=7)
    h = s.start_shuffle_async(batch)
    s.finish_shuffle(batch, h)
    if rank == 1:  # real torch events, never recorded: their elapsed time cannot be read
        s.record_compute(h, events=[(torch.Event(device="cpu", enable_timing=True),
                                     torch.Event(device="cpu", enable_timing=True))])
    else:
        s.record_compute(h, 0.25)
    t0 = time.monotonic()
    h = s.start_shuffle_async(batch)
    try:
        s.finish_shuffle(batch, h)
        error = ""
    except ValueError as e:
        error = str(e)
    waited = time.monotonic() - t0
    h = s.start_shuffle_async(batch)  # the bad report is dropped: the shuffler goes on
    out = s.finish_shuffle(batch, h)
    s.record_compute(h, 0.0 if rank == 0 else 0.25)  # a coarse clock's 0 on one rank
    try:
        s.shuffle(batch)
        zero = ""
    except ValueError as e:
        zero = str(e)
    s.close()
    return {"error": error, "waited": waited, "real": out.actual_batch_size, "zero": zero}


def test_unreadable_events_fail_the_next_shuffle_on_every_rank() -> None:
    # They were read in start_shuffle_async on the reporting rank only, which raised
    # there before phase 1 while its peers waited in it for the shuffler's timeout.
    outs = run_workers(_unreadable_events_worker, 2, timeout=120)
    for o in outs:
        assert "record_compute: the events reported for shuffle #0 cannot be timed: ValueError: Both events " \
               "must be recorded" in o["error"] and "(rank 1)" in o["error"], o["error"]
        assert o["waited"] < 30, o["waited"]
        assert o["real"] == 8
        assert o["zero"].endswith("invalid shuffle input on rank(s) [0]: record_compute: seconds=0.0, expected a "
                                  "finite number > 0 (rank 0)"), o["zero"]


def test_record_compute_checks_the_events_it_is_given() -> None:
    s = BatchShuffler(token_count, calibrate=True)
    batch = make_batch(0, 4, 4, seed=0)
    h = s.start_shuffle_async(batch)
    s.finish_shuffle(batch, h)
    event = torch.Event(device="cpu", enable_timing=True)
    for bad in ([event], [(event,)], [(event, 1.0)], (event, event)):
        s.record_compute(h, events=bad)  # type: ignore[arg-type]
        h2 = s.start_shuffle_async(batch)
        with pytest.raises(ValueError, match=r"record_compute: events=.*, expected \(start, end\) pairs of "
                                             r"timing events.* \(rank 0\)"):
            s.finish_shuffle(batch, h2)
    s.record_compute(h, events=[(event, event)])  # checked for its shape only: read at the next shuffle
    assert s._calibration._timing is not None
