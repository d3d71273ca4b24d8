"""The producer thread of :class:`balancer.loader.BalancedLoader`: one shuffled batch per credit.

Runs on its own thread, in step with every rank of the group: takes this
rank's next batch (padded to the batch size, or an all-padding batch once the
wrapped loader is exhausted), shuffles it, decides whether the pass goes on,
and queues the result for the training thread. A failure on any rank is sent
through the shuffle so that every rank raises it. See the loader's module
docstring for the policies.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from balancer._padding import padding_like
from balancer._torchrec import batch_types
from balancer.shuffler import BatchShuffler, ShuffleStats
from balancer.tokens import TokenBatch

if TYPE_CHECKING:  # the token path runs without TorchRec (balancer._torchrec)
    from balancer.batch import BaseBatch

logger = logging.getLogger(__name__)

__all__ = ["Failed", "Item", "Run", "Template", "WrappedLoaderError", "Workloads", "produce"]


class Workloads:
    """The user's ``workload_fn`` as the shuffler sees it.

    ``__wrapped__`` makes the shuffler's cross-rank configuration check
    identify it by the user's function, not by this wrapper. ``report``: an
    exception the producer thread sets just before shuffling a carrier batch,
    to make this rank's phase 1 fail with it -- the shuffle then raises the
    same ``ValueError`` naming it on every rank.
    """

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.__wrapped__ = fn
        self.report: BaseException | None = None

    def __call__(self, batch: Any) -> Any:
        if self.report is not None:
            raise self.report
        return self.__wrapped__(batch)


class WrappedLoaderError(RuntimeError):
    """This rank's wrapped loader raised (or had no batch to take part with);
    every rank raises a ``ValueError`` naming it."""

    # Phase 1 reports it by its own message, not as the workload_fn's error
    # (the producer raises it from the workload_fn it hands the shuffler).
    own_message = True


@dataclasses.dataclass
class Template:
    """Per rank and pass, from the pass's first batch: the batch size (unless
    ``given``) and an all-padding batch."""

    given: int | None = None
    batch_size: int | None = None
    padding: BaseBatch | TokenBatch | None = None

    def reset(self) -> None:
        """Forget what the last pass learned: a pass then behaves the same after
        earlier passes as at the start of a resumed run."""
        self.batch_size, self.padding = self.given, None


@dataclasses.dataclass(frozen=True)
class Item:
    batch: BaseBatch | TokenBatch
    stats: ShuffleStats


@dataclasses.dataclass(frozen=True)
class Failed:
    error: BaseException


_DONE = object()


# At interpreter exit, producers get this long to finish the steps they have credit
# for. A loop left early without close() let the process exit while the daemon
# producer was inside a gloo collective: C++ aborted it ("terminate called without
# an active exception", SIGABRT), and the scheduler saw the job fail. Its peers run
# the same credited steps, so with healthy peers the wait is a step or two.
_EXIT_WAIT_S = 30.0
_RUNS: weakref.WeakSet[Run] = weakref.WeakSet()


def _finish_runs_at_exit() -> None:
    runs = list(_RUNS)
    for run in runs:
        run.stop()
    deadline = time.monotonic() + _EXIT_WAIT_S
    for run in runs:
        if run.thread is not None and run.thread.is_alive():
            run.done.wait(max(0.0, deadline - time.monotonic()))


# Registered after the shuffler's own exit hook (this module imports it), so it runs
# first: the producers' steps still have the shuffler's background thread.
atexit.register(_finish_runs_at_exit)


class Run:
    """One pass over the wrapped loader: the producer thread, its credits and queue.

    The producer runs one step per credit. The consumer grants one credit per
    ``next()`` on top of the initial ``ahead``, so on every rank that consumed
    the same number of batches the producer runs the same number of shuffles.
    Stopping keeps that symmetry: the producer finishes the steps it already
    has credit for (its peers run them too) and then exits, so no rank is left
    waiting in a collective its peers never join.
    """

    def __init__(self, ahead: int) -> None:
        self.cond = threading.Condition()
        self.credits = ahead
        self.stopping = False
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.done = threading.Event()  # the producer has returned
        self.owed = 0  # grants to absorb: credits of interrupted next() calls already in use
        _RUNS.add(self)

    def grant(self) -> None:
        with self.cond:
            if self.owed:
                self.owed -= 1  # a retried next(): its credit is the interrupted call's
                return
            self.credits += 1
            self.cond.notify()

    def revoke(self) -> None:
        """Take back the last :meth:`grant` (a ``next()`` interrupted before it got its batch:
        a peer stopped at the same count never grants it). If the producer already uses it
        (``ahead=0``: the step this ``next()`` waits for), the next grant is absorbed instead."""
        with self.cond:
            if self.credits > 0:
                self.credits -= 1
            else:
                self.owed += 1

    def take(self) -> bool:
        """Producer: wait for a credit; ``False`` once stopping with none left."""
        with self.cond:
            while self.credits == 0 and not self.stopping:
                self.cond.wait()
            if self.credits == 0:
                return False
            self.credits -= 1
            return True

    def stop(self) -> None:
        """Ask the producer to exit after its credited steps; never blocks (finalizers call it)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def join(self) -> None:
        """Stop and wait for the producer. Safe to call again after an interrupt (Ctrl-C):
        it waits on ``done``, not on ``Thread.join``, which once interrupted may return at
        once on the next call while the thread still runs (CPython 3.11)."""
        self.stop()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.done.wait()
            self.thread.join()


