"""`ShuffleStats`: what one shuffle achieved and what it cost, seen from one rank."""

from __future__ import annotations

import dataclasses

import numpy as np

from balancer._calibrate import CostModel
from balancer._exchange import Traffic
from balancer._plan import moved_mask, real_mask

__all__ = ["ShuffleStats", "build_stats", "format_stats"]


@dataclasses.dataclass(frozen=True)
class ShuffleStats:
    """Statistics of one finished shuffle, seen from one rank.

    Loads are sums of real samples' workloads, in the units ``workload_fn``
    returns (padding counts 0); with ``calibrate=True``, once a fitted model
    partitions (``calibration`` set), that model's costs in seconds: the loads,
    bound and imbalance are then the ones the partition balanced. Balance numbers are global (equal on every
    rank; with ``group_size``, the group's); traffic and times are this rank's.

    Attributes:
        seq: the handle's sequence number on this shuffler.
        world_size: W.
        rank: this rank.
        comm: ``"all2all"``, ``"allgather"``, ``"none"`` (nothing had to move,
            phase 2 issued no collective) or ``"identity"``.
        load_before: [W] per-rank load of the input batches.
        load_after: [W] per-rank load of the output batches.
        max_before, mean_before, max_after, mean_after: their maximum and mean
            (the means are equal).
        lower_bound: no partition with B samples per rank has a smaller max load.
        partition_s: seconds the partition computed (child process or thread),
            not the time anyone waited for it.
        phase1_s: wall seconds of ``start_shuffle_async`` on the calling thread.
        phase2_s: wall seconds of ``finish_shuffle`` on the calling thread.
        wait_s: part of ``phase2_s`` spent waiting for the background work
            (metadata exchange, partition, plan); near 0 when it overlapped.
        samples_sent, samples_received: real samples to / from other ranks.
        bytes_sent, bytes_received: phase 2 bytes to / from other ranks.
        moved_fraction: fraction of all ranks' real samples that changed rank.
        background_s: wall seconds of the background work, from its start to
            the plan (overlaps the caller's own work).
        collective_s: part of ``phase2_s`` inside the collective call (on CPU
            and gloo the call blocks; with NCCL it only enqueues).
        calibration: the cost model fitted to measured compute times that
            this shuffle partitioned with (online calibration), or ``None``
            (``workload_fn``'s costs were used).
        real_before, real_after: [W] real samples per rank in the input and
            output batches.
        tokens_before, tokens_after: [W] tokens per rank in the input and
            output batches: the real samples' elements over every KJT key (or
            ``seq_lens`` of a ``TokenBatch``), what activation memory follows.
        token_cap: the cap on tokens per rank this shuffle honoured
            (``BatchShuffler(token_cap=...)`` times the mean, or the proven
            minimum if higher); ``None`` without a cap or where the search
            could not meet it (compute alone was balanced).
        group: with ``BatchShuffler(group_size=...)``, the ranks this shuffle
            balanced among (this rank's group, ascending); the per-rank lists
            (``load_*``, ``real_*``, ``tokens_*``), the balance numbers and
            ``moved_fraction`` then cover the group, in this order. Empty:
            all W ranks, rank r at index r.
        world_load_before, world_real_before: [W] load and real samples of
            every rank's input batch, rank r at index r, also with
            ``group_size`` (then from the headers every rank gathers); without
            it equal to ``load_before`` and ``real_before``. Whether any rank
            of the job had data, or the job's imbalance before the shuffle,
            reads from these.
        world_exhausted: [W] whether rank r started this shuffle with
            ``exhausted=True`` (its data had run out), rank r at index r, also
            with ``group_size``. A pass that every rank's data has left ends
            where all are true: the same answer on every rank.
    """

    seq: int
    world_size: int
    rank: int
    comm: str
    load_before: list[float]
    load_after: list[float]
    max_before: float
    mean_before: float
    max_after: float
    mean_after: float
    lower_bound: float
    partition_s: float
    phase1_s: float
    phase2_s: float
    wait_s: float
    samples_sent: int
    samples_received: int
    bytes_sent: int
    bytes_received: int
    moved_fraction: float
    background_s: float = 0.0
    collective_s: float = 0.0
    calibration: CostModel | None = None
    real_before: list[int] = dataclasses.field(default_factory=list)
    real_after: list[int] = dataclasses.field(default_factory=list)
    tokens_before: list[int] = dataclasses.field(default_factory=list)
    tokens_after: list[int] = dataclasses.field(default_factory=list)
    token_cap: float | None = None
    group: list[int] = dataclasses.field(default_factory=list)
    world_load_before: list[float] = dataclasses.field(default_factory=list)
    world_real_before: list[int] = dataclasses.field(default_factory=list)
    world_exhausted: list[bool] = dataclasses.field(default_factory=list)

    @property
    def imbalance_before(self) -> float:
        """``max_before / mean_before`` (1.0 is perfect; 1.0 when idle)."""
        return self.max_before / self.mean_before if self.mean_before else 1.0

    @property
    def imbalance_after(self) -> float:
        """``max_after / mean_after`` (1.0 is perfect; 1.0 when idle)."""
        return self.max_after / self.mean_after if self.mean_after else 1.0

    @property
    def world_imbalance_before(self) -> float:
        """Max/mean of ``world_load_before``: the whole job's imbalance before
        the shuffle, also with ``group_size`` (1.0 when idle)."""
        return _ratio(self.world_load_before)

    @property
    def token_imbalance_before(self) -> float:
        """Max/mean tokens per rank in the input batches (1.0 when empty)."""
        return _ratio(self.tokens_before)

    @property
    def token_imbalance_after(self) -> float:
        """Max/mean tokens per rank in the output batches (1.0 when empty)."""
        return _ratio(self.tokens_after)

    @property
    def host_blocked_s(self) -> float:
        """Seconds the calling thread was blocked in this shuffle: waiting for
        the background work plus inside a blocking collective."""
        return self.wait_s + self.collective_s


