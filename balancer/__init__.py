"""balancer: remove data-parallel stragglers on variable-length data.

Data path per training step (see docs/design.md):

1. batch (:class:`BaseBatch`) -> 2. per-sample workloads (``balancer.workloads``)
-> 3. all-gather of workloads -> 4. partition in a background future
(``balancer.partition``) -> 5. redistribution of samples between ranks
(``balancer.shuffler``) -> 6. overlapped inside the train pipeline
(``balancer.pipeline``).

Outside TorchRec's pipeline (a plain DDP/FSDP loop, a Trainer),
:class:`BalancedLoader` does steps 2-5 in the data loader, on the host, in a
background thread (docs/loader.md).

LLM and RL training (docs/llm.md): :class:`TransformerCost` per-sample FLOPs,
:func:`plan_dispatch` / :class:`BufferedDispatcher` for a single controller
that splits a global batch across ranks, :func:`plan_micro_batches` to cut a
rank's share into micro-batches under a token budget.
"""

import importlib.util
from typing import TYPE_CHECKING, Any

from balancer._padding import padding_like
from balancer._version import __version__
from balancer.buffered_dispatch import BufferedDispatcher, DispatchRound
from balancer.config import BalancerConfig
from balancer.dispatch import DispatchPlan, plan_dispatch
from balancer.errors import ShuffleAbortedError
from balancer.loader import BalancedLoader
from balancer.loss import global_loss_value, global_mean_loss, global_weighted_mean_loss
from balancer.microbatch import MicroBatchPlan, plan_micro_batches
from balancer.partition import balanced_partition, free_partition, karmarkar_karp, lower_bound
from balancer.shuffler import BatchShuffler, IdentityBatchShuffler, ShuffleHandle, ShuffleStats
from balancer.tokens import TokenBatch
from balancer.workloads import (
    Calibration,
    HSTUAttentionCost,
    PolynomialCost,
    SelfAttentionCost,
    TokenCount,
    TransformerCost,
    WorkloadFn,
    calibrate,
    fit_polynomial,
)

if TYPE_CHECKING:
    from balancer.batch import BaseBatch, pad_batch
    from balancer.pipeline import (
        BalancedPrefetchTrainPipelineSparseDist,
        BalancedTrainPipelineSparseDist,
        create_train_pipeline,
    )

# The names that need TorchRec, imported on first use (PEP 562): ``import balancer``
# and the token path do not load TorchRec (~4 s) and run where it is not installed.
# The two modules are among them: ``balancer.batch`` and ``balancer.pipeline`` were
# reachable as attributes after ``import balancer`` when it imported them.
_TORCHREC_NAMES = {
    "BaseBatch": "balancer.batch",
    "pad_batch": "balancer.batch",
    "BalancedPrefetchTrainPipelineSparseDist": "balancer.pipeline",
    "BalancedTrainPipelineSparseDist": "balancer.pipeline",
    "create_train_pipeline": "balancer.pipeline",
    "batch": "balancer.batch",
    "pipeline": "balancer.pipeline",
}


def __getattr__(name: str) -> Any:
    module = _TORCHREC_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'balancer' has no attribute {name!r}")
    from balancer._torchrec import require

    loaded = require(module, f"balancer.{name}")
    value = loaded if module.endswith(f".{name}") else getattr(loaded, name)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BalancedLoader",
    "BalancerConfig",
    "BatchShuffler",
    "BufferedDispatcher",
    "Calibration",
    "DispatchPlan",
    "DispatchRound",
    "HSTUAttentionCost",
    "IdentityBatchShuffler",
    "MicroBatchPlan",
    "PolynomialCost",
    "SelfAttentionCost",
    "ShuffleAbortedError",
    "ShuffleHandle",
    "ShuffleStats",
    "TokenBatch",
    "TokenCount",
    "TransformerCost",
    "WorkloadFn",
    "balanced_partition",
    "calibrate",
    "fit_polynomial",
    "free_partition",
    "global_loss_value",
    "global_mean_loss",
    "global_weighted_mean_loss",
    "karmarkar_karp",
    "lower_bound",
    "padding_like",
    "plan_dispatch",
    "plan_micro_batches",
    "__version__",
]
if importlib.util.find_spec("torchrec") is not None:  # finds, imports nothing
    # ``from balancer import *`` takes them only where TorchRec is installed.
    __all__ += [
        "BaseBatch",
        "pad_batch",
        "BalancedPrefetchTrainPipelineSparseDist",
        "BalancedTrainPipelineSparseDist",
        "create_train_pipeline",
    ]
