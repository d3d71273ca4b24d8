"""`BatchShuffler`: move samples between data-parallel ranks to equalise work.

Per step, on every rank of the group (each step is a collective):

1. ``start_shuffle_async(batch)`` (phase 1, calling thread): per-sample
   workloads from ``workload_fn``; one all-gather of every rank's header (real
   sample count, schema fingerprint, error status), workloads and per-sample
   bytes; a host copy; then the partition (+ locality refinement) is submitted
   to a single background thread. Returns a :class:`ShuffleHandle`.
2. ``finish_shuffle(batch, handle)`` (phase 2, calling thread): waits for the
   partition, then redistributes with two collectives (``"all2all"``: lengths,
   then payload of the samples that change rank; ``"allgather"``: every rank's
   lengths, then every rank's payload). Each rank gets exactly ``batch_size``
   samples: its real samples in ascending global order, then local padding.

``shuffle(batch)`` is ``finish_shuffle(batch, start_shuffle_async(batch))``.

Bad input on one rank (wrong batch size or schema, bad workloads) never hangs
the group: that rank still joins the phase-1 all-gather, with an error status
in its header, and every rank raises a ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from time import perf_counter
from typing import Any, TypeVar

import numpy as np
import torch.distributed as dist
from torch.profiler import record_function

from balancer import _comm, _stats
from balancer._comm import Traffic
from balancer._partition_worker import PartitionHandle
from balancer._plan import (
    Outcome,
    PartitionFn,
    fit_total,
    partition_task,
    plan_outcome,
    simple_lower_bound,
    validate_partition,
    wire_layout,
)
from balancer._stats import H_BATCH, H_FP, H_REAL, HEADER_LEN, Agreement, ShuffleStats
from balancer.batch import BaseBatch
from balancer.config import COMMS, EXECUTORS, check_bool, check_choice, check_interval
from balancer.partition import PartitionWorker, balanced_partition, localize, lower_bound

logger = logging.getLogger(__name__)

__all__ = ["BatchShuffler", "IdentityBatchShuffler", "ShuffleHandle", "ShuffleStats"]

_B = TypeVar("_B", bound=BaseBatch)


@dataclasses.dataclass
class _HandleState:
    finished: bool = False
    stats: ShuffleStats | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class ShuffleHandle:
    """A started shuffle; pass it to ``finish_shuffle`` exactly once, in start order.

    Attributes:
        seq: sequence number on its shuffler (0, 1, ...).
        world_size: W at start.
        rank: this rank at start.
        phase1_s: wall seconds of phase 1.
    """

    seq: int
    world_size: int
    rank: int
    phase1_s: float
    _owner: object = dataclasses.field(repr=False)
    _workloads: np.ndarray = dataclasses.field(repr=False)  # [W * B], padding 0
    _real: np.ndarray = dataclasses.field(repr=False)  # [W]
    _fingerprint: int = dataclasses.field(repr=False)
    _future: Future[Outcome] | None = dataclasses.field(repr=False)
    _state: _HandleState = dataclasses.field(default_factory=_HandleState, repr=False)

    @property
    def stats(self) -> ShuffleStats:
        """Statistics of the finished shuffle.

        Raises:
            RuntimeError: before ``finish_shuffle`` returned for this handle.
        """
        if self._state.stats is None:
            raise RuntimeError(f"shuffle handle #{self.seq} has no stats: finish_shuffle it first")
        return self._state.stats

    def partition_done(self) -> bool:
        """Whether the background partition has finished (never blocks)."""
        return self._future is None or self._future.done()


class _ShufflerBase:
    """Handle bookkeeping shared by both shufflers: sequence numbers, start-order
    finishing, one finish per handle, local (no-communication) handles."""

    _comm_name = "identity"

    def __init__(self, workload_fn: Callable[[Any], Any] | None, log_interval: int = 0) -> None:
        self._workload_fn = workload_fn
        self._log_interval = log_interval
        self._token = object()
        self._next_seq = 0
        # Unfinished handles by sequence number; a dropped handle drops out.
        self._pending: weakref.WeakValueDictionary[int, ShuffleHandle] = weakref.WeakValueDictionary()
        self._closed = False

    def shuffle(self, batch: _B, pg: dist.ProcessGroup | None = None) -> _B:
        """Shuffle synchronously: ``finish_shuffle(batch, start_shuffle_async(batch))``."""
        return self.finish_shuffle(batch, self.start_shuffle_async(batch, pg), pg)

    def start_shuffle_async(self, batch: Any, pg: dist.ProcessGroup | None = None) -> ShuffleHandle:
        raise NotImplementedError

    def finish_shuffle(self, batch: Any, handle: ShuffleHandle, pg: dist.ProcessGroup | None = None) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources; later ``start_shuffle_async`` calls raise. Idempotent."""
        self._closed = True

    def __enter__(self) -> _ShufflerBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def _register(self, handle: ShuffleHandle) -> ShuffleHandle:
        self._pending[handle.seq] = handle
        self._next_seq += 1
        return handle

    def _claim(self, handle: ShuffleHandle, mark: bool = True) -> None:
        """Check that ``handle`` may finish now and (with ``mark``) mark it finished.

        Every check depends only on calls every rank makes alike (never on
        whether the partition thread got to a handle), so all ranks agree.
        """
        self._check_open()
        if not isinstance(handle, ShuffleHandle) or handle._owner is not self._token:
            raise RuntimeError(f"{handle!r} was not started by this {type(self).__name__}")
        if handle._state.finished:
            raise RuntimeError(f"shuffle handle #{handle.seq} was already finished")
        earlier = sorted(s for s in list(self._pending.keys()) if s < handle.seq)
        if earlier:
            raise RuntimeError(
                f"finish_shuffle got handle #{handle.seq} while handle(s) #{earlier} started "
                "earlier are unfinished; finish handles in the order they were started"
            )
        if mark:
            handle._state.finished = True
            self._pending.pop(handle.seq, None)

    def _local_handle(self, batch: Any, t0: float) -> ShuffleHandle:
        """A handle for a shuffle that communicates nothing (W == 1, identity)."""
        _, _, rank = _comm.resolve_group(None)
        if self._workload_fn is None:
            b = int(getattr(batch, "batch_size", 0))
            real = int(getattr(batch, "actual_batch_size", b) or 0)
            workloads, fp = np.zeros(b, np.int64), 0
        else:
            local = _stats.local_input(batch, self._workload_fn, rank, None)
            if local.error:
                raise ValueError(f"{type(self).__name__}: {local.error}") from local.cause
            b, fp, real = (local.header[i] for i in (H_BATCH, H_FP, H_REAL))
            msg = local.message(Agreement(b, fp)).cpu().numpy()
            verdict = _stats.decide(msg[None, :HEADER_LEN], Agreement(b, fp))
            if verdict.kind == "error":
                raise ValueError(f"{type(self).__name__}: {verdict.message}")
            workloads = msg[HEADER_LEN : HEADER_LEN + b].copy()
            workloads[real:] = 0
        return self._register(ShuffleHandle(
            self._next_seq, 1, rank, perf_counter() - t0, self._token, workloads,
            np.array([real], np.int64), fp, None,
        ))

    def _record(self, handle: ShuffleHandle, outcome: Outcome | None, traffic: Traffic,
                phase2_s: float, wait_s: float = 0.0) -> None:
        n = handle._workloads.size
        stats = _stats.build_stats(
            seq=handle.seq, rank=handle.rank, comm=self._comm_name if outcome else "identity",
            workloads=handle._workloads, real=handle._real,
            dest=outcome.dest if outcome else np.zeros(n, np.int64),
            lower_bound=outcome.lower_bound if outcome else simple_lower_bound(handle._workloads, 1),
            partition_s=outcome.seconds if outcome else 0.0,
            phase1_s=handle.phase1_s, phase2_s=phase2_s, wait_s=wait_s, traffic=traffic,
        )
        handle._state.stats = stats
        if self._log_interval and handle.rank == 0 and (handle.seq + 1) % self._log_interval == 0:
            logger.info("%s", _stats.format_stats(stats))