# ------------------------------------------------------------ producer
def _padded(batch: BaseBatch | TokenBatch, batch_size: int) -> BaseBatch | TokenBatch:
    if isinstance(batch, TokenBatch):
        return batch.pad(batch_size)
    from balancer.batch import pad_batch  # already loaded: batch is a BaseBatch

    return pad_batch(batch, batch_size)


def _carrier(template: Template) -> BaseBatch | TokenBatch:
    """A batch to report a failure with: the padding template if there is one."""
    if template.padding is not None:
        return padding_like(template.padding)
    # No batch seen yet: any batch carries the failure. A BaseBatch where TorchRec
    # is in use, else a token batch (the token path runs without TorchRec).
    nothing = torch.zeros(1, dtype=torch.int64)
    if batch_types() == (TokenBatch,):
        return TokenBatch(batch_size=1, seq_lens=nothing, tokens={"_": torch.zeros(1, 0, dtype=torch.int64)},
                          actual_batch_size=0)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from balancer.batch import BaseBatch

    empty = KeyedJaggedTensor(keys=["_"], values=torch.zeros(0, dtype=torch.int64), lengths=nothing)
    return BaseBatch(features=empty, batch_size=1, feature_to_max_seqlen={}, actual_batch_size=0)


def _fit(batch: Any, template: Template, step: int) -> Any:
    """``batch`` padded to the batch size; the pass's first batch sets the template.
    Another type goes to the shuffle as it is, which reports it on every rank.

    Raises:
        WrappedLoaderError: ``batch`` is larger than the batch size (given, or
            the first batch's). Every rank's batches would be that large, so
            the shuffle alone would not see it.
    """
    if not isinstance(batch, batch_types()):
        return batch
    if template.batch_size is None:
        template.batch_size = batch.batch_size
    if batch.batch_size > template.batch_size:
        raise WrappedLoaderError(
            f"the wrapped loader yielded a batch of batch_size={batch.batch_size} at step {step}, more than "
            f"BalancedLoader's batch_size={template.batch_size} (given, or the pass's first batch's); pass "
            "batch_size >= the loader's largest batch")
    if batch.batch_size < template.batch_size:
        batch = _padded(batch, template.batch_size)
    if template.padding is None and batch.batch_size == template.batch_size:
        template.padding = padding_like(batch)
    return batch


