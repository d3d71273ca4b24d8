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
