"""TorchRec train pipelines that balance every batch before its input dist.

A batch is rebalanced between its arrival from the data loader and its sparse
data dist (``ShardedModule.input_dist``), in two phases split around the
forward of the batch being trained, so the exchange of metadata and the
partition run in the background while the device computes. Step ``i`` of
:class:`BalancedTrainPipelineSparseDist`:

1. ``start_sparse_data_dist(batch i+1)``: input dist of a batch shuffled during
   step ``i-1``.
2. ``enqueue_batch``: batch ``i+2`` comes from the data loader; **phase 1**
   runs on that host batch (workloads and lengths are host data, so nothing is
   read from the device), then TorchRec copies it to the device (memcpy
   stream). The shuffler's background thread all-gathers the metadata over a
   gloo group, partitions and plans phase 2.
3. ``forward(batch i)``; the background work for batch ``i+2`` runs meanwhile.
4. **phase 2** (right after the forward, on the memcpy stream): one
   collective redistributes the device copy of batch ``i+2``; it replaces the
   unshuffled batch in the pipeline queue.
5. ``wait_sparse_data_dist(batch i+1)``, backward, optimizer step of batch ``i``.

No step of this reads a device value on the host: the pipeline never waits
for the device because of balancing.

:class:`BalancedPrefetchTrainPipelineSparseDist` uses the same hooks on
TorchRec's ``PrefetchTrainPipelineSparseDist`` (CUDA only: TorchRec skips its
prefetch stage without streams): phase 1 before the forward, phase 2 right
after it, the input dist of batch ``i+2`` at the end of the step. Other TorchRec
variants (semi-sync, fused sparse dist, ...) are not supported.

The one rule for every hook order: a batch's input dist starts only after its
shuffle finished. :meth:`~BalancedTrainPipelineSparseDist.start_sparse_data_dist`
and ``_init_pipelined_modules`` finish a pending shuffle first; with
``enqueue_batch_after_forward=True`` phase 1 therefore runs after the forward and
phase 2 in the next step's ``start_sparse_data_dist`` (the background work
overlaps the backward instead).

Collective order: phase 2 is a collective on the data-parallel group;
TorchRec's input/output dists and DDP's gradient all-reduce use the sharding
group (possibly another communicator). All are issued from the calling thread
in the same program order on every rank, and on CUDA stream waits make the
device run them in that order too (see ``_fence_before_exchange``). Phase 1's
collective runs on the shuffler's own gloo group, which no other thread uses.
Uneven loaders stop together: a rank whose loader is exhausted takes part with
batches of no real sample (``padding_like`` of its last batch, shuffled with
``exhausted=True``) while any peer has data, and every rank ends the pass at the
first shuffle whose every rank was exhausted (that all-padding batch is
dropped): every rank runs the same number of steps and every sample is trained
once (pad an incomplete last batch with :func:`balancer.pad_batch`). With even
loaders that is one shuffle more per pass, of padding only.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torchrec
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup
from torchrec.distributed.train_pipeline import (
    PrefetchTrainPipelineSparseDist,
    TrainPipelineSparseDist,
)
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

from balancer import _comm
from balancer._devices import collective_device
from balancer._protocol import NoBatch
from balancer.batch import BaseBatch, padding_like
from balancer.config import BalancerConfig
from balancer.partition import balanced_partition, karmarkar_karp
from balancer.shuffler import BatchShuffler, IdentityBatchShuffler, ShuffleHandle, ShuffleStats
from balancer.workloads import TokenCount, WorkloadFn

logger = logging.getLogger(__name__)

__all__ = [
    "BalancedPrefetchTrainPipelineSparseDist",
    "BalancedTrainPipelineSparseDist",
    "create_train_pipeline",
]

Shuffler = BatchShuffler | IdentityBatchShuffler


@dataclasses.dataclass(frozen=True)
class _PendingShuffle:
    """A shuffle whose phase 1 ran; ``index`` is its batch's context index,
    ``batch`` its device copy (phase 2's input)."""

    index: int
    batch: BaseBatch
    handle: ShuffleHandle


def _stream_ctx(stream: torch.Stream | None) -> contextlib.AbstractContextManager[Any]:
    # On CPU the pipeline has no streams (None): run on the caller's "stream".
    if stream is None:
        return contextlib.nullcontext()
    # The device's own module (torch.cuda, torch.mtia, ...), as TorchRec does.
    return torch.get_device_module(stream.device).stream(stream)  # type: ignore[no-any-return]


class BalancedTrainPipelineSparseDist(TrainPipelineSparseDist):
    """``TrainPipelineSparseDist`` that rebalances each batch before its input dist.

    Args:
        model: the ``DistributedModelParallel`` model, as for TorchRec.
        optimizer: the (combined) optimizer, as for TorchRec.
        device: the training device.
        shuffler: a ``BatchShuffler``, or an ``IdentityBatchShuffler`` for the
            plain TorchRec behaviour (then no collective and no stream wait is
            added).
        pg: the data-parallel process group the shuffler uses; ``None`` is the
            default group, resolved at call time.
        **kwargs: passed to the TorchRec pipeline (``execute_all_batches``,
            ``enqueue_batch_after_forward``, ``custom_model_fwd``, ...).

    Batches must be :class:`~balancer.batch.BaseBatch` instances of the same
    ``batch_size`` on every rank. :attr:`last_step_stats` holds the balance
    statistics of the batch trained by the latest :meth:`progress`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        shuffler: Shuffler,
        *,
        pg: ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, optimizer, device, **kwargs)
        self._shuffler = shuffler
        self._shuffle_pg = pg
        self._communicates = not isinstance(shuffler, IdentityBatchShuffler)
        self._pending: collections.deque[_PendingShuffle] = collections.deque()
        self._started: ShuffleHandle | None = None  # phase 1 of the batch being enqueued
        self._template: BaseBatch | None = None  # the last BaseBatch drawn (see _next_batch)
        # The pass's loader iterator; whether it is exhausted on this rank (padding
        # stands in: _ran_out), and whether every rank's was (the pass ended).
        self._source: Iterator[Any] | None = None
        self._out = False
        self._ended = False
        self._stats: dict[int, ShuffleStats] = {}
        self.last_step_stats: ShuffleStats | None = None
        # Phase 2 runs right after the forward of the current batch, whichever
        # TorchRec variant calls it: both call ``self._model_fwd(batches[0])``.
        model_fwd: Callable[[Any], Any] = self._model_fwd  # type: ignore[has-type]

        # Online calibration: the shuffler learns its cost model from the
        # forward + backward time of every batch it balanced in training mode
        # (an evaluation pass, model.eval(), runs no backward: its times are not
        # a training step's, and are not reported).
        self._timed = isinstance(shuffler, BatchShuffler) and shuffler.calibrate
        self._handles: dict[int, ShuffleHandle] = {}  # context index -> shuffle (timed only)
        self._spans: list[tuple[Any, Any]] = []

        def forward_then_finish(batch: Any) -> Any:
            # (TorchRec's progress runs the backward only where the model is training)
            training = self._timed and self._model.training
            start = self._mark() if training else None
            out = model_fwd(batch)
            self._spans = [(start, self._mark())] if training else []
            self._finish_shuffles()
            return out

        self._model_fwd = forward_then_finish

    @property
    def shuffler(self) -> Shuffler:
        """The shuffler this pipeline balances batches with."""
        return self._shuffler

    # ------------------------------------------------------------ TorchRec hooks
    def _next_batch(self, dataloader_iter: Iterator[Any]) -> Any:
        """The next host batch from the loader; its shuffle starts here (phase 1),
        before TorchRec copies it to the device. Once this rank's loader is
        exhausted, a batch of no real sample stands in while any peer has data
        (see :meth:`_ran_out`)."""
        if dataloader_iter is not self._source:  # a new pass
            self._source, self._out, self._ended = dataloader_iter, False, False
        if self._ended:
            return None
        try:
            batch = None if self._out else super()._next_batch(dataloader_iter)
        except BaseException as e:  # noqa: BLE001 - told to every rank through the shuffle
            return self._loader_failed(e)
        if batch is None:
            return self._ran_out()
        self._started = self._start_shuffle(batch)
        if not isinstance(batch, BaseBatch):
            # Its shuffle carries the verdict to every rank, which raise when it is
            # finished, in the same step; until then this rank keeps in step with
            # a batch of no real sample instead of leaving its peers in TorchRec's
            # collectives.
            assert self._template is not None, "_start_shuffle raised without one"
            batch = padding_like(self._template)
        return batch

    def _loader_failed(self, error: BaseException) -> Any:
        """This rank's loader raised ``error``. Raised here alone, it would leave the
        peers in TorchRec's input dist, which no shuffler timeout covers: the shuffle
        of this step tells every rank instead, and each raises its ``ValueError``
        when that shuffle finishes, in the same step (here chained from ``error``, or
        ``error`` itself where it is no ``Exception``). Until then this rank keeps in
        step with a batch of no real sample; before its first batch there is none to
        take the layout of, and the shuffle is finished at once (as in
        :meth:`_ran_out`)."""
        if self._alone() or not isinstance(self._shuffler, BatchShuffler):
            raise error  # no peer to tell (or nothing to tell them with)
        failed = NoBatch(f"the data loader raised {type(error).__name__}: {error}", error)
        if self._template is None:
            self._fail_everywhere(failed)
        stand_in = padding_like(self._template)  # before the shuffle starts: nothing can fail after it
        self._started = self._shuffler.start_shuffle_async(failed, pg=self._shuffle_pg)
        return stand_in

    def _alone(self) -> bool:
        """No peer to keep in step with: balancing off, or one rank."""
        return not self._communicates or _comm.resolve_group(self._shuffle_pg)[1] == 1

    def _fail_everywhere(self, none: NoBatch) -> NoReturn:
        """Shuffle ``none`` and finish it at once: every rank raises its ``ValueError``
        in the same step (finished here too: a process that raised at once could exit
        before its peers have read it)."""
        handle = self._shuffler.start_shuffle_async(none, pg=self._shuffle_pg)
        self._shuffler.finish_shuffle(none, handle, pg=self._shuffle_pg)  # type: ignore[type-var]
        raise AssertionError("a shuffle of no batch finished")

    def _ran_out(self) -> Any:
        """This rank's loader is exhausted: ``None`` (the pass ends here, as in
        TorchRec) without peers to keep in step with; otherwise a batch of no
        real sample, shuffled with ``exhausted=True``, so that the samples of
        peers with more batches are spread over every rank and TorchRec's
        collectives stay in step. The pass ends on every rank at the first
        shuffle whose every rank was exhausted (its all-padding batch is
        dropped: :meth:`_drop_if_ended`)."""
        if self._alone():
            return None
        if self._template is None:
            # No batch to take the layout of: the shuffle tells every rank, instead of
            # leaving them in phase 1 until the timeout while this rank ends its pass alone.
            self._fail_everywhere(NoBatch("the loader yielded no batch before this rank's first shuffle, so it has "
                                          "no layout to take part with; every rank's loader must yield a batch in "
                                          "the first pass"))
        self._out = True
        batch = padding_like(self._template)
        with record_function("## balancer.pipeline.start_shuffle ##"):
            self._started = self._shuffler.start_shuffle_async(batch, pg=self._shuffle_pg, exhausted=True)
        return batch

    def enqueue_batch(self, dataloader_iter: Iterator[Any]) -> bool:
        """Copy the next batch to the device; its shuffle was started on the host batch."""
        self._started = None
        if not super().enqueue_batch(dataloader_iter):
            return False
        if self._started is not None:
            index = self.contexts[-1].index
            self._pending.append(_PendingShuffle(index, self.batches[-1], self._started))
            if self._timed:
                self._handles[index] = self._started
            self._started = None
            if self._out and len(self.batches) == 1:
                # The first batch of a pass, from an exhausted rank: finished here
                # (its peers finish theirs next, before any other collective), so
                # that a pass every rank starts exhausted ends before TorchRec
                # starts the batch's input dist.
                self._finish_shuffles()
                return bool(self.batches)
        return True

    def start_sparse_data_dist(self, batch: Any, context: TrainPipelineContext) -> None:
        """Finish the batch's shuffle if still pending, then start its input dist."""
        if batch is not None:
            self._finish_shuffles(until=context.index)
            if not any(ctx is context for ctx in self.contexts):
                return  # the pass ended with this batch, dropped on every rank
            batch = self._queued_batch(context, batch)
        super().start_sparse_data_dist(batch, context)

    def _init_pipelined_modules(
        self,
        batch: Any,
        context: TrainPipelineContext,
        pipelined_forward: type[PipelinedForward] = PipelinedForward,
    ) -> None:
        # The first batch is traced and input-dist'ed here (fill_pipeline).
        self._finish_shuffles(until=context.index)
        super()._init_pipelined_modules(
            self._queued_batch(context, batch), context, pipelined_forward
        )

    def _backward(self, losses: torch.Tensor) -> None:
        start = self._mark() if self._spans else None
        super()._backward(losses)
        if self._spans:  # after a timed forward
            self._spans.append((start, self._mark()))

    def dequeue_batch(self) -> None:
        """Retire the oldest batch: its stats become ``last_step_stats`` and its
        compute time goes to the calibration (when timed)."""
        if self.contexts:
            index = self.contexts[0].index
            self.last_step_stats = self._stats.pop(index, None)
            handle = self._handles.pop(index, None)
            if handle is not None and self._spans and isinstance(self._shuffler, BatchShuffler):
                self._report(self._shuffler, handle)
        super().dequeue_batch()

    def _mark(self) -> Any:
        """A point in time: a CUDA event on the current stream (read later,
        once complete), or the monotonic clock on the CPU."""
        if not self._timed:
            return None
        if self._device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._device))  # the training device's, whatever is current
            return event
        return time.perf_counter()

    def _report(self, shuffler: BatchShuffler, handle: ShuffleHandle) -> None:
        spans, self._spans = self._spans, []
        if self._device.type == "cuda":
            shuffler.record_compute(handle, events=spans)
        else:
            shuffler.record_compute(handle, sum(end - start for start, end in spans))

    def reset(self) -> None:
        """Finish every pending shuffle (a collective: call on every rank), then
        TorchRec's reset."""
        self._finish_shuffles()
        self._stats.clear()
        self._handles.clear()
        # The next pass may come from the same iterator object (a DataLoader with
        # persistent workers hands out the same one every epoch), as in TorchRec.
        self._source, self._out, self._ended = None, False, False
        super().reset()

    def close(self) -> None:
        """Finish pending shuffles (a collective: call on every rank) and stop the shuffler.

        Never raises for a pending shuffle that fails (a peer died, or the
        shuffler was already aborted): its batch would not be trained anyway, so
        the error is logged, and the shuffler is stopped all the same. (It
        raised, left the shuffler's thread and child running, and in a
        ``finally:`` replaced the error that ended the loop.) With CUDA batches on
        an NCCL group, finishing is an all-to-all there: after an error on one
        rank only, close the shuffler alone (``pipeline.shuffler.close()``, no
        collective; docs/gpu.md, "NCCL failures")."""
        try:
            self._finish_shuffles()
        except Exception as e:  # noqa: BLE001 - see the docstring
            logger.warning("balancer: a pending shuffle failed while closing the pipeline: %s", e)
            self._pending.clear()
        finally:
            self._shuffler.close()

    # ------------------------------------------------------------------ shuffles
    def _start_shuffle(self, batch: Any) -> ShuffleHandle:
        if not isinstance(batch, BaseBatch):
            problem = f"{type(self).__name__} needs balancer.BaseBatch batches, got {type(batch).__name__}"
            if self._template is None or not isinstance(self._shuffler, BatchShuffler):
                # No batch to stand in for it (the first one), or nothing to tell the
                # peers with (no shuffle across ranks): this rank stops here.
                with contextlib.suppress(Exception):
                    self._shuffler.start_shuffle_async(batch, pg=self._shuffle_pg)
                raise TypeError(problem)
            logger.error("balancer: %s; every rank raises when its shuffle finishes", problem)
            return self._shuffler.start_shuffle_async(batch, pg=self._shuffle_pg)
        self._template = batch
        # A host batch: phase 1 issues no device work, so it needs no stream
        # and no fence, and it reads nothing back from the device.
        with record_function("## balancer.pipeline.start_shuffle ##"):
            return self._shuffler.start_shuffle_async(batch, pg=self._shuffle_pg)

    def _finish_shuffles(self, until: int | None = None) -> None:
        """Run phase 2 of pending shuffles, oldest first (the shuffler's order)."""
        while self._pending and (until is None or self._pending[0].index <= until):
            p = self._pending[0]
            with record_function(f"## balancer.pipeline.finish_shuffle {p.index} ##"):
                self._fence_before_exchange()
                with _stream_ctx(self._memcpy_stream):
                    try:
                        shuffled = self._shuffler.finish_shuffle(p.batch, p.handle, pg=self._shuffle_pg)
                    except BaseException as e:
                        # Used up (an error; or an interrupt that was the shuffle's own
                        # outcome, e.g. this rank's loader's KeyboardInterrupt carried by
                        # it): the next call moves on. An interrupt while waiting leaves
                        # it pending: the shuffler keeps the handle, the next call finishes it.
                        if isinstance(e, Exception) or p.handle._state.finished:
                            self._pending.popleft()
                        raise
                self._pending.popleft()
                self._fence_after_exchange()
                # The shuffled tensors were allocated on the memcpy stream but are
                # read by the data-dist stream (input dist) and the default stream
                # (forward); tell the caching allocator before any of them is freed.
                for stream in self._consumer_streams():
                    shuffled.record_stream(stream)
            self._stats[p.index] = p.handle.stats
            self._replace_queued_batch(p.index, shuffled)
            self._drop_if_ended(p.index, p.handle.stats)

    def _drop_if_ended(self, index: int, stats: ShuffleStats) -> None:
        """Every rank was exhausted at this shuffle (the same answer on every rank):
        its batch holds no real sample anywhere, so it is dropped from the queue (a
        step on it would train nothing and still step the optimizer), and no batch
        is drawn until the next pass."""
        if not (stats.world_exhausted and all(stats.world_exhausted)):
            return
        pos = self._position(index)
        if pos is not None:
            del self.batches[pos]
            del self.contexts[pos]
        self._stats.pop(index, None)
        self._handles.pop(index, None)
        self._ended = True
        logger.debug("balancer: every rank's loader was exhausted at batch %d: the pass ends", index)

    def _position(self, index: int) -> int | None:
        """Where the batch of context ``index`` is queued (``None``: no longer queued)."""
        return next((pos for pos, ctx in enumerate(self.contexts) if ctx.index == index), None)

    def _replace_queued_batch(self, index: int, batch: BaseBatch) -> None:
        pos = self._position(index)
        if pos is not None:
            self.batches[pos] = batch
        else:  # the pipeline was reset while the shuffle was pending: nothing to replace
            self._stats.pop(index, None)

    def _queued_batch(self, context: TrainPipelineContext, default: Any) -> Any:
        for pos, ctx in enumerate(self.contexts):
            if ctx is context:
                return self.batches[pos]
        return default

    # ------------------------------------------------------------------- streams
    def _consumer_streams(self) -> list[torch.Stream]:
        if self._memcpy_stream is None:
            return []
        current = torch.get_device_module(self._device).current_stream(self._device)
        return [s for s in (current, self._data_dist_stream) if s is not None]

    def _fence_before_exchange(self) -> None:
        # Collective-ordering hazard. Phase 2's collective (DP group, memcpy
        # stream) and TorchRec's (input dist on the data-dist stream, output
        # dist and DDP's gradient all-reduce on the default stream; possibly
        # other process groups, hence other NCCL communicators) are issued on
        # the host in the same program order on every rank. On the device,
        # though, collectives on different streams and communicators may *run*
        # in any order: rank 0 could start a gradient all-reduce while rank 1
        # starts the shuffle's all-to-all, and each waits forever for its peer.
        # So the exchange is fenced: the memcpy stream first waits for all work
        # issued before it on the default and data-dist streams (here), and
        # those streams wait for it before anything issued after it (in
        # _fence_after_exchange). The device then runs collectives in host
        # program order, identical on every rank. These are device-side waits
        # only: nothing in the shuffle reads a device value on the host, so the
        # host keeps running ahead. The price is on the device: the exchange
        # cannot start before the forward queued ahead of it has finished.
        # Phase 1 needs no fence: its collective runs on the shuffler's own gloo
        # group, on host memory, in its background thread.
        # On CPU/gloo there are no streams; gloo matches collectives by issue
        # order per process group, which is again the same program order.
        if self._memcpy_stream is None or not self._communicates:
            return
        for stream in self._consumer_streams():
            self._memcpy_stream.wait_stream(stream)

    def _fence_after_exchange(self) -> None:
        # See _fence_before_exchange: the default stream (forward/backward, loss
        # and gradient collectives) and the data-dist stream (input dist) must
        # not run anything issued after the exchange before it is done.
        if self._memcpy_stream is None or not self._communicates:
            return
        for stream in self._consumer_streams():
            stream.wait_stream(self._memcpy_stream)