def produce(run: Run, source: Iterator[Any], skip: int, shuffler: BatchShuffler, workloads: Workloads,
             template: Template, group: Any, world: int, pin: bool, device: int | None = None) -> None:
    """The producer thread: one shuffled batch per credit, in step with every rank.

    ``device``: the CUDA device current on the thread that started the pass; made
    current here too (the wrapped loader's and workload_fn's ``.cuda()``, pinning)."""
    try:
        if device is not None:
            torch.cuda.set_device(device)
        exhausted, failure = False, None
        for step in range(skip):  # fast-forward (resume): one draw per consumed step
            _, exhausted, failure = _take(source, template, exhausted, step)
            if exhausted or failure is not None:
                break
        step = skip
        while run.take():
            if failure is None:
                batch, exhausted, failure = _take(source, template, exhausted, step)
            if world == 1 and exhausted and failure is None:
                break  # the end of the pass (a pass with no batch at all fails, as on many ranks)
            if failure is not None:  # every rank raises it (this one too)
                run.items.put(Failed(_report(shuffler, workloads, _carrier(template), failure, group)))
                break
            handle = shuffler.start_shuffle_async(batch, group, exhausted=exhausted)
            out = shuffler.finish_shuffle(batch, handle, group)
            if world > 1 and all(handle.stats.world_exhausted):
                logger.debug("BalancedLoader: every rank was exhausted at step %d: the pass ends", step)
                break
            run.items.put(Item(out.pin_memory() if pin else out, handle.stats))
            step += 1
    except BaseException as e:  # noqa: BLE001 - raised by the consumer's next()
        run.items.put(Failed(e))
    finally:
        run.items.put(_DONE)
        run.done.set()


def _take(source: Iterator[Any], template: Template, exhausted: bool,
          step: int) -> tuple[Any, bool, WrappedLoaderError | None]:
    """This rank's input of ``step``: ``(batch, exhausted, failure)``; never raises
    (a failure is reported through the shuffle, so that every rank raises it)."""
    if not exhausted:
        try:
            return _fit(next(source), template, step), False, None
        except StopIteration:
            exhausted = True
        except WrappedLoaderError as e:
            return None, False, e
        except BaseException as e:  # noqa: BLE001 - sent to every rank through the shuffle
            # Not only Exception: a rank that left on a KeyboardInterrupt or a
            # CancelledError without taking part in this step's shuffle would
            # leave its shuffle numbers one behind its peers', and its next
            # pass would pair with their pending steps (mixing epochs, unseen).
            failure = WrappedLoaderError(f"the wrapped loader raised {type(e).__name__} at step {step}: {e}")
            failure.__cause__ = e
            return None, False, failure
    if template.padding is None:
        return None, True, WrappedLoaderError(
            f"the wrapped loader yielded no batch before step {step}, so this rank has no layout to take "
            "part with; every rank's loader must yield at least one batch in a pass")
    return padding_like(template.padding), True, None


def _report(shuffler: BatchShuffler, workloads: Workloads, carrier: BaseBatch | TokenBatch,
            failure: WrappedLoaderError, group: Any) -> BaseException:
    """Take part in this step with ``failure``: every rank's shuffle raises a
    ``ValueError`` naming it (here chained from it).

    Returns:
        What this rank raises: that ``ValueError``; or the loader's own
        exception when it is no ``Exception`` (``KeyboardInterrupt``,
        ``SystemExit``, ``asyncio.CancelledError``): the peers learnt of it
        through the shuffle, and here it must still interrupt, exit or cancel.
    """
    workloads.report = failure
    try:
        shuffler.shuffle(carrier, group)
        error: BaseException = failure  # only without peers (one rank): the shuffle did not raise
    except BaseException as e:  # noqa: BLE001 - raised by the consumer's next()
        error = e
    finally:
        workloads.report = None
    original = failure.__cause__
    return original if original is not None and not isinstance(original, Exception) else error
