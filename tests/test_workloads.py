"""Tests for balancer.workloads: FLOP models against brute-force references."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer.batch import BaseBatch
from balancer.transformer_cost import TransformerCost
from balancer.workloads import (
    MAX_COST,
    HSTUAttentionCost,
    PolynomialCost,
    SelfAttentionCost,
    TokenCount,
    calibrate,
    fit_polynomial,
    measure_times,
    sequence_lengths,
)


def make_batch(
    lengths: dict[str, list[int]],
    actual_batch_size: int | None = None,
    contextual: list[str] | None = None,
    lengths_dtype: torch.dtype = torch.int64,
) -> BaseBatch:
    """A batch whose features have the given per-sample lengths (key order kept)."""
    keys = list(lengths)
    b = len(lengths[keys[0]])
    flat = torch.tensor([n for k in keys for n in lengths[k]], dtype=lengths_dtype)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.arange(int(flat.sum())), lengths=flat
    )
    return BaseBatch(
        features=kjt,
        batch_size=b,
        feature_to_max_seqlen={k: max(v) for k, v in lengths.items()},
        contextual_feature_names=contextual or [],
        actual_batch_size=actual_batch_size,
    )


# ------------------------------------------------ brute-force references
def matmul_flops(m: int, k: int, n: int) -> int:
    """[m, k] @ [k, n]: m * n outputs, each k multiply-adds of 2 FLOPs."""
    return 2 * m * k * n


def attention_pairs(length: int, causal: bool) -> int:
    return sum(1 for i in range(length) for j in range(length) if j <= i or not causal)


def hstu_reference(length: int, d: int, h: int, da: int, dl: int, layers: int, causal: bool) -> int:
    per_layer = matmul_flops(length, d, h * (2 * dl + 2 * da))  # X -> U, V, Q, K
    for _head in range(h):
        for _pair in range(attention_pairs(length, causal)):
            per_layer += 2 * da  # one score q_i . k_j
            per_layer += 2 * dl  # a_ij * v_j accumulated into out_i
    per_layer += matmul_flops(length, h * dl, d)  # output projection
    return layers * per_layer


def transformer_reference(
    length: int, d: int, h: int, hd: int, f: int, layers: int, causal: bool, gated: bool
) -> int:
    per_layer = 3 * matmul_flops(length, d, h * hd)  # Q, K, V
    pairs = attention_pairs(length, causal)
    per_layer += h * pairs * (2 * hd + 2 * hd)  # scores and A V
    per_layer += matmul_flops(length, h * hd, d)
    per_layer += (3 if gated else 2) * matmul_flops(length, d, f)
    return layers * per_layer


# ------------------------------------------------------------ lengths
def test_sequence_lengths_sums_keys_and_casts_int32() -> None:
    batch = make_batch({"a": [1, 2, 0], "b": [4, 0, 0], "c": [9, 9, 0]}, 2, lengths_dtype=torch.int32)
    out = sequence_lengths(batch, ["a", "b"])
    assert out.dtype == torch.int64
    assert out.tolist() == [5, 2, 0]


def test_interleaved_doubles_and_contextual_prefix_added() -> None:
    batch = make_batch({"user": [1, 1, 0], "age": [1, 1, 0], "item": [3, 0, 0]}, 2, ["user", "age"])
    assert sequence_lengths(batch, ["item"]).tolist() == [3, 0, 0]
    assert sequence_lengths(batch, ["item"], interleaved=True).tolist() == [6, 0, 0]
    both = sequence_lengths(batch, ["item"], interleaved=True, include_contextual=True)
    assert both.tolist() == [8, 2, 0]


def test_interleaved_cost_equals_cost_of_doubled_sequence() -> None:
    cost = HSTUAttentionCost(["item"], hidden_dim=16, num_heads=2, head_dim=4, linear_dim=8)
    single = make_batch({"item": [5, 1, 7]})
    double = make_batch({"item": [10, 2, 14]})
    inter = dataclasses.replace(cost, interleaved=True)
    assert torch.equal(inter(single), cost(double))


def test_contextual_prefix_counts_in_flops() -> None:
    cost = HSTUAttentionCost(["item"], hidden_dim=8, num_heads=1, head_dim=4, linear_dim=4)
    batch = make_batch({"ctx": [2, 2], "item": [3, 0]}, contextual=["ctx"])
    expect = [hstu_reference(5, 8, 1, 4, 4, 1, True), hstu_reference(2, 8, 1, 4, 4, 1, True)]
    assert cost(batch).tolist() == expect
    no_ctx = dataclasses.replace(cost, include_contextual=False)
    assert no_ctx(batch).tolist() == [hstu_reference(3, 8, 1, 4, 4, 1, True), 0]


def test_contextual_also_in_feature_names_raises() -> None:
    batch = make_batch({"ctx": [1], "item": [3]}, contextual=["ctx"])
    with pytest.raises(ValueError, match="both feature_names and contextual"):
        HSTUAttentionCost(["ctx", "item"], 8, 1, 4, 4)(batch)


def test_unknown_feature_lists_available_keys() -> None:
    batch = make_batch({"item": [1, 2], "action": [1, 2]})
    with pytest.raises(ValueError, match=r"\['nope'\].*available keys: \['item', 'action'\]"):
        TokenCount(["item", "nope"])(batch)


# ------------------------------------------------------- FLOP models
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d,h,da,dl,layers", [(8, 1, 4, 4, 1), (12, 3, 2, 5, 2), (32, 2, 16, 8, 3)])
def test_hstu_matches_brute_force(causal: bool, d: int, h: int, da: int, dl: int, layers: int) -> None:
    lengths = [0, 1, 2, 7, 13]
    cost = HSTUAttentionCost(["s"], d, h, da, dl, num_layers=layers, causal=causal)
    out = cost(make_batch({"s": lengths}))
    assert out.dtype == torch.int64 and out.shape == (len(lengths),)
    assert out.tolist() == [hstu_reference(n, d, h, da, dl, layers, causal) for n in lengths]


@pytest.mark.parametrize("causal,gated", list(itertools.product([True, False], repeat=2)))
def test_self_attention_matches_brute_force(causal: bool, gated: bool) -> None:
    lengths = [0, 1, 4, 11]
    cost = SelfAttentionCost(["s"], hidden_dim=12, num_heads=3, mlp_ratio=2.5, num_layers=2,
                             causal=causal, gated_mlp=gated)
    expect = [transformer_reference(n, 12, 3, 4, 30, 2, causal, gated) for n in lengths]
    assert cost(make_batch({"s": lengths})).tolist() == expect


def test_self_attention_explicit_head_dim() -> None:
    cost = SelfAttentionCost(["s"], hidden_dim=10, num_heads=4, head_dim=6)
    assert cost(make_batch({"s": [5]})).tolist() == [transformer_reference(5, 10, 4, 6, 40, 1, True, False)]


def test_textbook_transformer_total() -> None:
    # Non-causal, f = 4d: the well-known 24 L d^2 + 4 L^2 d per layer.
    d, n = 64, 100
    cost = SelfAttentionCost(["s"], hidden_dim=d, num_heads=8, causal=False)
    assert cost(make_batch({"s": [n]})).item() == 24 * n * d * d + 4 * n * n * d


def test_padding_is_zero_and_zero_length_real_is_constant() -> None:
    batch = make_batch({"s": [0, 3, 0, 0]}, actual_batch_size=2)
    flops = HSTUAttentionCost(["s"], 8, 2, 4, 4)
    assert flops(batch).tolist()[0] == 0 and flops(batch).tolist()[2:] == [0, 0]
    poly = PolynomialCost(["s"], a=1.0, b=2.0, c=50.0)
    assert poly(batch).tolist() == [50, 9 + 6 + 50, 0, 0]
    assert TokenCount(["s"])(batch).tolist() == [0, 3, 0, 0]


def test_polynomial_rounds_floats_and_clamps_negative() -> None:
    batch = make_batch({"s": [1, 2, 10]})
    assert PolynomialCost(["s"], a=0.25, b=0.5, c=0.1)(batch).tolist() == [1, 2, 30]
    assert PolynomialCost(["s"], b=-1.0, c=5.0)(batch).tolist() == [4, 3, 0]


@pytest.mark.parametrize(
    "cost",
    [
        HSTUAttentionCost(["s"], 64, 4, 16, 16, num_layers=3),
        SelfAttentionCost(["s"], 64, 4, gated_mlp=True),
        TokenCount(["s"]),
        PolynomialCost(["s"], a=0.5, b=3.0, c=1.0),
    ],
)
def test_monotonic_in_length(cost: object) -> None:
    lengths = list(range(0, 200, 7)) + [10**4, 10**5, 10**6]
    out = cost(make_batch({"s": lengths}))  # type: ignore[operator]
    assert out.dtype == torch.int64 and out.shape == (len(lengths),)
    assert bool((out[1:] >= out[:-1]).all())


def test_large_lengths_no_overflow() -> None:
    lengths = [10**6, 10**6 - 1, 1, 0]
    big = HSTUAttentionCost(["s"], hidden_dim=8192, num_heads=64, head_dim=256, linear_dim=256,
                            num_layers=10**4)
    out = big(make_batch({"s": lengths}))
    assert out.dtype == torch.int64
    assert (out >= 0).all()
    assert out.tolist()[:2] == [MAX_COST, MAX_COST]  # saturates, never wraps
    assert 0 < out[2] < MAX_COST and out[3] == 0
    # Below the cap the value is the exact count up to float64 rounding.
    mid = HSTUAttentionCost(["s"], hidden_dim=1024, num_heads=8, head_dim=128, linear_dim=128,
                            num_layers=4)
    n, pairs = 10**6, 10**6 * (10**6 + 1) // 2
    layer = matmul_flops(n, 1024, 8 * 512) + 8 * pairs * 512 + matmul_flops(n, 8 * 128, 1024)
    exact = 4 * layer
    got = int(mid(make_batch({"s": [10**6]})).item())
    assert exact < MAX_COST and abs(got - exact) <= exact * 1e-15


@pytest.mark.parametrize(
    "make",
    [
        lambda: HSTUAttentionCost(["s"], -1, 2, 4, 4),
        lambda: HSTUAttentionCost(["s"], 8, 0, 4, 4),
        lambda: HSTUAttentionCost(["s"], 8, 2, 4, 4, num_layers=-3),
        lambda: SelfAttentionCost(["s"], 10, 3),
        lambda: SelfAttentionCost(["s"], 12, 3, mlp_ratio=-1.0),
        lambda: TokenCount([]),
        lambda: TokenCount(["s", "s"]),
        lambda: PolynomialCost(["s"], a=float("nan")),
        # OverflowError at construction (10**400) or at every later call (the others)
        lambda: PolynomialCost(["s"], a=10**400),
        lambda: SelfAttentionCost(["s"], 12, 3, mlp_ratio=1e308),
        lambda: HSTUAttentionCost(["s"], 10**160, 10**160, 4, 4),
        lambda: TransformerCost(hidden_size=10**200, intermediate_size=8, num_layers=1, num_heads=1),
    ],
)
def test_constructor_validation(make: object) -> None:
    with pytest.raises(ValueError, match="expected|duplicates|divisible"):
        make()  # type: ignore[operator]


def test_polynomial_cost_takes_numpy_numbers() -> None:
    cost = PolynomialCost(["s"], a=np.int64(2), b=np.float32(0.5), c=3)
    assert cost.coefficients() == (2.0, 0.5, 3.0) and type(cost.a) is float and type(cost.c) is int


def test_single_name_string_and_hashable() -> None:
    cost = TokenCount("s")
    assert cost.feature_names == ("s",)
    assert hash(cost) == hash(TokenCount(["s"]))


# ------------------------------------------------------- calibration
LENGTHS = np.array([0, 16, 64, 128, 256, 512, 1024, 2048], dtype=np.float64)


def test_fit_recovers_noiseless_coefficients() -> None:
    times = (3.0 * LENGTHS**2 + 50.0 * LENGTHS + 1000.0) * 1e-9  # seconds
    cal = fit_polynomial(LENGTHS, times)
    assert cal.a == pytest.approx(3.0, rel=1e-6)
    assert cal.b == pytest.approx(50.0, rel=1e-6)
    assert cal.c == pytest.approx(1000.0, rel=1e-6)
    assert cal.r2 == pytest.approx(1.0) and cal.rmse < 1e-15


def test_fit_recovers_noisy_coefficients() -> None:
    rng = np.random.default_rng(0)
    lengths = np.repeat(LENGTHS, 20)
    clean = (3.0 * lengths**2 + 500.0 * lengths + 2e4) * 1e-9
    cal = fit_polynomial(lengths, clean * (1 + 0.02 * rng.standard_normal(lengths.size)))
    assert cal.a == pytest.approx(3.0, rel=0.05)
    assert cal.b == pytest.approx(500.0, rel=0.3)
    assert cal.r2 > 0.99


def test_relative_fit_keeps_short_lengths_accurate() -> None:
    # Lengths over decades with multiplicative timing noise: the absolute fit is
    # decided by the longest lengths and mispredicts short ones; the relative
    # fit (default) stays within the noise everywhere.
    rng = np.random.default_rng(1)
    lengths = np.repeat(np.geomspace(8, 4096, 10).round(), 5)
    clean = 30e-9 * lengths**2 + 4e-6 * lengths + 50e-6
    noisy = clean * (1 + 0.05 * rng.standard_normal(lengths.size))
    worst = {}
    for relative in (False, True):
        cal = fit_polynomial(lengths, noisy, relative=relative)
        pred = (cal.a * lengths**2 + cal.b * lengths + cal.c) / cal.scale
        worst[relative] = float(np.max(np.abs(pred / clean - 1)))
    assert worst[True] < 0.1
    assert worst[False] > 2 * worst[True]


def kkt_holds(cal_coef: np.ndarray, x: np.ndarray, y: np.ndarray) -> bool:
    """NNLS optimality: gradient 0 on positive coefficients, >= 0 on zero ones."""
    grad = x.T @ (x @ cal_coef - y) / np.linalg.norm(x, axis=0) / np.linalg.norm(y)
    return bool(np.all(cal_coef >= 0) and np.all(np.abs(grad[cal_coef > 0]) < 1e-8)
                and np.all(grad[cal_coef == 0] > -1e-8))


def test_fit_nonneg_when_data_suggests_negative() -> None:
    times = LENGTHS**2 - 800.0 * LENGTHS + 2e5  # unconstrained b = -800
    free = fit_polynomial(LENGTHS, times, nonneg=False, scale=1.0)
    assert free.b == pytest.approx(-800.0, rel=1e-6)
    x = np.stack([LENGTHS**2, LENGTHS, np.ones_like(LENGTHS)], axis=1)
    for relative in (False, True):
        cal = fit_polynomial(LENGTHS, times, scale=1.0, relative=relative)
        coef = np.array([cal.a, cal.b, cal.c])
        assert (coef >= 0).all() and cal.b == 0.0
        w = 1.0 / times if relative else np.ones_like(times)
        assert kkt_holds(coef, x * w[:, None], times * w)
    # Costs from it stay non-negative and non-decreasing.
    out = cal.to_cost(["s"])(make_batch({"s": [0, 10, 100, 1000]})).tolist()
    assert out == sorted(out) and out[0] >= 0


def test_fit_degree_and_input_validation() -> None:
    cal = fit_polynomial(LENGTHS, 7.0 * LENGTHS + 3.0, degree=1, scale=1.0)
    assert cal.a == 0.0 and cal.b == pytest.approx(7.0) and cal.c == pytest.approx(3.0)
    with pytest.raises(ValueError, match="distinct lengths"):
        fit_polynomial([5, 5, 5], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="expected equal"):
        fit_polynomial([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError, match="degree"):
        fit_polynomial([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0], degree=3)
    # Accepted before: True fitted degree 1, "no" was a truthy nonneg, 2-D input was flattened
    with pytest.raises(ValueError, match=r"degree=True, expected 0, 1 or 2"):
        fit_polynomial([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0], degree=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"nonneg='no', expected a bool"):
        fit_polynomial([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0], nonneg="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"lengths has shape \(2, 2\) and times \(2, 2\), expected 1-D"):
        fit_polynomial([[1, 2], [3, 4]], [[1.0, 2.0], [3.0, 4.0]])


class FakeClock:
    """A clock that advances only when the fake workload runs."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0

    def __call__(self) -> float:
        return self.now

    def work(self, length: int) -> None:
        self.calls += 1
        self.now += (2.0 * length**2 + 100.0 * length + 5000.0) * 1e-9