def _prefetch_runs_on_contexts(cls: Any = PrefetchTrainPipelineSparseDist) -> bool:
    """Whether TorchRec's prefetch pipeline drives batches through per-batch
    contexts (``enqueue_batch`` / ``dequeue_batch``, ``_prefetch(context)``:
    TorchRec 1.8), the hooks the balanced pipeline overrides. TorchRec 1.6's
    runs its own loop (``_copy_batch_to_gpu``, ``_prefetch(batch)``)."""
    return list(inspect.signature(cls._prefetch).parameters)[1:2] == ["context"]


class BalancedPrefetchTrainPipelineSparseDist(
    BalancedTrainPipelineSparseDist, PrefetchTrainPipelineSparseDist
):
    """``PrefetchTrainPipelineSparseDist`` (cached embeddings) with balancing.

    Same arguments and hooks as :class:`BalancedTrainPipelineSparseDist`; the
    shuffle of batch ``i+2`` starts before the forward of batch ``i`` and
    finishes right after it, before the input dist of batch ``i+2`` at the end
    of the step. CUDA only: TorchRec's prefetch stage needs streams.

    TorchRec's prefetch step runs the backward itself (not through
    ``_backward``), so for online calibration the second span runs from the
    forward's end to the end of the step's compute (the next input dist or
    the dequeue): the cache prefetch of batch ``i+1`` on its own stream, the
    backward and the optimizer step.

    Raises:
        RuntimeError: with a TorchRec whose prefetch pipeline runs its own loop
            (TorchRec 1.6), where the hooks above are never called.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not _prefetch_runs_on_contexts():
            raise RuntimeError(
                "BalancedPrefetchTrainPipelineSparseDist needs TorchRec's context-based prefetch pipeline "
                f"(TorchRec 1.8: _prefetch(context)); torchrec {torchrec.__version__} has "
                "_prefetch(batch) and its own progress loop, which never calls the hooks that balance "
                "the batches. Use BalancedTrainPipelineSparseDist, or upgrade TorchRec"
            )
        super().__init__(*args, **kwargs)

    def start_sparse_data_dist(self, batch: Any, context: TrainPipelineContext) -> None:
        """Close the timed backward span (TorchRec's prefetch step runs backward
        itself), then the balanced pipeline's hook."""
        self._close_backward_span()
        super().start_sparse_data_dist(batch, context)

    def dequeue_batch(self) -> None:
        """Close the timed backward span, then retire the oldest batch."""
        self._close_backward_span()
        super().dequeue_batch()

    def _close_backward_span(self) -> None:
        """After a forward (one span recorded), the span up to now (backward and step)."""
        if self._timed and len(self._spans) == 1:
            self._spans.append((self._spans[0][1], self._mark()))


