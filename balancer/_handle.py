"""Shuffle handles and their bookkeeping, shared by both shufflers.

:class:`ShuffleHandle` is what ``start_shuffle_async`` returns (public as
``balancer.ShuffleHandle``); :class:`ShufflerBase` numbers the handles, checks
that each finishes exactly once and in start order (checks that depend only on
the calls every rank makes, so all ranks agree), and owns the one background
thread on which every shuffle's background work runs in start order.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch.distributed as dist

from balancer._devices import caller_cuda_device, on_cuda_device
from balancer._exchange import Exchange, Traffic
from balancer._gather import HostTensors
from balancer._layout import WireLayout
from balancer._protocol import NO_PREV, LocalMeta, message, reraise, stay_length
from balancer._stats import ShuffleStats, build_stats, format_stats
from balancer.errors import ShuffleAbortedError
from balancer.tokens import TokenBatch

if TYPE_CHECKING:  # the token path runs without TorchRec (balancer._torchrec)
    from balancer.batch import BaseBatch

logger = logging.getLogger("balancer.shuffler")  # the shufflers' log, as before the split

__all__ = ["BatchT", "HandleState", "Outcome", "ShuffleHandle", "ShufflerBase"]

BatchT = TypeVar("BatchT", "BaseBatch", TokenBatch)


@dataclasses.dataclass
class HandleState:
    finished: bool = False
    stats: ShuffleStats | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The background work's result: this rank's phase 2, ready to run."""

    exchange: Exchange | None  # None: nothing moves (anywhere, or in this rank's group)
    blob: HostTensors | None  # the exchange's index arrays (pinned when CUDA is present)
    layout: WireLayout | None
    stats: ShuffleStats
    dest: np.ndarray
    # group_size: phase 2 is one collective of all W ranks, so a rank whose
    # group moves nothing still takes part in it, sending nothing.
    join: bool = False
    # A padded TokenBatch that stays put (no exchange): its padded length, the
    # longest real sample rounded up to pad_multiple (read here, in the background).
    length: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class ShuffleHandle:
    """A started shuffle; pass it to ``finish_shuffle`` exactly once, in start order.

    Attributes:
        seq: sequence number on its shuffler (0, 1, ...).
        world_size: W at start.
        rank: this rank at start.
        phase1_s: wall seconds of ``start_shuffle_async``.
    """

    seq: int
    world_size: int
    rank: int
    phase1_s: float
    _owner: object = dataclasses.field(repr=False)
    _job: Future[Outcome] | None = dataclasses.field(repr=False)
    _meta: LocalMeta | None = dataclasses.field(repr=False)
    _state: HandleState = dataclasses.field(default_factory=HandleState, repr=False)

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
        """Whether the background work (exchange, partition, plan) finished; never blocks."""
        return self._job is None or self._job.done()


# finish_shuffle looks this often whether another thread closed the shuffler while it waits.
_CLOSED_POLL_S = 0.1

# close(): how long to wait for a running background job (a healthy one takes
# milliseconds; one blocked in a collective with a stalled peer would hold close()
# for the shuffler's whole timeout, and is left to end with it).
_CLOSE_GRACE_S = 2.0


# At interpreter exit a running background job gets this long (its collective's
# peers run the same job; a process that exits inside a gloo collective is aborted
# by C++). Not the whole timeout: a job waiting for a stalled peer must not hold
# up the exit after an error.
_EXIT_GRACE_S = 3.0
_THREADS: weakref.WeakSet[BackgroundThread] = weakref.WeakSet()


def _finish_jobs_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_GRACE_S
    for thread in list(_THREADS):
        thread.shutdown(max(0.0, deadline - time.monotonic()))


atexit.register(_finish_jobs_at_exit)


