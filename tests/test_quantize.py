"""Scale-free integer workloads: invariant to the unit, exact for integer costs."""

from __future__ import annotations

import numpy as np

from balancer._quantize import QUANT_BITS, quantize
from tests.reference import scale_free


def test_docstring_examples_and_edges() -> None:
    assert quantize(np.array([3.0, 0.0, 1.5e-9])).tolist() == [2**26, 0, 0]
    assert quantize(np.array([2, 1])).tolist() == [2**26, 2**25]
    assert quantize(np.zeros(3)).tolist() == [0, 0, 0]
    assert quantize(np.zeros(0)).tolist() == []
    assert quantize(np.array([1e-300, 5e-301])).tolist() == [2**QUANT_BITS, 2**(QUANT_BITS - 1)]


def test_matches_the_independent_reference() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.lognormal(0, 3, 200) * 10.0 ** rng.integers(-12, 12)
        assert quantize(x).tolist() == scale_free(x).tolist()


def test_integer_costs_times_any_constant_give_the_same_integers() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.zipf(1.2, 4096).clip(1, 4096)
    for base in (lengths, lengths**2 + 256 * lengths, rng.integers(0, 2**24, 1000)):
        want = quantize(base)
        for c in (1e-9, 3.7e-7, 1e-3, 0.5, 7, 1e6, 1e9, 123456.789):
            assert quantize(base * c).tolist() == want.tolist(), c
        assert quantize(base.astype(np.int64) * 1000).tolist() == want.tolist()
