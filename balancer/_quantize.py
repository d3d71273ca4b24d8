"""Scale-free integer workloads for the partitioner (numpy only).

Balancing depends only on ratios between workloads, so the shuffler hands its
partitioner integers proportional to them: the largest workload becomes
``2**QUANT_BITS`` and every other one ``round(x / max * 2**QUANT_BITS)``.

* **Any scale works.** Costs in seconds (``1e-3 * tokens``) or in FLOPs
  (``1e12``) give the same integers; nothing small rounds to 0 unless it is
  below ``2**-27`` of the largest sample, and nothing large overflows: the
  total stays below ``N * 2**26``, far from the partitioner's limit
  (:data:`balancer._limits.MAX_TOTAL`).
* **Invariance.** ``x / max`` is one correctly rounded division, so
  multiplying every workload by a positive constant ``c`` changes each ratio
  by at most ~3 ulp (2e-8 after the ``2**26`` scaling). When the workloads are
  integers times a common factor -- token counts, ``L**2`` costs, anything
  from an estimator, scaled by any ``c`` -- and the largest integer's odd part
  is below ``2**24``, no ratio lies within that distance of a rounding
  boundary, so the integers, hence the partition, are identical for every
  ``c``. For arbitrary real workloads an item lands that close to a boundary
  with probability ~4e-8, and then only that item's last unit differs.
* **Resolution.** One unit is ``2**-26`` of the largest sample, so a part's
  load is represented to within ``B / 2`` units: for ``max / mean <= 1000``
  that is below 1e-5 of the load.
"""

from __future__ import annotations

import numpy as np

__all__ = ["QUANT_BITS", "quantize"]

QUANT_BITS = 26


def quantize(workloads: np.ndarray) -> np.ndarray:
    """int64 workloads proportional to ``workloads`` (>= 0), the largest ``2**QUANT_BITS``.

    Example: ``[3.0, 0.0, 1.5e-9]`` gives ``[2**26, 0, 0]`` (1.5e-9 is 5e-10 of
    the largest), and ``[2, 1]`` gives ``[2**26, 2**25]``. All zeros stay zeros.
    """
    x = np.asarray(workloads, dtype=np.float64)
    top = float(x.max(initial=0.0))
    if not top > 0:
        return np.zeros(x.shape, np.int64)
    return np.rint(x / top * float(2**QUANT_BITS)).astype(np.int64)