class BackgroundThread:
    """One daemon thread that runs submitted jobs in order (``submit`` returns a
    :class:`~concurrent.futures.Future`), like a one-worker ``ThreadPoolExecutor``
    whose thread is not joined at interpreter exit.

    A ``ThreadPoolExecutor``'s thread is: a process whose job waited in a
    collective for a stalled peer did not exit, after an uncaught exception or
    Ctrl-C, until the shuffler's timeout (300 s by default) ran out -- past a
    preemption's grace period, and torchrun could not tear the job down.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], int | None] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._shut = False
        self._thread.start()
        _THREADS.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._shut:  # (a job queued now would never run)
            raise RuntimeError("the background thread was shut down")
        future: Future[Any] = Future()
        self._jobs.put((future, fn, args, caller_cuda_device()))  # the submitting thread's device
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, device = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                with on_cuda_device(device):
                    result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller, as an executor does
                future.set_exception(e)
            else:
                future.set_result(result)
            del job, future, fn, args, device  # drop the batch's references while idle

    def shutdown(self, grace: float) -> None:
        """Cancel the queued jobs, let the thread end after the running one, and wait
        for that up to ``grace`` seconds (a job blocked in a collective ends with its
        timeout; the daemon thread never holds up the process's exit)."""
        self._shut = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._jobs.put(None)
        if grace > 0 and self._thread is not threading.current_thread():
            self._thread.join(grace)


class ShufflerBase:
    """Handle bookkeeping shared by both shufflers: sequence numbers, start-order
    finishing, one finish per handle, the background thread."""

    def __init__(self, workload_fn: Callable[[Any], Any] | None, log_interval: int = 0) -> None:
        self._workload_fn = workload_fn
        self._log_interval = log_interval
        self._token = object()
        self._next_seq = 0
        # Unfinished handles by sequence number; a dropped handle drops out.
        self._pending: weakref.WeakValueDictionary[int, ShuffleHandle] = weakref.WeakValueDictionary()
        self._closed = False
        self._broken: BaseException | None = None
        self._executor: BackgroundThread | None = None
        self._finalizer: weakref.finalize | None = None

    def shuffle(self, batch: BatchT, pg: dist.ProcessGroup | None = None) -> BatchT:
        """Shuffle synchronously: ``finish_shuffle(batch, start_shuffle_async(batch))``."""
        return self.finish_shuffle(batch, self.start_shuffle_async(batch, pg), pg)

    def start_shuffle_async(self, batch: Any, pg: dist.ProcessGroup | None = None, *,
                            exhausted: bool = False) -> ShuffleHandle:
        raise NotImplementedError

    def finish_shuffle(self, batch: Any, handle: ShuffleHandle, pg: dist.ProcessGroup | None = None) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Stop the background thread (queued work is cancelled; a running job gets a
        short grace, and one blocked in a collective for a stalled peer is left to
        end with its timeout; a ``finish_shuffle`` waiting for it on another thread
        raises ``RuntimeError`` at once); later calls raise ``RuntimeError``. Idempotent."""
        self._closed = True  # (a finish_shuffle waiting on another thread sees it: _outcome)
        if self._executor is not None:
            self._executor.shutdown(_CLOSE_GRACE_S)
            self._executor = None
        if self._finalizer is not None:
            self._finalizer.detach()

    def __enter__(self) -> ShufflerBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"{type(self).__name__} is closed after an aborted shuffle: {self._broken}")
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def _pool(self) -> BackgroundThread:
        if self._executor is None:
            # One thread: background jobs run, and issue their collectives, in
            # start order on every rank. The finalizer stops the thread when
            # the shuffler is garbage collected unclosed.
            self._executor = BackgroundThread("balancer-shuffle")
            self._finalizer = weakref.finalize(self, self._executor.shutdown, 0.0)
        return self._executor

    def _register(self, handle: ShuffleHandle) -> ShuffleHandle:
        self._pending[handle.seq] = handle
        self._next_seq += 1
        return handle

    def _claim(self, handle: ShuffleHandle, mark: bool = True) -> None:
        """Check that ``handle`` may finish now and (with ``mark``) mark it finished.

        Every check depends only on calls every rank makes alike (never on
        whether the background thread got to a handle), so all ranks agree:
        a handle whose own background work aborted the shuffler finishes with
        that error (below, in the wait) whether or not the abort came first.
        """
        if not self._aborted_by(handle):
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

    def _aborted_by(self, handle: Any) -> bool:
        """Whether the shuffler broke in ``handle``'s own background work (and is not
        closed): finishing it raises that ``ShuffleAbortedError``, as when the caller was
        already waiting for it (it raised "closed after an aborted shuffle" when the
        abort came first, a race the late rank of a timed-out shuffle often lost)."""
        job = getattr(handle, "_job", None)
        return (self._broken is not None and not self._closed and isinstance(handle, ShuffleHandle)
                and handle._owner is self._token and job is not None and job.done() and not job.cancelled()
                and job.exception(0) is self._broken)

    def _unclaim(self, handle: ShuffleHandle) -> None:
        """Undo :meth:`_claim`'s mark: ``handle`` may finish again (nothing of it ran)."""
        handle._state.finished = False
        self._pending[handle.seq] = handle

    def _local_job(self, meta: LocalMeta, comm: str) -> Outcome:
        """Background work of a shuffle that communicates nothing (W == 1, identity)."""
        # Bad input caught at capture first: its meta has no sizes to build a message from.
        data = None if meta.status else message(meta, meta.agreement(), NO_PREV)[1]
        if meta.status or data is None:
            reraise(meta, ValueError(f"{type(self).__name__}: shuffle #{meta.seq}: invalid shuffle input on "
                                     f"rank(s) [0]: {meta.error}"))
        assert meta.host is not None, "a valid capture has data"
        b = meta.batch_size
        workloads = data.workloads
        stats = build_stats(seq=meta.seq, rank=meta.rank, comm=comm, workloads=workloads,
                            dest=np.zeros(b, np.int64), real=np.array([meta.real]),
                            lower_bound=max(float(workloads.sum()), float(workloads.max(initial=0.0))),
                            partition_s=0.0, traffic=Traffic(), background_s=0.0,
                            exhausted=np.array([meta.exhausted]))
        return Outcome(None, None, meta.layout, stats, np.zeros(b, np.int64), length=stay_length(meta))

    def _wait(self, handle: ShuffleHandle, limit: float | None) -> Outcome:
        """Wait for the background work of ``handle``, which the caller claimed.

        Interrupted while waiting (Ctrl-C: no ``Exception``, and not the job's
        own error), the claim is undone: no byte of phase 2 has moved, so the
        same call can finish the handle. ``close()`` on another thread ends
        the wait at once.
        """
        job = handle._job
        assert job is not None, "only handles with background work are waited for"
        try:
            return self._outcome(handle, job, limit)
        except BaseException as e:
            from_job = job.done() and not job.cancelled() and job.exception(0) is e
            if not isinstance(e, Exception) and not from_job:
                self._unclaim(handle)
            raise

    def _outcome(self, handle: ShuffleHandle, job: Future[Outcome], limit: float | None) -> Outcome:
        # Waits in slices of _CLOSED_POLL_S, looking at _closed between them. (Not
        # concurrent.futures.wait on the job and a closing future: a Ctrl-C inside its
        # Python-level acquisition of both futures' locks could leave one held, and the
        # job's set_result would then block the background thread for good.)
        deadline = None if limit is None else time.monotonic() + limit
        while not job.done():
            if self._closed:
                raise RuntimeError(f"shuffle handle #{handle.seq}: the shuffler was closed while "
                                   "finish_shuffle waited for its background work")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                err = RuntimeError(f"shuffle handle #{handle.seq}: the background work did not finish "
                                   f"within {limit:.0f} s (the partition child or a collective is stuck)")
                self._broken = err
                raise err
            try:
                job.exception(timeout=_CLOSED_POLL_S if left is None else min(_CLOSED_POLL_S, left))
            except concurrent.futures.TimeoutError:  # (exception() returns the job's own errors)
                continue
            except CancelledError:
                break
        try:
            return job.result(0)
        except CancelledError:
            raise RuntimeError(f"shuffle handle #{handle.seq}: the shuffler was closed") from None
        except ShuffleAbortedError as e:  # every later call: closed
            self._broken = self._broken or e
            raise

    def _done(self, handle: ShuffleHandle, stats: ShuffleStats) -> None:
        handle._state.stats = stats
        if self._log_interval and handle.rank == 0 and (handle.seq + 1) % self._log_interval == 0:
            logger.info("%s", format_stats(stats))
