"""`BatchShuffler`: move samples between data-parallel ranks to equalise work.

Per step, on every rank of the group (each step is a collective):

1. ``start_shuffle_async(batch)`` (phase 1, calling thread): checks shapes and
   dtypes, computes the per-sample workloads and packs them with the KJT
   lengths using device ops only (on CUDA: copied to pinned memory without
   blocking, with an event), then queues the background work and returns a
   :class:`ShuffleHandle`. It never waits for the device or for a peer.
2. Background thread (one per shuffler; jobs in start order): waits for the
   event, all-gathers every rank's metadata over the shuffler's own gloo group
   (with ``group_size``: every rank's header and load, then the metadata of
   its group, :mod:`balancer._groups`), decides (the same verdict on every
   rank), partitions in a torch-free child process, and plans phase 2 down to
   every byte (:mod:`balancer._exchange`).
3. ``finish_shuffle(batch, handle)`` (phase 2, calling thread): waits for the
   background work, then one collective moves one flat buffer
   (``"all2all"``: each sample to its new rank; ``"allgather"``: every batch
   everywhere) and one gather per tensor builds the output. Each rank gets
   exactly ``batch_size`` samples: its real samples in ascending global order,
   then padding. No device value is read, so nothing waits for the device.

``shuffle(batch)`` is ``finish_shuffle(batch, start_shuffle_async(batch))``.

This module orchestrates; the parts live in their own modules: handles and
their bookkeeping (``_handle``), this rank's phase-1 message (``_protocol``),
the verdict (``_agreement``), the plan (``_step``, in the planner process of
:class:`~balancer.partition.PartitionWorker`), the collectives (``_comm``) and
online calibration (``_calibrate``). docs/design.md walks the data path.

Failures. Bad input on one rank (batch size, layout, workloads, config, shuffle
order) is reported in phase 1's message, so every rank raises the same
``ValueError`` from ``finish_shuffle``, naming the field, each rank's value and
the offending ranks, before any phase-2 collective; the shuffler stays usable.
A peer that does not take part within ``timeout`` makes every waiting rank
raise :class:`~balancer.errors.ShuffleAbortedError` naming the phase and the
missing ranks; the shuffler is then closed. That holds on the shuffler's own
gloo groups (phase 1; phase 2 of CPU batches): phase 2 of CUDA batches runs on
the caller's NCCL group, whose own timeout and watchdog apply there
(docs/design.md, section 6).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function

from balancer import _comm
from balancer._agreement import Agreement, Report, Verdict, decide, describe_failure
from balancer._calibrate import CalibrationState
from balancer._comm import ShuffleGroups
from balancer._destinations import PartitionFn
from balancer._exchange import Traffic
from balancer._gather import host_tensors
from balancer._groups import form_groups, members_of, widen_splits
from balancer._handle import BatchT, Outcome, ShuffleHandle, ShufflerBase
from balancer._header import H_DONE, H_REAL, HEADER_LEN
from balancer._ints import as_count, is_int
from balancer._layout import WireLayout, fingerprint
from balancer._protocol import (
    NO_PREV,
    LocalMeta,
    bad_input,
    batch_mismatch,
    capture,
    exhausted_problem,
    layout_description,
    message,
    reraise,
    stay_length,
)
from balancer._stats import ShuffleStats, build_stats
from balancer._step import Step, plan_step
from balancer._torchrec import BATCH_TYPES, batch_types
from balancer._trust import replace_unchecked, trusted
from balancer._version import __version__
from balancer.config import (
    COMMS,
    EXECUTORS,
    check_bool,
    check_choice,
    check_executor,
    check_group_size,
    check_interval,
    check_timeout,
    check_token_cap,
    identity,
)
from balancer.errors import ShuffleAbortedError
from balancer.partition import (
    PartitionWorker,
    balanced_partition,
    karmarkar_karp,
    localize,
    lower_bound,
)
from balancer.tokens import TokenBatch, fill_padding, pad_value, padding_positions

logger = logging.getLogger(__name__)

__all__ = ["BatchShuffler", "IdentityBatchShuffler", "ShuffleHandle", "ShuffleStats"]

# Partition functions that are deterministic by construction: their plans are
# not re-checked across ranks before phase 2 (the digest still travels with
# the next shuffle's message).
_TRUSTED = (balanced_partition, karmarkar_karp)


# How long a rank whose group setup failed waits for its peers to say they got there too
# (the ranks that never do are named in the error).
_SETUP_GRACE_S = 5.0
# ... and at least this long (after a timeout of 1e-4 s the ranks looked for each
# other's reports for 50 us, and told different stories)
_MIN_GRACE_S = 1.0
_CLOSED_WHILE_PLANNED = "BatchShuffler was closed while this shuffle was planned"
_INSTANCES = itertools.count()


class BatchShuffler(ShufflerBase):
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
        workload_fn: ``batch -> [batch_size]`` per-sample cost, integer or
            floating, in any unit and scale (only ratios matter; see
            :mod:`balancer._quantize`); only real samples' costs are used.
        comm: ``"all2all"`` sends each sample that changes rank once (least
            traffic); ``"allgather"`` gathers every rank's batch everywhere and
            selects locally.
        partition: ``(workloads [N], num_parts) -> parts``, each part exactly
            ``N / num_parts`` global indices; default
            :func:`balancer.partition.balanced_partition`. Custom functions
            must be deterministic; their plans are compared across ranks before
            phase 2 (one small extra all-gather in the background).
        locality: refine the partition with :func:`balancer.partition.localize`
            so samples stay on their rank where that costs no balance (less
            traffic); ``False``: rank r gets part r as the partitioner returns it.
        log_interval: log :class:`ShuffleStats` on rank 0 every
            ``log_interval`` shuffles; 0: never.
        executor: where ``balanced_partition`` runs. ``"auto"`` (default):
            ``"process"`` for ``balanced_partition``, else ``"thread"``.
            ``"process"``: a torch-free child process, so it never competes
            with the training loop for the GIL. ``"thread"``: the shuffler's
            background thread (any ``partition``).
        timeout: seconds a collective of the shuffler's own groups waits for
            its peers before every waiting rank raises
            :class:`~balancer.errors.ShuffleAbortedError`; keep it above the
            longest time one rank may spend elsewhere between two shuffles
            (a checkpoint, an evaluation).
        capacity: ``None`` (default): every rank keeps exactly ``batch_size``
            samples. An int ``>= batch_size``: token-budget mode -- ranks
            receive different numbers of samples, at most ``capacity`` each
            (:func:`balancer.partition.free_partition`), so a few huge samples
            no longer pin a rank at equal counts; every output has
            ``batch_size == capacity`` (real samples first, then padding).
            Normalise the loss globally (:func:`balancer.global_mean_loss` or
            ``global_weighted_mean_loss`` per token).
        calibrate: online calibration. Report each rank's measured compute
            time with :meth:`record_compute`; every rank fits the same
            per-sample model ``alpha * w + beta * L**2 + gamma * L + delta``
            (``w``: ``workload_fn``'s cost, ``L``: the sample's total length)
            to those times, and later partitions use it once 16 (rank, shuffle)
            measurements exist (see :mod:`balancer._calibrate`). The model in
            use is ``handle.stats.calibration``.
        calibration_keys: the KJT keys whose lengths add up to a sample's
            length ``L`` in the fit (the sequence the model attends over);
            ``None``: every key of every KJT field. A ``TokenBatch`` uses
            ``seq_lens``.
        token_cap: balance compute and memory at once: no rank receives more
            than ``token_cap`` times the mean tokens per rank (a sample's
            tokens: its elements over every key of every KJT field, labels included, or its ``seq_lens``), or
            the proven minimum if that is higher, with compute balanced under
            the cap. ``None`` (default): compute only (tokens then end around
            1.05x the mean, up to 1.14x, on Zipf lengths). Compute quality is
            unchanged down to about 1.05 up to W = 256; tighter caps cost some
            compute balance and partition time; at W = 256-1,024 the capped
            partition takes 0.1-0.6 s (about 1 s where both of its starts
            run), with compute 3e-3 to 1.4e-2 above its bound at 1.01-1.02x
            (``docs/benchmarks_partition.md``).
            ``handle.stats.token_imbalance_after`` shows the result. Needs the
            default ``partition`` and ``capacity=None``.
        group_size: ``None`` (default): balance over all W ranks. An int
            ``G >= 2``: for large jobs, balance within groups of at most G
            ranks, re-formed every shuffle so that each mixes heavy and light
            ranks (:mod:`balancer._groups`). Phase 1 then gathers every rank's
            header and load (``W * 160`` bytes) and the per-sample metadata of
            the group only, and partitions ``G * B`` samples instead of
            ``W * B``, for some balance (a heavy group cannot give work to a
            light one). ``handle.stats`` then describes this rank's group
            (``stats.group``). Needs ``comm="all2all"``, the default
            ``partition``, and no ``capacity``, ``calibrate`` or ``token_cap``.
            Has no effect when ``W <= G``.

    Raises:
        ValueError: on an invalid setting, naming the value and the expectation.
    """

    def __init__(self, workload_fn: Callable[[Any], Any], *,
                 comm: str = "all2all",
                 partition: PartitionFn = balanced_partition, locality: bool = True,
                 log_interval: int = 0, executor: str = "auto", timeout: float = 300.0,
                 capacity: int | None = None, calibrate: bool = False,
                 calibration_keys: Sequence[str] | None = None, token_cap: float | None = None,
                 group_size: int | None = None) -> None:
        if not callable(workload_fn):
            raise ValueError(f"workload_fn={workload_fn!r}, expected a callable batch -> [batch_size]")
        me = type(self).__name__
        check_choice(me, "comm", comm, COMMS)
        if not callable(partition):
            raise ValueError(f"{me}: partition={partition!r}, expected a callable (workloads, num_parts) -> parts")
        check_bool(me, "locality", locality)
        check_interval(me, "log_interval", log_interval)
        check_choice(me, "executor", executor, EXECUTORS)
        check_timeout(me, "timeout", timeout)
        check_bool(me, "calibrate", calibrate)
        if capacity is not None:
            if not is_int(capacity, 1):
                raise ValueError(f"{me}: capacity={capacity!r}, expected None or an int >= batch_size")
            if partition is not balanced_partition:
                raise ValueError(f"{me}: capacity={capacity} partitions with free_partition; "
                                 f"partition={getattr(partition, '__name__', partition)!r} makes equal parts")
        check_token_cap(me, token_cap, default_partition=partition is balanced_partition,
                        needs="the default partition (balanced_partition)",
                        partition=getattr(partition, "__name__", partition), capacity=capacity)
        check_group_size(me, group_size, comm=comm, default_partition=partition is balanced_partition,
                         partition=getattr(partition, "__name__", partition), capacity=capacity,
                         calibrate=calibrate, token_cap=token_cap)
        if executor == "auto":
            executor = "process" if partition is balanced_partition else "thread"
        check_executor(me, executor, default_partition=partition is balanced_partition,
                       partition=getattr(partition, "__name__", partition))
        super().__init__(workload_fn, log_interval)
        self.comm, self.partition, self.locality, self.executor = comm, partition, locality, executor
        self.timeout = float(timeout)
        self.capacity = capacity
        self.token_cap = None if token_cap is None else float(token_cap)
        self.calibrate = calibrate
        self.group_size = group_size
        keys = calibration_keys
        if keys is not None and not isinstance(keys, (str, set, frozenset)):
            with contextlib.suppress(TypeError):  # an iterator is read once, here, not by the check
                keys = tuple(keys)
        # A set's order (and repr) differs between processes: not the same on every rank.
        if keys is not None and (not isinstance(keys, tuple) or not keys or not all(isinstance(k, str) for k in keys)):
            raise ValueError(f"{me}: calibration_keys={calibration_keys!r}, expected None or a non-empty "
                             "sequence of str")
        if keys is not None and not calibrate:
            # They were checked against the batch's keys on every multi-rank shuffle all
            # the same, while one rank never checked them: refused here, at any W.
            raise ValueError(f"{me}: calibration_keys={keys!r} name the features online calibration measures "
                             "L from; they need calibrate=True")
        self.calibration_keys = keys
        self._config = {"comm": comm, "locality": str(locality), "partition": identity(partition),
                        "workload_fn": identity(workload_fn), "capacity": str(capacity),
                        "calibrate": str(calibrate), "calibration_keys": str(self.calibration_keys),
                        "token_cap": repr(self.token_cap), "group_size": str(group_size),
                        "balancer": __version__}
        self._calibration = CalibrationState()
        self._config_fp = fingerprint(self._config)
        # This process's shuffler count: ranks that build their shufflers in the same order
        # agree on it, which keeps one shuffler's setup diagnosis apart from another's.
        self._instance = next(_INSTANCES)
        self._verify = not any(partition is p for p in _TRUSTED)
        self._groups: dict[int, ShuffleGroups] = {}
        self._setup_error: ShuffleAbortedError | None = None  # the groups' creation timed out
        # Phase 2 always on the shuffler's own gloo group, device batches too (BalancedLoader
        # shuffles on its own thread: a collective there on the caller's NCCL group could be
        # paired with the training thread's on that group).
        self._own_phase2 = False
        self._agreed: dict[str, Agreement] = {}  # background thread only
        # Background thread only: (seq, plan digest, lowest rank of the planning group or -1).
        self._prev: dict[str, tuple[int, int, int]] = {}
        self._worker: PartitionWorker | None = None
        self._worker_lock = threading.Lock()  # close() against a job starting a child

    def connect(self, pg: dist.ProcessGroup | None = None) -> None:
        """Create the shuffler's two gloo groups over ``pg`` now (otherwise the
        first multi-rank ``start_shuffle_async`` does). Every rank of ``pg``
        calls it at the same point of its program; call it from the thread that
        creates your other process groups when shuffles will run elsewhere
        (e.g. in a data-loading thread). A no-op without torch.distributed or
        with one rank.

        Raises:
            ShuffleAbortedError: a peer did not connect within ``timeout``; the
                shuffler is closed.
        """
        self._check_open()
        group, w, _ = _comm.resolve_group(pg)
        if w > 1:
            self._groups_for(group)

    def record_compute(self, handle: ShuffleHandle, seconds: float | None = None, *,
                       events: Sequence[tuple[Any, Any]] = ()) -> None:
        """Report how long this rank computed on ``handle``'s output (online calibration).

        Give ``seconds`` (e.g. from a monotonic clock around forward and
        backward), or ``events``: ``(start, end)`` pairs of CUDA events with
        ``enable_timing=True`` recorded around the compute; their elapsed time
        is read once the events have completed, never waiting for them. The
        latest report travels with the next shuffle's metadata. A no-op
        without ``calibrate``.

        A bad report (``seconds`` not a finite number > 0; ``events`` not
        an iterable of ``(start, end)`` pairs of events, objects with
        ``query`` and ``elapsed_time``, or events that cannot be timed once
        read: never recorded, made without ``enable_timing``) fails the next
        shuffle on every rank with a ``ValueError`` naming this rank, even if a
        good report follows it, and is dropped: raised here, on this rank
        alone, it would leave the peers waiting in that shuffle's phase 1 for
        the timeout.

        Raises:
            ValueError: ``handle`` is not finished by this shuffler.
        """
        if not self.calibrate:
            return
        if not isinstance(handle, ShuffleHandle) or handle._owner is not self._token or not handle._state.finished:
            raise ValueError(f"record_compute: {handle!r} is not a finished handle of this shuffler")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not 0 < seconds < float("inf")):
            self._calibration.refuse(f"record_compute: seconds={seconds!r}, expected a finite number > 0")
        elif seconds is not None:
            self._calibration.report(handle.seq, seconds, ())
        elif (pairs := _event_pairs(events)) is None:
            self._calibration.refuse(f"record_compute: events={events!r}, expected (start, end) pairs of timing "
                                     "events (torch.cuda.Event(enable_timing=True), recorded around the compute)")
        else:
            self._calibration.report(handle.seq, None, pairs)

    # ------------------------------------------------------------- phases
    def start_shuffle_async(self, batch: Any, pg: dist.ProcessGroup | None = None, *,
                            exhausted: bool = False) -> ShuffleHandle:
        """Phase 1: capture this rank's metadata and queue the background work.

        Never waits for the device or for other ranks. Problems with the input
        are reported by ``finish_shuffle`` on every rank.

        Args:
            batch: this rank's :class:`BaseBatch` (on the CPU -- e.g. before its
                copy to the device -- or on the device).
            pg: process group; ``None`` is the default group (resolved now).
            exhausted: this rank's data has run out and ``batch`` holds no real
                sample (``padding_like``): it takes part so that its peers'
                samples can still be spread. Every rank reads every rank's flag
                from ``ShuffleStats.world_exhausted`` (no extra collective): a
                pass ends together where all are true. A real sample with
                ``exhausted=True`` is invalid input (``ValueError`` on every rank).

        Raises:
            RuntimeError: the shuffler is closed.
            ValueError: this process is not a member of ``pg``. (An
                ``exhausted`` that is not a bool is bad input like any other:
                ``finish_shuffle`` raises it on every rank.)
        """
        self._check_open()
        group, w, rank = _comm.resolve_group(pg)
        flag = _exhausted_problem(exhausted, rank)
        t0 = perf_counter()
        with record_function("## balancer.shuffle.phase1 ##"):
            meta = capture(batch, self._workload_fn, seq=self._next_seq, rank=rank, config=self._config_fp,
                           base_type=batch_types(), expected=BATCH_TYPES,
                           exhausted=not flag and bool(exhausted))
            # Raised here, on this rank alone, either would leave its peers in phase 1:
            if flag:
                bad_input(meta, flag, TypeError(flag))
            try:
                meta.measured = self._calibration.latest()
            except ValueError as e:
                bad_input(meta, f"{e} (rank {rank})", e)
            if w == 1:
                job = self._pool().submit(self._local_job, meta, "identity")
            else:
                try:
                    groups = self._groups_for(group)
                except ShuffleAbortedError as e:  # reported by finish_shuffle, as a stalled peer's always is
                    job = self._pool().submit(_raise, e)
                else:
                    job = self._pool().submit(self._job, meta, groups)
        return self._register(ShuffleHandle(self._next_seq, w, rank, perf_counter() - t0, self._token, job, meta))

    def finish_shuffle(self, batch: BatchT, handle: ShuffleHandle, pg: dist.ProcessGroup | None = None) -> BatchT:
        """Phase 2: wait for the background work and redistribute.

        Args:
            batch: the batch given to ``start_shuffle_async``, or its copy on
                another device (same layout and real-sample count).
            handle: its handle; each handle finishes once, in start order.
            pg: the process group of the start.

        Returns:
            A batch of the same type and ``batch_size``: the real samples this
            rank was assigned (ascending global index), then padding;
            ``actual_batch_size`` is their count. When no sample moves anywhere,
            ``batch`` itself; a padded ``TokenBatch`` with new token tensors,
            cut or padded to its longest sample rounded up to ``pad_multiple``
            and its padding positions set to ``pad_values``, as a shuffle gives.

        Raises:
            ValueError: on every rank, when any rank's input or configuration
                was invalid or differed (names the field, each rank's value and
                the offending ranks); the shuffler stays usable. Where this
                rank's ``workload_fn`` or partition raised, chained from that
                error; where that was no ``Exception`` (``KeyboardInterrupt``,
                ``SystemExit``), this rank raises it as itself instead, and the
                peers the ``ValueError`` at once.
            ShuffleAbortedError: peers did not take part within ``timeout``;
                names the phase and the missing ranks; the shuffler is closed.
            RuntimeError: out-of-order or repeated finish, foreign handle, or a
                closed shuffler (on every rank alike).
            ValueError: ``batch`` is not the batch that was started (another
                layout or real-sample count) -- a programming error raised on
                this rank only, before the handle is used up (the other ranks
                then wait in phase 2 until ``timeout``; on NCCL they have
                enqueued the exchange: retry with the right batch before any
                other collective on that group).
        """
        self._claim(handle, mark=False)
        t0 = perf_counter()
        with record_function("## balancer.shuffle.phase2 ##"):
            group, w, rank = _comm.resolve_group(pg)
            if handle.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(f"finish_shuffle: the process group was destroyed while shuffle #{handle.seq} "
                                   f"(W={handle.world_size}) was in flight; finish or close the shuffler first")
            if (w, rank) != (handle.world_size, handle.rank):
                raise ValueError(f"finish_shuffle: group has W={w}, rank {rank}; handle "
                                 f"#{handle.seq} was started with W={handle.world_size}, rank {handle.rank}")
            mismatch = batch_mismatch(batch, handle._meta, batch_types(), BATCH_TYPES)
            if mismatch:
                raise ValueError(f"finish_shuffle: {mismatch}; it is not the batch handle #{handle.seq} "
                                 "was started with")
            if w == 1 and self.capacity is not None and self.capacity < getattr(batch, "batch_size", 0):
                # (with peers the background job raises this on every rank)
                raise ValueError(f"BatchShuffler: capacity={self.capacity}, expected >= batch_size="
                                 f"{batch.batch_size} (every rank's real samples must fit)")
            # Rank-local checks passed: only now is the handle used up, so a
            # caller that passed the wrong batch can retry with the right one.
            self._claim(handle)
            t_wait = perf_counter()
            # (interrupted while waiting, the handle can finish again: _wait)
            outcome = self._wait(handle, self.timeout + 60.0)
            wait_s = perf_counter() - t_wait
            collective_s = 0.0
            out: Any = batch if self.capacity is None else _padded(batch, self.capacity)
            if outcome.exchange is None:
                out = _canonical_length(out, outcome.length)
            if outcome.exchange is not None or outcome.join:
                groups = self._groups_for(group)
                target = groups.data if self._own_phase2 else groups.phase2_group(batch.device)
                t_phase2 = perf_counter()
                try:
                    if outcome.exchange is None:
                        collective_s = _comm.take_part(batch.device, w, target)
                    else:
                        assert outcome.layout is not None and outcome.blob is not None, "an exchange is planned"
                        out, collective_s = _comm.execute(batch, outcome.layout, outcome.exchange, outcome.blob,
                                                          target, replace_unchecked)
                except BaseException as e:
                    if target is groups.user:
                        self._out_of_step(e, handle.seq, rank)
                        raise
                    if not isinstance(e, RuntimeError):
                        raise
                    self._abort(e, groups, handle.seq, "phase 2", perf_counter() - t_phase2)
        stats = dataclasses.replace(outcome.stats, phase1_s=handle.phase1_s, phase2_s=perf_counter() - t0,
                                    wait_s=wait_s, collective_s=collective_s)
        self._done(handle, stats)
        return out  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop the partition child and the background thread. The shuffler's two
        gloo groups stay with the process group (see :mod:`balancer._comm`):
        create one shuffler per data-parallel group and keep it."""
        # The child first: a background job reading its reply (a wedged child)
        # then fails at once, instead of holding close() for good.
        with self._worker_lock:
            self._closed = True  # no job starts a child after this
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()
        super().close()
        self._groups.clear()

    # ------------------------------------------------------- background work
    def _job(self, meta: LocalMeta, groups: ShuffleGroups) -> Outcome:
        if self._broken is not None:
            raise RuntimeError(f"BatchShuffler is closed after an aborted shuffle: {self._broken}")
        t0 = perf_counter()
        with record_function("## balancer.shuffle.background ##"):
            key = groups.name
            agreed = self._agreed.get(key)
            members = None  # the ranks of this rank's group (group_size), ascending
            # with members: every rank's load, real count and exhausted flag (from the headers)
            job: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
            if self.group_size is not None and groups.world_size > self.group_size:
                rows, agreed, members, job = self._gather_in_group(meta, groups, agreed)
            else:
                for _ in range(2):
                    msg, data = message(meta, agreed, self._prev.get(key, NO_PREV))
                    rows = self._collective(groups, meta.seq, "phase 1", _comm.gather_rows, msg, groups)
                    verdict = decide(rows[:, :HEADER_LEN], agreed)
                    if verdict.kind == "ok":
                        break
                    if verdict.kind == "error":
                        self._fail(verdict, rows[:, :HEADER_LEN], meta, groups)
                    agreed = self._agreed[key] = verdict.agreement  # type: ignore[assignment]
                else:
                    raise AssertionError("phase-1 agreement did not settle in two rounds")
            assert agreed is not None and meta.layout is not None, "an ok verdict follows an agreement"
            if self.capacity is not None and self.capacity < agreed.batch_size:
                raise ValueError(f"BatchShuffler: capacity={self.capacity}, expected >= batch_size="
                                 f"{agreed.batch_size} (every rank's real samples must fit)")
            fit = self._calibration.update(key, rows, meta.seq) if self.calibrate else None
            me = groups.rank if members is None else int(np.searchsorted(members, groups.rank))
            kwargs: dict[str, Any] = dict(
                rows=rows, layout=meta.layout.plan_layout(), seq=meta.seq, rank=me, comm=self.comm,
                locality=self.locality, capacity=self.capacity, cost_model=self._calibration.model(key),
                length_rows=self._length_rows(meta.layout) if self.calibrate else None, token_cap=self.token_cap)
            if self.executor == "process":
                step = self._planned(kwargs)
            else:
                # The default partition runs as in the planner process (fn=None), so
                # both executors give the same plans and token_cap applies to both.
                fn = None if self.partition is balanced_partition else self.partition
                try:
                    step = plan_step(**kwargs, fn=fn, localize=localize, lower_bound=lower_bound)
                except BaseException:  # noqa: BLE001 - re-raised below; SystemExit too
                    if not self._verify:
                        raise
                    # A user's partition that raised on some ranks only: the others
                    # would wait in the digest exchange until the timeout. They learn
                    # of it there (ValueError); this rank raises its own error.
                    self._check_plans(groups, meta.seq, None)
                    raise
                if self._verify:
                    self._check_plans(groups, meta.seq, step.digest)
            self._prev[key] = (meta.seq, step.digest, -1 if members is None else int(members[0]))
            if fit is not None:
                fit.record(meta.seq, step.features)
            ex, stats, dest = step.exchange, step.stats, step.dest
            if members is not None:
                # The group planned among its members; phase 2 runs on all W
                # ranks, with nothing sent outside the group.
                w = groups.world_size
                if ex is not None:
                    ex = dataclasses.replace(ex, send_splits=widen_splits(ex.send_splits, members, w),
                                             recv_splits=widen_splits(ex.recv_splits, members, w))
                assert job is not None, "gathered with the members"
                stats = dataclasses.replace(stats, world_size=w, rank=groups.rank, group=members.tolist(),
                                            world_load_before=job[0].tolist(), world_real_before=job[1].tolist(),
                                            world_exhausted=(job[2] != 0).tolist())
                dest = members[dest]
            # Pinned for a non_blocking upload where phase 2 may run on CUDA (the
            # pipeline plans on the host batch and exchanges its device copy): not
            # before this process uses CUDA, where pinning would create a CUDA
            # context (on device 0, from this thread) for CPU batches on a GPU host.
            blob = host_tensors(ex.blob, pin=torch.cuda.is_initialized()) if ex is not None else None
            stats = dataclasses.replace(stats, background_s=perf_counter() - t0)
            return Outcome(ex, blob, meta.layout, stats, dest, join=members is not None,
                           length=stay_length(meta) if ex is None else 0)

    def _gather_in_group(self, meta: LocalMeta, groups: ShuffleGroups,
                         agreed: Agreement | None
                         ) -> tuple[np.ndarray, Agreement, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Phase 1 with ``group_size``: every rank's header and load, the verdict,
        the groups, then the full messages within this rank's group.

        Returns:
            The group's messages ``[G, len]`` (row i from ``members[i]``), the
            agreement, the members (ascending), and every rank's load
            (float64 ``[W]``), real samples and exhausted flag (int64 ``[W]``)
            from the headers.
        """
        key = groups.name
        prev = self._prev.get(key, NO_PREV)
        msg, data = message(meta, agreed, prev)
        total = float(data.workloads.sum()) if data is not None else 0.0
        head = np.append(msg[:HEADER_LEN], np.array([total], np.float64).view(np.int64))
        heads = self._collective(groups, meta.seq, "phase 1", _comm.gather_rows, head, groups)
        verdict = decide(heads[:, :HEADER_LEN], agreed)
        if verdict.kind == "error":
            self._fail(verdict, heads[:, :HEADER_LEN], meta, groups)
        assert verdict.agreement is not None, "ok and retry verdicts carry the agreement"
        if verdict.agreement != agreed:
            # Every rank moved to the same schema: size the group's messages by it.
            agreed = self._agreed[key] = verdict.agreement
            msg, _ = message(meta, agreed, prev)
        assert self.group_size is not None, "only called with group_size"
        loads = heads[:, HEADER_LEN].copy().view(np.float64)
        members = members_of(form_groups(loads, self.group_size), groups.rank)
        rows = self._collective(groups, meta.seq, "phase 1", _comm.gather_group, msg, members, groups)
        return rows, agreed, members, (loads, heads[:, H_REAL].copy(), heads[:, H_DONE].copy())

    def _length_rows(self, layout: WireLayout) -> tuple[int, ...] | None:
        """Rows of the lengths matrix that make up L for calibration (None: all)."""
        if self.calibration_keys is None or layout.is_tokens:
            return None
        rows = {key: k.row + i for k in layout.kjts for i, key in enumerate(k.keys)}
        missing = [key for key in self.calibration_keys if key not in rows]
        if missing:
            raise ValueError(f"BatchShuffler: calibration_keys {missing} are not keys of the batch's KJT fields "
                             f"(keys: {sorted(rows)})")
        return tuple(rows[key] for key in self.calibration_keys)

    def _planned(self, kwargs: dict[str, Any]) -> Step:
        """The step from the planner process; if it died (killed, out of memory),
        the same :func:`plan_step` here, which every other rank's planner also runs."""
        child = self._child()
        if child is None:  # closed meanwhile: no plan (nobody reads it; planning here holds the GIL)
            raise RuntimeError(_CLOSED_WHILE_PLANNED)
        try:
            return child.submit_call(plan_step, **kwargs).wait_call()  # type: ignore[no-any-return]
        except (EOFError, OSError, RuntimeError) as e:
            if self._closed:  # close() killed the child on purpose
                raise RuntimeError(_CLOSED_WHILE_PLANNED) from None
            if isinstance(e, RuntimeError):  # the planner's own error, not its death
                raise
            logger.warning("balancer: the planner process failed (%s); planning in-process", e)
            return plan_step(**kwargs)

    def _collective(self, groups: ShuffleGroups, seq: int, phase: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = perf_counter()
        try:
            return fn(*args)
        except RuntimeError as e:  # gloo timeouts and lost peers raise (DistBackendError is one)
            self._abort(e, groups, seq, phase, perf_counter() - t0)

    def _out_of_step(self, error: BaseException, seq: int, rank: int) -> None:
        """Phase 2 failed on this rank around its collective on the caller's group (NCCL:
        no timeout of ours applies there). The peers may have issued theirs, so that group
        is out of step: a later collective on it would be paired with theirs. The shuffler
        is closed, and ``error`` (raised as itself: an out-of-memory handler still sees
        its type) says why the process should end."""
        note = (f"BatchShuffler: phase 2 of shuffle #{seq} failed on rank {rank} around its collective on "
                f"the caller's process group; the other ranks may have issued theirs, so that group is out "
                f"of step (its next collective would be paired with theirs) and they wait until its own "
                f"timeout: end this process. The shuffler is closed")
        self._broken = RuntimeError(f"{note}: {type(error).__name__}: {error}")
        logger.error("%s: %s: %s", note, type(error).__name__, error)
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(note)

    def _abort(self, cause: BaseException, groups: ShuffleGroups, seq: int, phase: str,
               waited: float | None = None) -> None:
        """Raise the :class:`ShuffleAbortedError` of a failed collective (``waited``: seconds
        in it), naming the ranks that never reported (see :func:`_comm.missing_ranks`)."""
        grace = min(5.0, max(self.timeout / 2, _MIN_GRACE_S))
        missing = _comm.missing_ranks(groups, seq, phase, grace)
        if missing and waited is not None and waited < self.timeout / 2:
            # Not a timeout: the collective failed early (a peer died or left, or this
            # rank's own error), and "within the timeout of 300 s" after 0.6 s misled.
            who = (f"the collective failed after {waited:.1f} s, before the shuffler's timeout of "
                   f"{self.timeout:g} s ({cause}); rank(s) {missing} reported no failure of their own within "
                   f"{grace:g} s (dead, gone from the group, or still waiting in the collective)")
        elif missing:
            who = (f"rank(s) {missing} did not take part within the shuffler's timeout of "
                   f"{self.timeout:g} s (stalled, dead, or not calling the shuffler in step with the others)")
        elif missing == []:
            # A rank that got there after its peers' timeout also lands here: it cannot
            # tell that from a failure of the collective itself (a wall-clock guess
            # misjudged ranks whose peer failed on its own), so it says both.
            who = (f"every rank reported a failure of the collective: {cause} (if this rank got there after "
                   f"the others' timeout of {self.timeout:g} s, their errors name it)")
        else:
            who = f"the collective failed and the missing ranks could not be determined: {cause}"
        err = ShuffleAbortedError(f"BatchShuffler: shuffle #{seq} aborted in {phase} on rank {groups.rank}: "
                                  f"{who}; the shuffler is closed{groups.note}", seq=seq, phase=phase,
                                  missing=missing)
        self._broken = err
        raise err from cause

    def _fail(self, verdict: Verdict, headers: np.ndarray, meta: LocalMeta, groups: ShuffleGroups) -> None:
        reports = None
        if verdict.exchange:
            mine = Report(groups.rank, meta.seq, meta.error, layout_description(meta), self._config)
            reports = self._collective(groups, meta.seq, "phase 1", _comm.all_gather_objects, mine, groups)
        text, _ = describe_failure(verdict, headers, reports)
        reraise(meta, ValueError(f"BatchShuffler: shuffle #{meta.seq}: {text}{groups.note}"))

    def _check_plans(self, groups: ShuffleGroups, seq: int, digest: int | None) -> None:
        """Every rank's plan digest (``None``: the user's partition raised here), compared:
        raises on a rank that planned where the partition differed between ranks or
        raised on another; returns on a rank where it raised (which raises its own)."""
        mine = np.array([seq, 0 if digest is None else digest, int(digest is None)])
        rows = self._collective(groups, seq, "phase 1", _comm.gather_rows, mine, groups)
        name = getattr(self.partition, "__name__", repr(self.partition))
        failed = np.flatnonzero(rows[:, 2]).tolist()
        if digest is None:
            return
        if failed:
            raise ValueError(f"BatchShuffler: shuffle #{seq}: partition={name} raised on rank(s) {failed} "
                             f"(see their errors); nothing was moved (rank {groups.rank}){groups.note}")
        odd = [r for r in range(groups.world_size) if int(rows[r, 1]) != int(rows[0, 1])]
        if odd:
            raise ValueError(
                f"BatchShuffler: shuffle #{seq}: partition={name} returned different partitions on different "
                f"ranks (rank(s) {odd} differ from rank 0); a partition function must be deterministic and "
                f"depend only on its arguments{groups.note}")

    def _groups_for(self, group: Any) -> ShuffleGroups:
        """The shuffler's groups over ``group``, created at the first shuffle (or ``connect``).

        Raises:
            ShuffleAbortedError: creating them timed out (a peer never reached its
                first shuffle: the gloo rendezvous raised ``DistStoreError``); again
                at every later call.
        """
        if self._setup_error is not None:
            raise self._setup_error
        groups = self._groups.get(id(group))
        if groups is None or groups.user is not group:
            seq, attempt = self._next_seq, f"{self._instance}/{self._next_seq}"
            ranks = dist.get_process_group_ranks(group)
            gave_up = _comm.setup_failures(ranks, attempt)
            if gave_up:
                # The others' timeout passed before this rank came: creating the groups now
                # would wait on their stale gloo addresses, retrying several timeouts long
                # while they live on (15 s with a timeout of 3 s), instead of failing now.
                err = ShuffleAbortedError(
                    f"BatchShuffler: shuffle #{seq} aborted in phase 1 on rank {dist.get_rank(group)}: the "
                    f"shuffler's groups were not set up: {gave_up} other rank(s) gave up creating them before "
                    f"this rank started its first shuffle (their timeout of {self.timeout:g} s had passed: "
                    f"this rank is late, and their errors name the ranks they waited for); the shuffler is "
                    f"closed{_comm.rank_note(ranks)}", seq=seq, phase="phase 1", missing=[])
                self._setup_error = err
                raise err
            try:
                groups = _comm.create_groups(group, self.timeout)
            except RuntimeError as e:
                rank = dist.get_rank(group)
                _comm.setup_failures(ranks, attempt, report=True)
                note = _comm.rank_note(ranks)
                if note:  # a subgroup: torch may have named the groups differently on its ranks
                    note += (f"; over a subgroup this also happens where its ranks hold different numbers of "
                             f"process groups (this one holds {_comm.held_groups()}): torch names a group "
                             "created by its members alone by that number (pytorch/pytorch#173608), so create "
                             "the shuffler's groups (connect(pg)) on every rank of the group before groups "
                             "that only some of them join")
                missing = _comm.missing_at_setup(ranks, attempt, min(max(self.timeout, _MIN_GRACE_S), _SETUP_GRACE_S))
                if missing == []:
                    why = ("every rank reported that the groups could not be created (if this rank started its "
                           "first shuffle after the others' timeout, their errors name it)")
                else:
                    who = f"rank(s) {missing}" if missing else "a rank"
                    why = (f"{who} never started its first shuffle (stalled, dead, or not calling the "
                           "shuffler in step with the others)")
                err = ShuffleAbortedError(
                    f"BatchShuffler: shuffle #{seq} aborted in phase 1 on rank {rank}: the shuffler's groups "
                    f"were not set up within its timeout of {self.timeout:g} s: {why}; "
                    f"the shuffler is closed ({type(e).__name__}: {e}){note}", seq=seq, phase="phase 1",
                    missing=missing or None)
                self._setup_error = err
                raise err from e
            self._groups[id(group)] = groups
        return groups

    def _child(self) -> PartitionWorker | None:
        """The partition child, started (again) where needed; ``None`` once closed."""
        with self._worker_lock:
            if self._closed:
                return None
            if self._worker is not None and not self._worker.alive():
                logger.warning("balancer: the partition child process exited; starting a new one")
                self._worker.close()
                self._worker = None
            if self._worker is None:
                self._worker = PartitionWorker()  # closes itself when garbage collected
            return self._worker


def _raise(error: BaseException) -> Any:
    """A background job that fails with ``error`` (for finish_shuffle to raise)."""
    raise error


def _canonical_length(batch: Any, length: int) -> Any:
    """A padded ``TokenBatch`` that stays put, as a shuffle gives it: at ``length``
    (its longest sample rounded up to ``pad_multiple``, from the background
    work), every padding position holding its field's pad value (new tensors;
    the caller's are not written). Anything else unchanged. Device ops only."""
    if not isinstance(batch, TokenBatch) or batch.packed:
        return batch
    pad = padding_positions(batch.seq_lens, length)

    def fit(name: str, t: torch.Tensor) -> torch.Tensor:
        if length < t.shape[1]:  # only padding slots are cut
            t = t[:, :length]
        elif length > t.shape[1]:
            t = torch.cat([t, t.new_zeros((t.shape[0], length - t.shape[1], *t.shape[2:]))], dim=1)
        return fill_padding(t, pad, pad_value(batch, name))

    return dataclasses.replace(batch, tokens={k: fit(k, v) for k, v in batch.tokens.items()})


def _event_pairs(events: Any) -> list[tuple[Any, Any]] | None:
    """``events`` (any iterable, read once) as a list of ``(start, end)`` pairs of
    event-like objects; ``None`` if it is not one."""
    def event(x: Any) -> bool:
        return callable(getattr(x, "query", None)) and callable(getattr(x, "elapsed_time", None))

    try:
        pairs = [tuple(p) for p in events]
    except TypeError:  # not iterable, or an item that is not
        return None
    ok = all(len(p) == 2 and event(p[0]) and event(p[1]) for p in pairs)
    return pairs if ok else None


def _padded(batch: Any, size: int) -> Any:
    """``batch`` with padding samples up to ``size`` (device ops only, nothing read)."""
    if isinstance(batch, TokenBatch):
        return batch.pad(size)
    from balancer.batch import pad_batch  # already loaded: batch is a BaseBatch

    return trusted(pad_batch, batch, size)


def _exhausted_problem(exhausted: Any, rank: int) -> str:
    """``start_shuffle_async``'s ``exhausted`` must be a bool (numpy's too): a tensor or
    a count would say something else than the caller meant. "" if it is one."""
    if isinstance(exhausted, (bool, np.bool_)):
        return ""
    return f"start_shuffle_async: exhausted={exhausted!r}, expected a bool (rank {rank})"


def _check_exhausted(exhausted: Any, rank: int) -> None:
    problem = _exhausted_problem(exhausted, rank)
    if problem:  # IdentityBatchShuffler: no peer to leave waiting
        raise TypeError(problem)


class IdentityBatchShuffler(ShufflerBase):
    """Same API as :class:`BatchShuffler`; communicates nothing and returns the
    batch unchanged. Stats cover this rank only (``world_size == 1``); ``rank``
    is its rank within ``pg`` (the default group when ``None``), as with
    :class:`BatchShuffler`.

    Args:
        workload_fn: optional per-sample cost, for the stats' load.
    """

    def __init__(self, workload_fn: Callable[[Any], Any] | None = None) -> None:
        super().__init__(workload_fn)

    def start_shuffle_async(self, batch: Any, pg: dist.ProcessGroup | None = None, *,
                            exhausted: bool = False) -> ShuffleHandle:
        """No communication; computes the workloads only if ``workload_fn`` is set."""
        self._check_open()
        _, _, rank = _comm.resolve_group(pg, "IdentityBatchShuffler")
        _check_exhausted(exhausted, rank)
        real = as_count(getattr(batch, "actual_batch_size", 0)) if exhausted else 0
        if real and self._workload_fn is None:  # captured otherwise (ValueError from finish)
            raise ValueError(f"IdentityBatchShuffler: {exhausted_problem(real, rank)}")
        t0 = perf_counter()
        job, meta = None, LocalMeta(self._next_seq, rank, 0, exhausted=bool(exhausted))  # no workloads: the flag
        if self._workload_fn is not None:
            meta = capture(batch, self._workload_fn, seq=self._next_seq, rank=rank, config=0,
                           base_type=batch_types(), expected=BATCH_TYPES, exhausted=bool(exhausted))
            job = self._pool().submit(self._local_job, meta, "identity")
        return self._register(ShuffleHandle(self._next_seq, 1, rank, perf_counter() - t0, self._token, job, meta))

    def finish_shuffle(self, batch: BatchT, handle: ShuffleHandle, pg: dist.ProcessGroup | None = None) -> BatchT:
        """Returns ``batch`` itself."""
        self._claim(handle)
        if handle._job is None:
            b = int(getattr(batch, "batch_size", 0) or 0)
            stats = build_stats(seq=handle.seq, rank=handle.rank, comm="identity", workloads=np.zeros(b),
                                dest=np.zeros(b, np.int64), real=np.array([b]), lower_bound=0.0,
                                partition_s=0.0, traffic=Traffic(), background_s=0.0,
                                exhausted=np.array([handle._meta is not None and handle._meta.exhausted]))
        else:
            stats = self._wait(handle, None).stats
        self._done(handle, dataclasses.replace(stats, phase1_s=handle.phase1_s))
        return batch

