"""Reference helpers shared by tests (pure Python, independent of balancer)."""

from __future__ import annotations

import numpy as np


def greedy(workloads: np.ndarray, num_parts: int) -> list[list[int]]:
    """Stand-in partitioner: largest first onto the lightest part with room."""
    b = workloads.size // num_parts
    loads, parts = [0] * num_parts, [[] for _ in range(num_parts)]  # type: ignore[var-annotated]
    for i in sorted(range(workloads.size), key=lambda i: (-int(workloads[i]), i)):
        r = min((r for r in range(num_parts) if len(parts[r]) < b), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += int(workloads[i])
    return parts


def scale_free(workloads: np.ndarray) -> np.ndarray:
    """What a shuffler hands its partition function: integers proportional to
    the workloads, the largest 2**26 (written independently of balancer._quantize)."""
    x = np.asarray(workloads, dtype=np.float64)
    top = x.max() if x.size else 0.0
    if top <= 0:
        return np.zeros(x.size, np.int64)
    return np.array([round(v / top * 2**26) for v in x], dtype=np.int64)
