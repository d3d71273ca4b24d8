"""balancer: remove data-parallel stragglers on variable-length data.

Data path per training step (see docs/design.md):

1. batch (:class:`BaseBatch`) -> 2. per-sample workloads (``balancer.workloads``)
-> 3. all-gather of workloads -> 4. partition in a background future
(``balancer.partition``) -> 5. redistribution of samples between ranks
(``balancer.shuffler``) -> 6. overlapped inside the train pipeline
(``balancer.pipeline``).
"""

from balancer.batch import BaseBatch, pad_batch
from balancer.workloads import (
    Calibration,
    HSTUAttentionCost,
    PolynomialCost,
    SelfAttentionCost,
    TokenCount,
    WorkloadFn,
    calibrate,
    fit_polynomial,
)

__all__ = [
    "BaseBatch",
    "Calibration",
    "HSTUAttentionCost",
    "PolynomialCost",
    "SelfAttentionCost",
    "TokenCount",
    "WorkloadFn",
    "calibrate",
    "fit_polynomial",
    "pad_batch",
]