class _AllFeaturesTokenCount:
    """``TokenCount`` over every key of ``batch.features`` (keys read per batch)."""

    def __init__(self) -> None:
        self._by_keys: dict[tuple[str, ...], TokenCount] = {}

    def __call__(self, batch: BaseBatch) -> torch.Tensor:
        keys = tuple(batch.features.keys())
        fn = self._by_keys.get(keys)
        if fn is None:
            fn = self._by_keys[keys] = TokenCount(keys)
        return fn(batch)


_PARTITIONS: dict[str, Callable[..., Any]] = {
    "balanced": balanced_partition,
    "karmarkar_karp": karmarkar_karp,
}


def _same_pipeline_everywhere(config: BalancerConfig, device: torch.device, pg: ProcessGroup | None,
                              problem: str | None) -> None:
    """Raise ``ValueError`` on every rank of ``pg`` unless all ask for the same pipeline and
    balancing and none has a ``problem`` of its own (raised by the caller on its rank; one
    all-reduce of three small integers, once). Past this point the shuffler checks its own
    settings; a rank built without it would never join its shuffles, and the ones with it
    would leave it waiting in TorchRec's collectives for good."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(pg) <= 1:
        return
    mine = (2 if config.pipeline == "prefetch" else 0) + int(config.enable_balanced_shuffler)
    on = collective_device(pg, prefer=device)  # NCCL: the training device, not whatever set_device left current
    rank = dist.get_rank(pg)
    t = torch.tensor([mine, -mine, rank + 1 if problem else 0], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    high, neg_low, bad = t.tolist()  # once, at construction: not a per-step read
    if bad and problem is None:
        raise ValueError(f"create_train_pipeline failed on rank {bad - 1} (see its error) (rank {rank})")
    if high != -neg_low and problem is None:
        raise ValueError(
            "create_train_pipeline: the ranks asked for different pipelines (pipeline and "
            "enable_balanced_shuffler must be the same on every rank; this rank: "
            f"pipeline={config.pipeline!r}, enable_balanced_shuffler={config.enable_balanced_shuffler}) "
            f"(rank {rank})")


def create_train_pipeline(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    config: BalancerConfig,
    workload_fn: WorkloadFn | None = None,
    pg: ProcessGroup | None = None,
    **pipeline_kwargs: Any,
) -> BalancedTrainPipelineSparseDist:
    """The TorchRec train pipeline ``config`` asks for, with or without balancing.

    Args:
        model: the ``DistributedModelParallel`` model.
        optimizer: the (combined) optimizer.
        device: the training device.
        config: which pipeline variant and whether/how to balance.
        workload_fn: per-sample cost ``batch -> int64[B]`` (``balancer.workloads``);
            ``None`` balances the token count over all features.
        pg: the data-parallel process group; ``None`` is the default group.
        **pipeline_kwargs: passed to the TorchRec pipeline constructor.

    Returns:
        A :class:`BalancedTrainPipelineSparseDist` (``pipeline="sparse_dist"``)
        or :class:`BalancedPrefetchTrainPipelineSparseDist` (``"prefetch"``).
        With ``enable_balanced_shuffler=False`` it uses an
        ``IdentityBatchShuffler`` and trains exactly like the TorchRec pipeline.

    Raises:
        ValueError: ``pipeline="prefetch"`` on a device without streams: TorchRec
            1.8's prefetch pipeline silently skips its prefetch stage there and
            then fails in the forward; on every rank of ``pg``, ranks that ask
            for different ``pipeline`` or ``enable_balanced_shuffler`` (one
            all-reduce at construction: call it on every rank).
    """
    problem = None
    if config.pipeline == "prefetch" and device.type not in ("cuda", "mtia"):
        problem = (f"BalancerConfig.pipeline='prefetch' needs a CUDA device, got device={device}; "
                   "use pipeline='sparse_dist'")
    _same_pipeline_everywhere(config, device, pg, problem)
    if problem is not None:
        raise ValueError(problem)
    shuffler: Shuffler
    if config.enable_balanced_shuffler:
        if workload_fn is None:
            logger.info("balancer: workload_fn=None, balancing TokenCount over all features")
            workload_fn = _AllFeaturesTokenCount()
        shuffler = BatchShuffler(
            workload_fn,
            comm=config.comm,
            partition=_PARTITIONS[config.partition],
            locality=config.locality,
            log_interval=config.log_interval,
            executor=config.executor,
            timeout=config.shuffle_timeout_s,
            capacity=config.capacity,
            calibrate=config.online_calibration,
            calibration_keys=config.calibration_keys,
            token_cap=config.token_cap,
            group_size=config.group_size,
        )
    else:
        shuffler = IdentityBatchShuffler()
    cls = (
        BalancedPrefetchTrainPipelineSparseDist
        if config.pipeline == "prefetch"
        else BalancedTrainPipelineSparseDist
    )
    return cls(model, optimizer, device, shuffler, pg=pg, **pipeline_kwargs)