class _ChildPartition:
    """A partition running in the child process, with the ``Future`` methods
    the handle uses. ``result`` collects the parts (the calling thread sleeps
    in a pipe read, without the GIL) and plans this rank's phase 2.

    If the child died (killed, out of memory), this rank computes the same
    deterministic ``balanced_partition`` itself instead: raising here, on one
    rank only, would leave the other ranks waiting in phase 2's collectives.
    """

    def __init__(self, worker: PartitionWorker, workloads: np.ndarray, sizes: np.ndarray,
                 real: np.ndarray, rank: int, locality: bool) -> None:
        w = real.size
        self._home = np.arange(workloads.size, dtype=np.int64) // (workloads.size // w) if locality else None
        # float64 sizes, as the child receives them: an in-process fallback
        # then computes exactly what the other ranks' children compute.
        self._sizes = sizes.astype(np.float64) if locality else None
        self._pending: PartitionHandle | None = None
        try:
            self._pending = worker.submit(workloads, w, self._home, self._sizes)
        except OSError as e:  # BrokenPipeError: the child is gone
            logger.warning("balancer: partition child unavailable (%s); partitioning in-process", e)
        self._args = (workloads, real, rank)
        self._outcome: Outcome | None = None

    def done(self) -> bool:
        return self._outcome is not None or self._pending is None or self._pending.ready()

    def _rows(self) -> tuple[np.ndarray, float, float]:
        """(parts [W, B], child seconds, lower bound), in-process if the child died."""
        if self._pending is not None:
            try:
                rows = self._pending.wait_rows()
                return rows, self._pending.seconds, self._pending.lower_bound
            except (EOFError, OSError) as e:
                logger.warning("balancer: partition child failed (%s); partitioning in-process", e)
        workloads, real, _ = self._args
        t0 = perf_counter()
        parts = balanced_partition(workloads, real.size, self._home, self._sizes)
        return np.asarray(parts, dtype=np.int64), perf_counter() - t0, lower_bound(workloads, real.size)

    def result(self) -> Outcome:
        if self._outcome is None:
            workloads, real, rank = self._args
            w = real.size
            with record_function("## balancer.shuffle.partition ##"):
                rows, child_s, bound = self._rows()
                t_plan = perf_counter()
                parts = validate_partition(rows, w, workloads.size // w)
                outcome = plan_outcome(parts, workloads, real, rank, lambda *_: bound, t_plan)
                # Partition time = the child's compute + the planning here, not
                # however long the caller let pass before collecting.
                self._outcome = dataclasses.replace(outcome, seconds=child_s + outcome.seconds)
        return self._outcome


class BatchShuffler(_ShufflerBase):
    """Balances per-rank workload by moving samples between data-parallel ranks.

    Example::

        shuffler = BatchShuffler(TokenCount(["item"]), comm="all2all")
        handle = shuffler.start_shuffle_async(batch)      # phase 1
        ...                                               # other work overlaps the partition
        batch = shuffler.finish_shuffle(batch, handle)    # phase 2
        print(handle.stats.imbalance_before, handle.stats.imbalance_after)

    Every rank of the group must call the same methods in the same order.
    Several handles may be in flight; finish them in start order.

    Args:
        workload_fn: ``batch -> [batch_size]`` per-sample cost (integer, or
            floating and rounded); only real samples' costs are used.
        comm: ``"all2all"`` sends each sample that changes rank once (least
            traffic); ``"allgather"`` gathers every rank's batch everywhere and
            selects locally.
        partition: ``(workloads [N], num_parts) -> parts``, each part exactly
            ``N / num_parts`` global indices; default
            :func:`balancer.partition.balanced_partition`.
        locality: refine the partition with :func:`balancer.partition.localize`
            so samples stay on their rank where that costs no balance (less
            traffic); ``False``: rank r gets part r as the partitioner returns it.
        log_interval: log :class:`ShuffleStats` on rank 0 every
            ``log_interval`` shuffles; 0: never.
        executor: where the partition runs while the caller works.
            ``"auto"`` (default): ``"process"`` for ``balanced_partition``,
            else ``"thread"``. ``"process"``: ``balanced_partition`` (+ ``localize``) in
            a torch-free child process (:class:`balancer.partition.PartitionWorker`,
            started on first use, ~0.2 s), so it never competes with the
            training loop for the GIL. ``"thread"``: any ``partition`` in a
            background thread; numpy calls in it wait for the GIL behind a
            Python-busy main thread (measured: a 2 ms partition took 50 ms,
            see docs/benchmarks.md).

    Raises:
        ValueError: on an invalid setting, naming the value and the expectation.
    """

    def __init__(self, workload_fn: Callable[[Any], Any], *,
                 comm: str = "all2all",
                 partition: PartitionFn = balanced_partition, locality: bool = True,
                 log_interval: int = 0, executor: str = "auto") -> None:
        if not callable(workload_fn):
            raise ValueError(f"workload_fn={workload_fn!r}, expected a callable batch -> [batch_size]")
        me = type(self).__name__
        check_choice(me, "comm", comm, COMMS)
        if not callable(partition):
            raise ValueError(f"{me}: partition={partition!r}, expected a callable (workloads, num_parts) -> parts")
        check_bool(me, "locality", locality)
        check_interval(me, "log_interval", log_interval)
        check_choice(me, "executor", executor, EXECUTORS)
        if executor == "auto":
            executor = "process" if partition is balanced_partition else "thread"
        if executor == "process" and partition is not balanced_partition:
            raise ValueError(
                f"{me}: executor='process' runs balanced_partition in a child process; "
                f"partition={getattr(partition, '__name__', partition)!r} needs executor='thread'"
            )
        self.comm, self.partition, self.locality, self.executor = comm, partition, locality, executor
        self._worker: PartitionWorker | None = None
        super().__init__(workload_fn, log_interval)
        self._comm_name = comm
        self._agreed: dict[Any, Agreement] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None

    def start_shuffle_async(self, batch: Any, pg: dist.ProcessGroup | None = None) -> ShuffleHandle:
        """Phase 1: gather workloads and start the partition in the background.

        Args:
            batch: this rank's :class:`BaseBatch`.
            pg: process group; ``None`` is the default group (resolved now).

        Raises:
            ValueError: on every rank, when any rank's input is invalid (its
                batch size or schema differs, its workloads are malformed,
                negative or not finite); names the rank(s).
        """
        self._check_open()
        group, w, rank = _comm.resolve_group(pg)
        t0 = perf_counter()
        if w == 1:
            return self._local_handle(batch, t0)
        with record_function("## balancer.shuffle.phase1 ##"):
            gathered, agreed = self._gather(batch, group, rank)
            b = agreed.batch_size
            real = gathered[:, H_REAL].copy()
            workloads = gathered[:, HEADER_LEN : HEADER_LEN + b].copy()
            sizes = gathered[:, HEADER_LEN + b :].copy()
            padding = np.arange(b)[None, :] >= real[:, None]
            workloads[padding] = 0
            sizes[padding] = 0
            workloads, sizes = fit_total(workloads.reshape(-1)), sizes.reshape(-1)
            if self.executor == "process":
                future: Any = _ChildPartition(
                    self._child(), workloads, sizes, real, rank, self.locality)
            else:
                future = self._pool().submit(
                    partition_task, workloads, sizes, real, rank, self.partition,
                    localize if self.locality else None, lower_bound)
        return self._register(ShuffleHandle(
            self._next_seq, w, rank, perf_counter() - t0, self._token, workloads, real,
            agreed.fingerprint, future,
        ))

    def finish_shuffle(self, batch: _B, handle: ShuffleHandle, pg: dist.ProcessGroup | None = None) -> _B:
        """Phase 2: wait for the partition and redistribute.

        Args:
            batch: the batch given to ``start_shuffle_async`` (or a copy of it).
            handle: its handle; each handle finishes once, in start order.
            pg: the process group of the start.

        Returns:
            A batch of the same type and ``batch_size``: the real samples this
            rank was assigned (ascending global index), then padding;
            ``actual_batch_size`` is their count.

        Raises:
            RuntimeError: out-of-order or repeated finish, foreign handle, or a
                closed shuffler (on every rank alike).
            Exception: whatever the partition function raised (on every rank,
                for a deterministic partitioner).
            ValueError: ``batch`` has another schema or real-sample count than
                the started one -- a programming error raised on this rank only,
                before any collective (the other ranks then wait in phase 2).
        """
        self._claim(handle, mark=handle._future is None)
        t0 = perf_counter()
        if handle._future is None:
            self._record(handle, None, Traffic(), perf_counter() - t0)
            return batch
        with record_function("## balancer.shuffle.phase2 ##"):
            group, w, rank = _comm.resolve_group(pg)
            if (w, rank) != (handle.world_size, handle.rank):
                raise ValueError(f"finish_shuffle: group has W={w}, rank {rank}; handle "
                                 f"#{handle.seq} was started with W={handle.world_size}, rank {handle.rank}")
            layout = wire_layout(batch)
            if layout.fingerprint != handle._fingerprint or batch.actual_batch_size != handle._real[rank]:
                raise ValueError(f"finish_shuffle: batch (actual_batch_size={batch.actual_batch_size}) "
                                 f"is not the batch handle #{handle.seq} was started with")
            # Rank-local checks passed: only now is the handle used up, so a
            # caller that passed the wrong batch can retry with the right one.
            self._claim(handle)
            t_wait = perf_counter()
            try:
                outcome = handle._future.result()
            except CancelledError:
                raise RuntimeError(f"shuffle handle #{handle.seq}: the shuffler was closed") from None
            t_wait = perf_counter() - t_wait
            if not outcome.moves:
                # Every rank knows nothing moves (same partition everywhere), so
                # all skip phase 2's collectives alike; the batch already is
                # its output (real samples in order, then padding).
                out, traffic = batch, Traffic()
            elif self.comm == "all2all":
                out, traffic = _comm.redistribute_all2all(batch, layout, outcome.plan, group)
            else:
                out, traffic = _comm.redistribute_allgather(batch, layout, outcome.plan, handle._real, group)
        self._record(handle, outcome, traffic, perf_counter() - t0, t_wait)
        return out

    def close(self) -> None:
        """Shut the partition thread or child process down (pending partitions
        are cancelled)."""
        super().close()
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self._finalizer is not None:
            self._finalizer.detach()
        self._agreed.clear()

    def _child(self) -> PartitionWorker:
        if self._worker is not None and not self._worker.alive():
            logger.warning("balancer: the partition child process exited; starting a new one")
            self._worker.close()
            self._worker = None
        if self._worker is None:
            self._worker = PartitionWorker()  # closes itself when garbage collected
        return self._worker

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            # One worker: partitions run in start order. The finalizer shuts
            # the thread down when the shuffler is garbage collected unclosed.
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="balancer-partition")
            self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=False)
        return self._executor

    def _gather(self, batch: Any, group: Any, rank: int) -> tuple[np.ndarray, Agreement]:
        """The phase-1 all-gather, preceded on first use (or when every rank
        changed batch size or schema together) by a header-only round."""
        local = _stats.local_input(batch, self._workload_fn, rank, group)  # type: ignore[arg-type]
        agreed = self._agreed.get(group)
        for _ in range(2):
            # .cpu() on the calling thread: the partition thread only ever sees
            # host memory that is completely written (a sync on CUDA).
            gathered = _comm.all_gather_fixed(local.message(agreed), group).cpu().numpy()
            verdict = _stats.decide(gathered[:, :HEADER_LEN], agreed)
            if verdict.kind == "ok" and agreed is not None:
                return gathered, agreed
            if verdict.kind == "error":
                text = f"BatchShuffler: {verdict.message}"
                if local.error:
                    text += f"; on this rank: {local.error}"
                raise ValueError(text) from local.cause
            agreed = verdict.agreement
            assert agreed is not None, "a retry verdict carries the new agreement"
            self._agreed[group] = agreed
        raise AssertionError("phase-1 agreement did not settle in two rounds")


class IdentityBatchShuffler(_ShufflerBase):
    """Same API as :class:`BatchShuffler`; communicates nothing and returns the
    batch unchanged. Stats cover this rank only (``world_size == 1``).

    Args:
        workload_fn: optional per-sample cost, for the stats' load.
    """

    def __init__(self, workload_fn: Callable[[Any], Any] | None = None) -> None:
        super().__init__(workload_fn)

    def start_shuffle_async(self, batch: Any, pg: dist.ProcessGroup | None = None) -> ShuffleHandle:
        """No communication; computes the workloads only if ``workload_fn`` is set."""
        self._check_open()
        return self._local_handle(batch, perf_counter())

    def finish_shuffle(self, batch: _B, handle: ShuffleHandle, pg: dist.ProcessGroup | None = None) -> _B:
        """Returns ``batch`` itself."""
        self._claim(handle)
        self._record(handle, None, Traffic(), 0.0)
        return batch
