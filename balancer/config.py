"""`BalancerConfig`: the one switchboard for the balanced train pipeline.

The library never reads environment variables; a training script maps its own
flags onto this dataclass (see ``examples/train_hstu.py``) and hands it to
:func:`balancer.pipeline.create_train_pipeline`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from balancer._ints import is_int
from balancer._limits import MAX_TIMEOUT_S

__all__ = ["BalancerConfig"]

COMMS = ("all2all", "allgather")
EXECUTORS = ("auto", "process", "thread")
_PARTITIONS = ("balanced", "karmarkar_karp")
_PIPELINES = ("sparse_dist", "prefetch")


# The checks below are shared with `BatchShuffler`, whose keyword arguments are
# the same settings; `owner` names who was given the value.
def check_choice(owner: str, field: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{owner}: {field}={value!r}, expected one of {list(choices)}")


def check_bool(owner: str, field: str, value: object) -> None:
    """Raise ValueError unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {field}={value!r}, expected a bool")


def check_interval(owner: str, field: str, value: object) -> None:
    """Raise ValueError unless ``value`` is an int >= 0 (not a bool)."""
    if not is_int(value, 0):
        raise ValueError(f"{owner}: {field}={value!r}, expected an int >= 0")


def check_timeout(owner: str, field: str, value: object) -> None:
    """Raise ValueError unless ``value`` is a number of seconds in ``(0, MAX_TIMEOUT_S]`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{owner}: {field}={value!r}, expected a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}")


def check_executor(owner: str, executor: str, *, default_partition: bool, partition: object) -> None:
    """Raise ValueError if ``executor="process"`` comes with another partition than
    ``balanced_partition`` (the child process runs only that one); ``partition`` names it."""
    if executor == "process" and not default_partition:
        raise ValueError(f"{owner}: executor='process' runs balanced_partition in a child process; "
                         f"partition={partition!r} needs executor='thread' or 'auto'")


def check_token_cap(owner: str, value: object, *, default_partition: bool, needs: str, partition: object,
                    capacity: object) -> None:
    """Raise ValueError unless ``value`` is None, or a finite number >= 1 (a multiple of the
    mean) with the default partition and ``capacity=None``; ``needs`` names that
    partition in the message, ``partition`` the one configured."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1.0 <= value < float("inf"):
        raise ValueError(f"{owner}: token_cap={value!r}, expected None or a finite number >= 1.0 "
                         "(the cap on tokens per rank as a multiple of the mean)")
    if not default_partition or capacity is not None:
        raise ValueError(f"{owner}: token_cap={value} needs {needs} and capacity=None, "
                         f"got partition={partition!r}, capacity={capacity!r}")


def check_group_size(owner: str, value: object, *, comm: str, default_partition: bool, partition: object,
                     capacity: object, calibrate: bool, token_cap: object, calibrate_name: str = "calibrate") -> None:
    """Raise ValueError unless ``value`` is None, or an int >= 2 with ``comm="all2all"``, the
    default partition, and no ``capacity``, calibration or ``token_cap`` (those balance over
    every rank's samples; a group sees only its own)."""
    if value is None:
        return
    if not is_int(value, 2):
        raise ValueError(f"{owner}: group_size={value!r}, expected None or an int >= 2 (ranks per group)")
    clash = [f"{name}={v!r}" for name, v, bad in (
        ("comm", comm, comm != "all2all"), ("partition", partition, not default_partition),
        ("capacity", capacity, capacity is not None), (calibrate_name, calibrate, bool(calibrate)),
        ("token_cap", token_cap, token_cap is not None)) if bad]
    if clash:
        raise ValueError(f"{owner}: group_size={value} balances within groups with comm='all2all' and the default "
                         f"partition, without capacity, calibration or token_cap; got {', '.join(clash)}")