def test_calibrate_with_deterministic_measure_fn() -> None:
    clock = FakeClock()
    lengths = [1, 32, 128, 512, 1024]
    cost = calibrate(clock.work, lengths, ["item"], repeats=3, warmup=2, clock=clock,
                     interleaved=True)
    assert clock.calls == len(lengths) * 5
    assert isinstance(cost, PolynomialCost) and cost.interleaved
    assert (cost.a, cost.b, cost.c) == pytest.approx((2.0, 100.0, 5000.0), rel=1e-6)
    batch = make_batch({"item": [3, 0, 0]}, actual_batch_size=2)  # L = 6 (interleaved), 0
    assert cost(batch).tolist() == [2 * 36 + 600 + 5000, 5000, 0]


def test_fit_is_scale_free_and_overflow_is_named() -> None:
    # Times of 1e300 s raised OverflowError, denormal times and lengths of 1e160
    # LinAlgError; the fit now runs in units of the largest length and time.
    times = (3.0 * LENGTHS**2 + 50.0 * LENGTHS + 1000.0) * 1e-9
    ref = fit_polynomial(LENGTHS, times)
    for t_unit, l_unit in ((1e-300, 1.0), (1e-310 / 1e-3, 1.0), (1.0, 1e150)):
        cal = fit_polynomial(LENGTHS * l_unit, times * t_unit, scale=1.0)
        got = (cal.a * l_unit**2 / t_unit, cal.b * l_unit / t_unit, cal.c / t_unit)
        assert got == pytest.approx((ref.a / 1e9, ref.b / 1e9, ref.c / 1e9), rel=1e-6), (t_unit, l_unit)
        assert cal.r2 == pytest.approx(ref.r2)
    with pytest.raises(ValueError, match=r"overflow float64 at scale=1e\+09 with times up to 1e\+300"):
        fit_polynomial(LENGTHS, times / times.max() * 1e300)
    assert fit_polynomial(LENGTHS, times / times.max() * 1e300, scale=1e-9).c > 0


