"""Integer arguments: what the library accepts as an int, in one place.

Two rules, each used where its docs say so:

* :func:`is_int`: a Python ``int`` and not a ``bool`` (``True`` is an ``int``
  to Python, never a count or a size to us), optionally at least ``minimum``.
  Settings and sizes a user types (``batch_size``, ``capacity``, ``epoch``,
  a config field) take this one.
* :func:`as_count`: any integer, numpy's too (``operator.index``), as a Python
  ``int``; not a bool. Counts that often come out of arrays
  (``actual_batch_size``, ``pad_batch``'s ``batch_size``) take this one.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

__all__ = ["as_count", "is_int"]


def is_int(value: Any, minimum: int | None = None) -> bool:
    """Whether ``value`` is a Python int, not a bool, and ``>= minimum`` when given."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def as_count(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer (numpy ones too; not a bool), else ``None``."""
    # numpy 1.x's bool_ and a bool tensor have __index__ (True -> 1): refused by type.
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