def identity(obj: Any) -> str:
    """What ranks compare to check they configured the same callable.

    Frozen dataclasses (the estimators) by value; other callables by name --
    never by ``repr``, which may hold a per-process address. A wrapper that
    sets ``__wrapped__`` (``functools.wraps``) is identified by what it wraps.
    """
    obj = inspect.unwrap(obj) if hasattr(obj, "__wrapped__") else obj  # wrappers name what they wrap
    if isinstance(obj, functools.partial):
        return f"partial({identity(obj.func)})"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        text = repr(obj)
        if " at 0x" not in text:
            return text
    target = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"


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
    """Partitioning algorithm: ``"balanced"`` (``balancer.partition.balanced_partition``:
    the library's best, within ~1e-4 of the lower bound on the benchmark suite)
    or ``"karmarkar_karp"`` (plain equal-size largest differencing, the
    predecessor's method; faster but several percent above the bound on many
    ranks)."""

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

    executor: str = "auto"
    """Where the partition runs while the training step goes on: ``"process"``
    (a torch-free child process per rank; never contends for the GIL; serves
    ``partition="balanced"`` only), ``"thread"`` (a background thread; slowed
    by a Python-busy main thread), or ``"auto"``: ``"process"`` for
    ``"balanced"``, else ``"thread"``. See ``BatchShuffler``."""

    shuffle_timeout_s: float = 300.0
    """Seconds a shuffle waits for its peers before every waiting rank raises
    ``balancer.ShuffleAbortedError`` naming the phase and the missing ranks
    (well under the process group's own timeout: 30 min for gloo, 10 min for
    NCCL). Keep it above the longest time one rank may spend elsewhere between
    two steps (a checkpoint, an evaluation). Phase 2 of batches on CUDA runs on
    the NCCL group itself, whose own timeout applies there."""

    capacity: int | None = None
    """``None``: every rank keeps exactly ``batch_size`` samples. An int
    ``>= batch_size``: ranks receive different numbers of samples, at most
    ``capacity`` each, so a few huge samples stop pinning one rank; every batch
    then has ``batch_size == capacity`` (real samples first, then padding).
    Needs ``partition="balanced"`` and a globally normalised loss."""

    online_calibration: bool = False
    """Fit the cost model to the compute times every rank measures (CUDA events
    on a GPU, a monotonic clock on the CPU) and partition with it once enough
    measurements exist; the pipeline measures forward and backward itself
    (spans that include waits at the model's own collectives, e.g. DDP's
    gradient all-reduce: see ``docs/api.md``). See
    ``BatchShuffler(calibrate=True)``."""

    calibration_keys: tuple[str, ...] | None = None
    """The KJT keys whose lengths make up a sample's length in the fitted
    model (the sequence the model attends over); ``None``: every key."""

    token_cap: float | None = None
    """Balance compute and memory at once: no rank receives more than
    ``token_cap`` times the mean tokens (jagged elements) per rank, compute
    balanced under that cap; ``None``: compute only. Needs
    ``partition="balanced"`` and ``capacity=None``. See
    ``BatchShuffler(token_cap=...)``."""

    group_size: int | None = None
    """For large jobs: balance within groups of at most ``group_size`` ranks,
    re-formed every step so each mixes heavy and light ranks; phase 1 then
    gathers per-sample metadata from the group only and partitions
    ``group_size * batch_size`` samples, for some balance. ``None``: all
    ranks. Needs ``comm="all2all"``, ``partition="balanced"``, and no
    ``capacity``, ``online_calibration`` or ``token_cap``. See
    ``BatchShuffler(group_size=...)``."""

    def __post_init__(self) -> None:
        me = "BalancerConfig"
        check_bool(me, "enable_balanced_shuffler", self.enable_balanced_shuffler)
        check_choice(me, "comm", self.comm, COMMS)
        check_choice(me, "partition", self.partition, _PARTITIONS)
        check_bool(me, "locality", self.locality)
        check_interval(me, "log_interval", self.log_interval)
        check_choice(me, "executor", self.executor, EXECUTORS)
        check_choice(me, "pipeline", self.pipeline, _PIPELINES)
        check_timeout(me, "shuffle_timeout_s", self.shuffle_timeout_s)
        check_bool(me, "online_calibration", self.online_calibration)
        keys = self.calibration_keys
        if keys is not None and (not isinstance(keys, tuple) or not keys or not all(isinstance(k, str) for k in keys)):
            raise ValueError(f"{me}: calibration_keys={keys!r}, expected None or a non-empty tuple of str")
        if keys is not None and not self.online_calibration:
            raise ValueError(f"{me}: calibration_keys={keys!r} name the features online calibration measures "
                             "L from; they need online_calibration=True")
        if self.capacity is not None and not is_int(self.capacity, 1):
            raise ValueError(f"{me}: capacity={self.capacity!r}, expected None or an int >= batch_size")
        check_token_cap(me, self.token_cap, default_partition=self.partition == "balanced",
                        needs="partition='balanced'", partition=self.partition, capacity=self.capacity)
        if self.capacity is not None and self.partition != "balanced":
            raise ValueError(f"{me}: capacity={self.capacity} needs partition='balanced', got {self.partition!r}")
        check_executor(me, self.executor, default_partition=self.partition == "balanced", partition=self.partition)
        check_group_size(me, self.group_size, comm=self.comm, default_partition=self.partition == "balanced",
                         partition=self.partition, capacity=self.capacity, calibrate=self.online_calibration,
                         token_cap=self.token_cap, calibrate_name="online_calibration")