def test_calibrate_refuses_a_clock_that_never_advances() -> None:
    with pytest.raises(ValueError, match="every measured time is 0"):
        calibrate(lambda length: None, [1, 2, 4], ["s"], clock=lambda: 0.0)


def test_measure_times_median() -> None:
    clock = FakeClock()
    assert measure_times(clock.work, [0, 10], repeats=3, clock=clock) == pytest.approx(
        [5000e-9, 6200e-9]
    )
    with pytest.raises(ValueError, match="repeats"):
        measure_times(clock.work, [1], repeats=0)
    with pytest.raises(ValueError, match=r"repeats=2.5, warmup=1, expected ints"):  # a bare TypeError before
        measure_times(clock.work, [1], repeats=2.5)  # type: ignore[arg-type]
    assert len(measure_times(clock.work, [1], repeats=np.int64(2))) == 1
    assert len(measure_times(clock.work, (n for n in (1, 2)), repeats=1)) == 2  # a generator, read once
    cost = calibrate(clock.work, (n for n in (1, 32, 128)), ["item"], clock=clock)  # fitted on the same lengths
    assert (cost.a, cost.b, cost.c) == pytest.approx((2.0, 100.0, 5000.0), rel=1e-6)
    # "every measured time is 0 (0 lengths): the clock did not advance" before
    with pytest.raises(ValueError, match=r"lengths is empty, expected at least one length to time"):
        calibrate(clock.work, [], ["item"], clock=clock)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_on_device_without_host_sync() -> None:
    cpu = make_batch({"ctx": [1, 1, 0], "item": [4, 9, 0]}, 2, ["ctx"])
    batch = cpu.to(torch.device("cuda"))
    costs = [HSTUAttentionCost(["item"], 16, 2, 8, 8, interleaved=True),
             SelfAttentionCost(["item"], 16, 2), PolynomialCost(["item"], 1.5, 2.0, 3.0)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [c(batch) for c in costs]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for c, out in zip(costs, outs, strict=True):
        assert out.device.type == "cuda" and out.dtype == torch.int64
        assert torch.equal(out.cpu(), c(cpu))


def test_fit_of_equal_times_reports_an_exact_fit() -> None:
    # Rounding in the mean left both sums near 1e-36, and R^2 of an exact fit came
    # out as 0.0 (7e-3 s) or -3 (other values): a spurious "fits poorly" warning.
    lengths = np.array([1.0, 2.0, 3.0, 4.0, 50.0])
    for t in (0.1, 0.3, 7e-3, 1.7, 2.3e-5):
        for relative in (False, True):
            cal = fit_polynomial(lengths, np.full(5, t), relative=relative)
            assert cal.r2 == 1.0, (t, relative, cal)
            assert cal.c == pytest.approx(t * cal.scale, rel=1e-12)
            assert cal.a * 50**2 + cal.b * 50 <= 1e-9 * cal.c  # the constant carries it


def test_estimators_price_a_token_batch_by_its_seq_lens() -> None:
    # They read batch.features: on a TokenBatch, AttributeError ('TokenBatch'
    # object has no attribute 'features'), so BatchShuffler(TransformerCost(...))
    # needed a lambda over seq_lens.
    from balancer import BatchShuffler, TokenBatch

    lens = torch.tensor([3, 0, 7, 0])  # a real sample of no tokens, and a padding sample
    batch = TokenBatch(batch_size=4, seq_lens=lens.to(torch.int32), actual_batch_size=3,
                       tokens={"ids": torch.zeros(4, 8, dtype=torch.int64)})
    cost = TransformerCost(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, vocab_size=50)
    estimators = [cost, TokenCount(["unused"]),
                  HSTUAttentionCost(["unused"], hidden_dim=8, num_heads=2, head_dim=4, linear_dim=4, num_layers=1,
                                    interleaved=True)]
    for est in estimators:
        a, b, c = est.coefficients()
        x = lens.to(torch.float64) * (2 if getattr(est, "interleaved", False) else 1)
        want = ((a * x + b) * x + c).round().to(torch.int64) * torch.tensor([1, 1, 1, 0])  # padding costs 0
        assert torch.equal(est(batch), want), (type(est).__name__, est(batch), want)
    shuffled = BatchShuffler(cost).shuffle(batch)  # one process: a workload_fn call, nothing moves
    assert shuffled.seq_lens.tolist() == [3, 0, 7, 0]
