"""`BalancerConfig`: the one switchboard for the balanced train pipeline.

The library never reads environment variables; a training script maps its own
flags onto this dataclass (see ``examples/train_hstu.py``) and hands it to
:func:`balancer.pipeline.create_train_pipeline`.
"""

from __future__ import annotations

import dataclasses

__all__ = ["BalancerConfig"]

_COMMS = ("all2all", "allgather")
_PARTITIONS = ("balanced", "karmarkar_karp")
_PIPELINES = ("sparse_dist", "prefetch")


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"BalancerConfig: {field}={value!r}, expected one of {list(choices)}")


def _check_bool(field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"BalancerConfig: {field}={value!r}, expected a bool")


@dataclasses.dataclass(frozen=True)
class BalancerConfig:
    """How (and whether) batches are rebalanced between data-parallel ranks.

    The defaults are the plain TorchRec pipeline: ``enable_balanced_shuffler``
    is off, so batches stay where the data loader put them.

    Example::

        config = BalancerConfig(enable_balanced_shuffler=True, comm="allgather")
        pipeline = create_train_pipeline(model, optimizer, device, config)

    Raises:
        ValueError: from ``__post_init__`` when a field has an invalid value;
            the message names the field and the value.
    """

    enable_balanced_shuffler: bool = False
    """Move samples between ranks every step so every rank gets about the same
    workload. Off: an ``IdentityBatchShuffler`` keeps every batch in place and
    the pipeline behaves exactly like TorchRec's."""

    comm: str = "all2all"
    """How samples are redistributed: ``"all2all"`` sends each sample once to
    its new rank (less traffic); ``"allgather"`` gathers every rank's batch on
    every rank and selects locally (fewer, larger collectives; fine for small
    worlds)."""

    partition: str = "balanced"
    """Partitioning algorithm: ``"balanced"`` (greedy largest-first with equal
    sample counts, fast) or ``"karmarkar_karp"`` (largest differencing method,
    tighter balance, slower for large ``world_size * batch_size``)."""

    locality: bool = True
    """Prefer keeping a sample on its current rank when that does not worsen
    the balance, to cut communication."""

    log_interval: int = 0
    """Log balance statistics (max/mean rank workload before and after) every
    ``log_interval`` shuffles through ``logging``; 0 disables the log lines.
    Statistics are always available on the shuffle handle."""

    pipeline: str = "sparse_dist"
    """TorchRec pipeline variant to extend: ``"sparse_dist"``
    (``TrainPipelineSparseDist``) or ``"prefetch"``
    (``PrefetchTrainPipelineSparseDist``, for cached embedding kernels)."""

    def __post_init__(self) -> None:
        _check_bool("enable_balanced_shuffler", self.enable_balanced_shuffler)
        _check_choice("comm", self.comm, _COMMS)
        _check_choice("partition", self.partition, _PARTITIONS)
        _check_bool("locality", self.locality)
        if (
            isinstance(self.log_interval, bool)
            or not isinstance(self.log_interval, int)
            or self.log_interval < 0
        ):
            raise ValueError(
                f"BalancerConfig: log_interval={self.log_interval!r}, expected an int >= 0"
            )
        _check_choice("pipeline", self.pipeline, _PIPELINES)
