"""The two integer rules (balancer/_ints.py) that every argument check uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from balancer._ints import as_count, is_int


@pytest.mark.parametrize("value,minimum,expected", [
    (0, None, True), (-3, None, True), (3, 1, True), (1, 1, True), (0, 1, False), (1, 2, False),
    (True, None, False), (False, 0, False),  # a bool is an int to Python, never a count here
    (np.int64(3), None, False), (3.0, None, False), ("3", None, False), (None, None, False),
    (2**70, 0, True),
])
def test_is_int(value: object, minimum: int | None, expected: bool) -> None:
    assert is_int(value, minimum) is expected


@pytest.mark.parametrize("value,expected", [
    (3, 3), (np.int64(3), 3), (np.uint8(7), 7), (torch.tensor(5), 5), (-1, -1),
    (True, None), (np.bool_(True), None), (torch.tensor(True), None), (3.0, None), (np.float64(3), None), ("3", None), (None, None),
])
def test_as_count(value: object, expected: int | None) -> None:
    got = as_count(value)
    assert got == expected and (got is None or type(got) is int)


def test_settings_reject_bools_and_numpy_ints_alike() -> None:
    # One rule everywhere: the same value is refused by every setting that takes an int.
    from balancer import BalancerConfig, TokenBatch

    for bad in (True, np.int64(4), 4.0):
        with pytest.raises(ValueError, match=r"capacity="):
            BalancerConfig(capacity=bad)
        with pytest.raises(ValueError, match=r"batch_size="):
            TokenBatch(batch_size=bad, seq_lens=torch.ones(4, dtype=torch.int64),
                       tokens={"ids": torch.zeros(4, dtype=torch.int64)})
