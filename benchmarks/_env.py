"""What the benchmarks record about the software they ran on."""

from __future__ import annotations

import importlib
import platform

import numpy as np
import torch

__all__ = ["library_versions"]


def library_versions() -> dict[str, str]:
    """Python, torch, numpy, torchrec and fbgemm_gpu versions (``"n/a"`` when absent)."""
    versions = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}
    for name in ("torchrec", "fbgemm_gpu"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except (ImportError, AttributeError):
            versions[name] = "n/a"
    return versions
