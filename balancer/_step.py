"""One shuffle's planning, from the gathered phase-1 messages to this rank's plan (numpy only).

After every rank agreed (:mod:`balancer._agreement`), what remains is pure
computation on the gathered messages: the partition, this rank's plan, every
byte and index of phase 2, and the statistics. :func:`plan_step` does all of
it, importing no torch, so it runs where it costs the training loop nothing:

* in the shuffler's torch-free planner process (``executor="process"``, the
  default), where it never holds the training process's GIL;
* in the shuffler's background thread, for a custom partition function
  (``executor="thread"``) or when the planner process died -- the same
  function on the same input, so every rank gets the same plan either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from balancer._calibrate import CostModel, features
from balancer._destinations import PartitionFn, partition
from balancer._exchange import Exchange, Traffic, plan_exchange
from balancer._header import H_DONE, H_PAD_LEN, H_REAL, HEADER_LEN
from balancer._plan import Gathered, moved_mask, plan_digest, plan_rank, real_mask
from balancer._plan_layout import PlanLayout
from balancer._stats import ShuffleStats, build_stats

__all__ = ["Step", "gathered_from", "plan_step"]


@dataclasses.dataclass(frozen=True)
class Step:
    """This rank's plan for one shuffle (picklable: it crosses the process boundary).

    Attributes:
        dest: [W * B] destination rank of every global sample.
        digest: :func:`balancer._plan.plan_digest` of ``dest``.
        exchange: phase 2 of this rank, or ``None`` when no sample moves anywhere.
        stats: the shuffle's statistics (calling-thread times still 0).
        features: [W, 4] what every rank receives, summed per rank: ``workload_fn``
            cost, L**2, L, samples (online calibration pairs them with times).
    """

    dest: np.ndarray
    digest: int
    exchange: Exchange | None
    stats: ShuffleStats
    features: np.ndarray


def gathered_from(rows: np.ndarray, batch_size: int, num_lengths: int) -> Gathered:
    """Every rank's workloads, lengths and real counts from the gathered messages ``[W, len]``."""
    b, k = batch_size, num_lengths
    w = rows.shape[0]
    real = rows[:, H_REAL].astype(np.int64)
    workloads = rows[:, HEADER_LEN : HEADER_LEN + b].copy().view(np.float64)
    workloads[np.arange(b)[None, :] >= real[:, None]] = 0.0
    lengths = rows[:, HEADER_LEN + b :].copy().view(np.int32)[:, : k * b].reshape(w, k, b).astype(np.int64)
    return Gathered(workloads.reshape(-1), lengths, real, rows[:, H_PAD_LEN].astype(np.int64))


def plan_step(rows: np.ndarray, layout: PlanLayout, *, seq: int, rank: int, comm: str, locality: bool,
              fn: PartitionFn | None = None, localize: Callable[..., Any] | None = None,
              lower_bound: Callable[..., float] | None = None, capacity: int | None = None,
              cost_model: CostModel | None = None, length_rows: tuple[int, ...] | None = None,
              token_cap: float | None = None) -> Step:
    """Partition, plan and describe shuffle ``seq`` for ``rank``.

    Args:
        rows: [W, len] gathered phase-1 messages (all valid under ``layout``).
        layout: the agreed layout.
        fn: a custom partition function, or ``None`` for ``balanced_partition``
            (+ ``localize`` with ``locality``) run right here.
        localize, lower_bound: what a custom ``fn`` is refined and bounded with.
        capacity: unequal counts: every rank receives at most ``capacity`` real
            samples (output batch size ``capacity``); ``None``: exactly B each.
        cost_model: a fitted model (online calibration) whose per-sample costs
            replace ``workload_fn``'s in the partition and the statistics.
        length_rows: rows of the lengths matrix summed into a sample's length
            ``L`` for calibration (``None``: every row).
        token_cap: cap every rank's tokens (a sample's elements over every
            lengths row) at this multiple of the mean (``None``: no cap).
    """
    g = gathered_from(rows, layout.batch_size, layout.num_lengths)
    raw = g.workloads
    chosen = g.lengths if length_rows is None else g.lengths[:, list(length_rows)]
    totals = chosen.sum(axis=1).reshape(-1)  # every sample's length L, for calibration
    is_real = real_mask(g.real, layout.batch_size)
    tokens = np.where(is_real, g.lengths.sum(axis=1).reshape(-1), 0)  # elements per sample, every key
    if cost_model is not None:
        g = dataclasses.replace(g, workloads=np.where(is_real, cost_model.costs(raw, totals), 0.0))
    if fn is None:
        from balancer.partition import localize as _localize
        from balancer.partition import lower_bound as _lower_bound

        localize, lower_bound = _localize, _lower_bound
    assert localize is not None and lower_bound is not None, "a custom partition comes with both"
    result = partition(g, layout, fn=fn, worker=None, locality=locality, localize=localize,
                       lower_bound=lower_bound, capacity=capacity, tokens=tokens, token_cap=token_cap)
    b = layout.batch_size
    plan = plan_rank(result.dest, b, g.real, rank)
    moves = bool((moved_mask(result.dest, b) & real_mask(g.real, b)).any())
    exchange = plan_exchange(comm, layout, g, plan, capacity) if moves else None
    stats = build_stats(seq=seq, rank=rank, comm=comm if moves else "none", workloads=g.workloads,
                        dest=result.dest, real=g.real, lower_bound=result.lower_bound,
                        partition_s=result.seconds, traffic=exchange.traffic if exchange else Traffic(),
                        background_s=0.0, tokens=tokens, token_cap=result.token_cap,
                        exhausted=rows[:, H_DONE] != 0)
    stats = dataclasses.replace(stats, calibration=cost_model)
    feats = features(raw, totals, result.dest, is_real, g.world_size)
    return Step(result.dest, plan_digest(result.dest), exchange, stats, feats)