def build_stats(*, seq: int, rank: int, comm: str, workloads: np.ndarray, dest: np.ndarray, real: np.ndarray,
                lower_bound: float, partition_s: float, traffic: Traffic, background_s: float,
                tokens: np.ndarray | None = None, token_cap: float | None = None,
                exhausted: np.ndarray | None = None) -> ShuffleStats:
    """:class:`ShuffleStats` of a shuffle, with this rank's calling-thread times still 0.

    Args:
        workloads: [W * B] workloads by global index, 0 for padding.
        dest: [W * B] destination rank by global index.
        real: [W] real samples per rank.
        tokens: [W * B] tokens per sample by global index, 0 for padding.
        exhausted: [W] whether each rank's data had run out (``None``: none had).
    """
    w = real.size
    b = workloads.size // w if w else 0
    x = workloads.astype(np.float64)
    before = x.reshape(w, b).sum(axis=1) if b else np.zeros(w)
    after = np.bincount(dest, weights=x, minlength=w) if b else np.zeros(w)
    is_real = real_mask(real, b) if b else np.zeros(0, bool)
    total_real = int(is_real.sum())
    moved = int((is_real & moved_mask(dest, b)).sum()) if b else 0
    return ShuffleStats(
        seq=seq, world_size=int(w), rank=rank, comm=comm,
        load_before=[float(v) for v in before], load_after=[float(v) for v in after],
        max_before=float(before.max(initial=0.0)), mean_before=float(before.mean()) if w else 0.0,
        max_after=float(after.max(initial=0.0)), mean_after=float(after.mean()) if w else 0.0,
        lower_bound=float(lower_bound), partition_s=partition_s, phase1_s=0.0, phase2_s=0.0, wait_s=0.0,
        samples_sent=traffic.samples_sent, samples_received=traffic.samples_received,
        bytes_sent=traffic.bytes_sent, bytes_received=traffic.bytes_received,
        moved_fraction=moved / total_real if total_real else 0.0, background_s=background_s,
        real_before=[int(v) for v in real],
        real_after=[int(v) for v in np.bincount(dest[is_real], minlength=w)] if b else [0] * w,
        tokens_before=_per_rank(tokens, None, w, b), tokens_after=_per_rank(tokens, dest, w, b),
        token_cap=token_cap, world_load_before=[float(v) for v in before], world_real_before=[int(v) for v in real],
        world_exhausted=[False] * int(w) if exhausted is None else [bool(v) for v in exhausted],
    )


def _per_rank(tokens: np.ndarray | None, dest: np.ndarray | None, w: int, b: int) -> list[int]:
    """Tokens per rank: where samples are (``dest=None``) or where they go."""
    if tokens is None:
        return []
    if not b:
        return [0] * w
    t = np.asarray(tokens, np.int64)
    per = t.reshape(w, b).sum(axis=1) if dest is None else np.bincount(dest, weights=t, minlength=w)
    return [int(v) for v in per]


def _ratio(per_rank: list[int] | list[float]) -> float:
    mean = sum(per_rank) / len(per_rank) if per_rank else 0.0
    return max(per_rank) / mean if mean else 1.0


def format_stats(s: ShuffleStats) -> str:
    """One log line for ``s``."""
    scope = f"W={s.world_size}"
    if s.group:  # the balance numbers below are the group's
        scope += f", group of {len(s.group)}, job imbalance before {s.world_imbalance_before:.3f}"
    return (
        f"shuffle #{s.seq} ({s.comm}, {scope}): max/mean load "
        f"{s.max_before:.4g}/{s.mean_before:.4g} -> {s.max_after:.4g}/{s.mean_after:.4g} "
        f"(imbalance {s.imbalance_before:.3f} -> {s.imbalance_after:.3f}, lower bound "
        f"{s.lower_bound:.4g}); moved {100 * s.moved_fraction:.1f}% of samples; rank {s.rank} "
        f"sent {s.samples_sent} samples / {s.bytes_sent} B, received {s.samples_received} / "
        f"{s.bytes_received} B; phase1 {1e3 * s.phase1_s:.2f} ms, background {1e3 * s.background_s:.2f} ms "
        f"(partition {1e3 * s.partition_s:.2f} ms), phase2 {1e3 * s.phase2_s:.2f} ms (waited "
        f"{1e3 * s.wait_s:.2f} ms, collective {1e3 * s.collective_s:.2f} ms)"
    )
