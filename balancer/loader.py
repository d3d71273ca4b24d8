"""`BalancedLoader`: balance every rank's batches inside the data loader, on the host.

Wraps each rank's own loader (a ``DataLoader`` or any iterable of
:class:`~balancer.batch.BaseBatch` or :class:`~balancer.tokens.TokenBatch`).
Per step ``s``, on every rank of the group:

1. a background thread (``balancer-loader``) takes batch ``s`` of this rank's
   loader and pads it to ``batch_size`` (:func:`~balancer.batch.pad_batch`,
   :meth:`~balancer.tokens.TokenBatch.pad`; an incomplete last batch); once the loader is exhausted it takes an
   all-padding batch of the same layout instead (see *Uneven loaders*);
2. the same thread shuffles it with a :class:`~balancer.shuffler.BatchShuffler`
   on the host: metadata all-gather, partition and plan in the shuffler's own
   thread and child process, then one gloo collective on the shuffler's own
   group moves the samples -- never on the caller's group (not even for a
   loader that yields device batches, which gloo moves through host memory), so
   the training loop's collectives are not disturbed;
3. it decides whether the epoch goes on (below), pins the batch when asked
   (and CUDA is present), and queues it;
4. the training thread's ``next()`` only waits on that queue. ``ahead``
   batches stay ready in advance, so with ``ahead >= 1`` the wait is near
   zero; the user copies each batch to the device as usual.

Each yielded batch has ``batch_size`` samples: the real samples the shuffle
assigned to this rank (ascending global order), then padding. Normalise the
loss globally (:func:`balancer.loss.global_mean_loss`): near the end of an
uneven epoch a rank may get a batch with ``actual_batch_size == 0``.

Uneven loaders (the policy: stop together). A rank whose loader is exhausted
keeps taking part with all-padding batches (built from a template of its first
batch) while any rank still has data, so the remaining samples are spread over
all ranks and every sample is yielded exactly once per epoch. Every rank stops
at the first step at which every rank was exhausted. Ranks learn it from the
step's shuffle, which carries every rank's flag (``start_shuffle_async(...,
exhausted=True)``, read back as ``ShuffleStats.world_exhausted``, also with
``group_size``): no collective of its own. Every rank yields the same number
of batches.

Failures. Bad input on one rank (layout, batch size, workloads) raises the
shuffler's ``ValueError`` on every rank; an exception of one rank's loader is
sent through the shuffle too, so every rank raises the same ``ValueError``
(naming the rank and the exception, chained from it on the failing rank; one
that is no ``Exception``, such as ``KeyboardInterrupt``, is raised as itself
there). Each is raised by the next ``next()``, which then ends the epoch. A
peer that stops taking part raises :class:`~balancer.errors.ShuffleAbortedError`
after ``timeout``.

Resuming. :meth:`BalancedLoader.state_dict` records the epoch and how many
batches the user consumed in it; a fresh loader given it by
:meth:`~BalancedLoader.load_state_dict` fast-forwards the wrapped loader past
them (batches prefetched but not consumed are produced again) and yields
exactly the batches an uninterrupted run would have, provided the wrapped
loader yields the same batches for the same epoch (seeded sampler,
``set_epoch``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch.distributed as dist

from balancer import _comm
from balancer._destinations import PartitionFn
from balancer._devices import caller_cuda_device
from balancer._ints import is_int
from balancer._loader_producer import Failed, Item, Run, Template, Workloads, produce
from balancer.config import check_bool, check_interval, check_timeout
from balancer.partition import balanced_partition
from balancer.shuffler import BatchShuffler, ShuffleStats
from balancer.tokens import TokenBatch

if TYPE_CHECKING:  # the token path runs without TorchRec (balancer._torchrec)
    from balancer.batch import BaseBatch

logger = logging.getLogger(__name__)

__all__ = ["BalancedLoader"]

_B = TypeVar("_B", bound="BaseBatch | TokenBatch")


class BalancedLoader(Generic[_B]):
    """An iterable of balanced CPU batches over each rank's own loader.

    Every rank of ``group`` constructs it at the same point of its program
    (the constructor creates the shuffler's two gloo groups)
    and iterates it in step. See the module docstring for the data path, the
    stop-together policy for uneven loaders, failures and resuming.

    Example::

        loader = BalancedLoader(DataLoader(ds, batch_size=64, sampler=sampler, collate_fn=collate),
                                HSTUAttentionCost(["item"], ...), ahead=2, pin_memory=True)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                batch = batch.to(device, non_blocking=True)
                ...
        loader.close()

    Args:
        loader: this rank's iterable of :class:`BaseBatch` or
            :class:`~balancer.tokens.TokenBatch` (one kind), the same
            ``batch_size`` on every rank (a smaller batch is padded).
        workload_fn: per-sample cost, ``batch -> [batch_size]`` (see
            :mod:`balancer.workloads`).
        group: the data-parallel process group; ``None`` is the default group
            (resolved now). Without torch.distributed or with one rank,
            batches pass through unchanged (padded).
        ahead: balanced batches kept ready in advance (>= 0). ``0``: each
            ``next()`` waits for its step's shuffle. The yields do not depend
            on it.
        batch_size: samples per batch; ``None`` takes the first batch's of
            each pass, learned anew in every pass (pass it when a rank's first
            batch may be incomplete).
        pin_memory: pin every yielded batch (only when CUDA is available).
        comm, partition, locality, executor, timeout, log_interval, token_cap, group_size: the
            :class:`~balancer.shuffler.BatchShuffler` settings.

    Raises:
        ValueError: on an invalid setting, naming the value and the expectation.
    """

    def __init__(self, loader: Iterable[_B], workload_fn: Callable[[Any], Any], *,
                 group: dist.ProcessGroup | None = None, ahead: int = 2, batch_size: int | None = None,
                 pin_memory: bool = False, comm: str = "all2all", partition: PartitionFn = balanced_partition,
                 locality: bool = True, executor: str = "auto", timeout: float = 300.0,
                 log_interval: int = 0, token_cap: float | None = None, group_size: int | None = None) -> None:
        me = type(self).__name__
        if not isinstance(loader, Iterable):
            raise ValueError(f"{me}: loader={loader!r}, expected an iterable of BaseBatch or TokenBatch")
        if not callable(workload_fn):
            raise ValueError(f"{me}: workload_fn={workload_fn!r}, expected a callable batch -> [batch_size]")
        check_interval(me, "ahead", ahead)
        if batch_size is not None and not is_int(batch_size, 1):
            raise ValueError(f"{me}: batch_size={batch_size!r}, expected None or an int >= 1")
        check_bool(me, "pin_memory", pin_memory)
        check_timeout(me, "timeout", timeout)
        self._loader = loader
        self._ahead, self._pin = ahead, pin_memory
        self._workloads = Workloads(workload_fn)
        self._shuffler = BatchShuffler(self._workloads, comm=comm, partition=partition, locality=locality,
                                       executor=executor, timeout=timeout, log_interval=log_interval,
                                       token_cap=token_cap, group_size=group_size)
        self._group, self._world, _ = _comm.resolve_group(group, "BalancedLoader")
        # On the calling thread, at the same point on every rank: group
        # creation is itself collective, and the producer thread must never
        # create a group while the training thread creates others.
        self._shuffler._own_phase2 = True  # its shuffles run on the loader's thread (module docstring)
        self._shuffler.connect(group)
        self._template = Template(given=batch_size)
        self._epoch = 0
        self._consumed = 0  # batches the user took from the current (or last) pass
        self._pass_epoch = 0  # the epoch of that pass (or of a loaded state)
        self._skip = 0  # steps the next pass fast-forwards (load_state_dict)
        self._run: Run | None = None
        self._ending: list[Run] = []  # runs being stopped: an interrupted join is taken up again
        self._lock = threading.RLock()  # one pass starts or stops at a time, whichever thread asks
        self._stats: ShuffleStats | None = None
        self._closed = False
        self._shut = False  # close() finished
        self._finalizer = weakref.finalize(self, _stop_quietly, [None])

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[_B]:
        """Start a pass (an epoch) over the wrapped loader.

        Stops a previous pass first (waiting for its credited steps). Resumes
        after the consumed batches of a loaded state.
        """
        with self._lock:
            return self._start_pass()

    def _start_pass(self) -> Iterator[_B]:
        if self._closed:
            raise RuntimeError("BalancedLoader is closed")
        self._end_run()
        if self._closed:  # closed while the previous pass ended (a signal handler, a finalizer)
            raise RuntimeError("BalancedLoader is closed")
        skip, self._skip = self._skip, 0
        # The batch size (unless given) and the padding layout come from this
        # pass's batches only: a pass then behaves the same after earlier
        # passes (one of another batch size, or one that failed) as at the
        # start of a resumed run.
        self._template.reset()
        run = Run(self._ahead)
        # iter() on the calling thread: a DataLoader starts its worker
        # processes here, as it would without the wrapper. If that fails, the
        # producer reports it through the first shuffle, so every rank raises.
        # A KeyboardInterrupt or CancelledError too: raised here, this rank
        # would skip the pass's first shuffle and fall one step behind its peers.
        try:
            source = iter(self._loader)
        except BaseException as e:  # noqa: BLE001 - raised on every rank by the first next()
            source = _raising(e)
        args = (run, source, skip, self._shuffler, self._workloads, self._template, self._group,
                self._world, self._pin, caller_cuda_device())
        run.thread = threading.Thread(target=produce, args=args, name="balancer-loader", daemon=True)
        run.thread.start()
        self._run, self._consumed, self._pass_epoch = run, skip, self._epoch
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop_quietly, [run])
        return _BalancedIterator(self, run)

    def _next(self, run: Run) -> _B:
        if run is not self._run:
            raise StopIteration  # a newer pass (or close) ended this one
        run.grant()
        try:
            item = run.items.get()
        except BaseException:
            # Interrupted (Ctrl-C) before the batch came: the credit for a step
            # ahead would make this rank's producer run a shuffle that a peer
            # stopped at the same count never joins (close() would wait for it).
            run.revoke()
            raise
        if isinstance(item, Item):
            self._consumed += 1
            self._stats = item.stats
            return item.batch  # type: ignore[return-value]
        with self._lock:  # end this pass only: another thread may have started the next one
            if self._run is run:
                self._end_run()
            else:
                run.join()
        if isinstance(item, Failed):
            raise item.error
        raise StopIteration

    def _end_run(self) -> None:
        with self._lock:
            run, self._run = self._run, None
            if run is not None:
                self._ending.append(run)
            while self._ending:
                ending = self._ending[0]
                ending.join()  # interrupted (Ctrl-C): still listed, joined by the next call
                if self._ending and self._ending[0] is ending:  # a re-entrant close() may have popped it
                    self._ending.pop(0)

    # -------------------------------------------------------------- control
    @property
    def stats(self) -> ShuffleStats | None:
        """:class:`ShuffleStats` of the batch yielded last (``None`` before the first)."""
        return self._stats

    @property
    def batch_size(self) -> int | None:
        """Samples per yielded batch: the given ``batch_size``, or the current (or
        last) pass's first batch's (``None`` until seen)."""
        return self._template.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass and forward it to the wrapped loader's
        ``set_epoch``, or else to every one of its sampler (e.g.
        ``DistributedSampler``), batch sampler, the batch sampler's sampler and
        dataset (an ``IterableDataset``) that has one. A
        different epoch than a loaded state's starts that epoch from its
        beginning; the same one keeps the resume point."""
        if not is_int(epoch, 0):
            raise ValueError(f"BalancedLoader.set_epoch: epoch={epoch!r}, expected an int >= 0")
        if epoch != self._epoch:
            self._skip = 0
        self._epoch = epoch
        for target in _epoch_targets(self._loader):
            target.set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "consumed", "world_size"}``: the epoch and the batches the user
        took from its pass so far (equal on every rank that trained the same
        steps; 0 after ``set_epoch`` of an epoch whose pass has not started),
        and the number of ranks that took them."""
        consumed = self._consumed if self._pass_epoch == self._epoch else self._skip
        return {"epoch": self._epoch, "consumed": consumed, "world_size": self._world}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict`: the next pass of ``state["epoch"]``
        skips its first ``state["consumed"]`` batches (stops a running pass).

        Raises:
            ValueError: a malformed state, or one saved by another number of
                ranks (each rank's loader then shards the data differently, and
                skipping ``consumed`` batches would lose or repeat samples).
        """
        for key in ("epoch", "consumed"):
            v = state.get(key) if isinstance(state, dict) else None
            if not is_int(v, 0):
                raise ValueError(f"BalancedLoader.load_state_dict: {key}={v!r}, expected an int >= 0")
        saved = state.get("world_size", self._world)  # states without it predate the key
        if saved != self._world:
            raise ValueError(f"BalancedLoader.load_state_dict: world_size={saved!r}, expected {self._world} "
                             "(the state was saved by another number of ranks: their loaders shard the data "
                             "differently, so skipping its consumed batches would lose or repeat samples; "
                             "start the epoch afresh with set_epoch instead)")
        self._end_run()
        self.set_epoch(state["epoch"])
        self._skip = self._consumed = state["consumed"]
        self._pass_epoch = state["epoch"]

    def close(self) -> None:
        """Stop the producer thread (after the steps it has credit for, which
        every peer that consumed as many batches runs too) and the shuffler.
        Idempotent (a ``close()`` interrupted by Ctrl-C finishes when called
        again); iterating afterwards raises ``RuntimeError``."""
        if self._shut:
            return
        self._closed = True
        runs = [r for r in (self._run, *self._ending) if r is not None]
        if any(r.thread is threading.current_thread() for r in runs):
            # Called on a producer thread (a finalizer the garbage collector ran there): it
            # cannot wait for itself, and the thread holding the lock may be waiting for it.
            for r in runs:
                r.stop()
            return
        with self._lock:
            if self._shut:
                return
            self._end_run()
            self._finalizer.detach()
            self._shuffler.close()
            self._shut = True

    def __enter__(self) -> BalancedLoader[_B]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _BalancedIterator(Generic[_B]):
    """The iterator of one pass; dropping it stops that pass's producer."""

    def __init__(self, owner: BalancedLoader[_B], run: Run) -> None:
        self._owner, self._run = owner, run
        weakref.finalize(self, run.stop)

    def __iter__(self) -> _BalancedIterator[_B]:
        return self

    def __next__(self) -> _B:
        return self._owner._next(self._run)


def _raising(error: BaseException) -> Iterator[Any]:
    raise error
    yield  # a generator: raises at its first next()


def _stop_quietly(holder: list[Run | None]) -> None:
    run = holder[0]
    if run is not None:
        run.stop()


def _epoch_targets(loader: Any) -> list[Any]:
    """The objects whose ``set_epoch`` orders ``loader``'s samples: the loader
    itself if it has one, else every one of its sampler, batch sampler, the
    batch sampler's sampler and its dataset (an ``IterableDataset``) that has."""
    if callable(getattr(loader, "set_epoch", None)):
        return [loader]
    batch_sampler = getattr(loader, "batch_sampler", None)
    out: list[Any] = []
    for obj in (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None),
                getattr(loader, "dataset", None)):
        if obj is not None and callable(getattr(obj, "set_epoch", None)) and all(obj is not o for o in out):
            out.append(obj)
    return out


