"""Buffered dispatch: choose each round's samples from a window, not just the latest batch.

A controller that dispatches exactly the samples it just received can only
balance what it got. Keeping a window of ``window`` rounds' worth of samples
lets it pick, each round, the subset of ``S = W x samples_per_rank`` samples
that splits best: with ``padded`` micro-batches, samples of similar length
(less padding); otherwise a subset whose largest sample does not dominate its
rank. Every round:

1. samples that first-in-first-out dispatch would have sent ``window - 1``
   rounds ago go out now (``forced``);
2. the others are sorted by cost and every run of consecutive ones that
   completes the round is scored together with the forced ones, and so is the
   first-in-first-out choice: a lower bound on the slowest rank over the mean
   real cost (padded: padding and whole micro-batches; summed: the
   equal-count pigeonhole bound). Among the candidates within 0.1 % of the
   best (or of perfect balance) the one with the oldest samples wins;
3. :func:`~balancer.dispatch.plan_dispatch` splits the chosen samples.

Staleness: the ``q``-th sample put (from 0) is dispatched in round
``q // S + window - 1`` at the latest, at most ``window - 1`` rounds later than
first-in-first-out would send it, provided :meth:`BufferedDispatcher.next` is
called only when :meth:`~BufferedDispatcher.ready` (so the window is filled
ahead). By induction, the samples due in a round are at most one FIFO round's
``S``. No sample is lost or sent twice. ``window=1`` is plain FIFO.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from balancer._llm_units import as_lengths, check_positive, is_empty, row_cost
from balancer.dispatch import DispatchPlan, plan_dispatch

__all__ = ["BufferedDispatcher", "DispatchRound"]

_TOL = 1e-3  # scores within this of the best (or of perfect, 1.0) count as equally good
_MAX_CELLS = 1 << 20  # scored (window, sample) pairs per round; starts are subsampled beyond
_ID_LIMIT = 2**62  # |id| below this (BufferedDispatcher.put)


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchRound:
    """One round: which samples go to which rank."""

    ids: np.ndarray
    """[S] int64 sample ids chosen this round (as given to :meth:`BufferedDispatcher.put`)."""
    plan: DispatchPlan
    """The split of ``ids``: its indices point into ``ids``."""
    round: int
    """Round number, from 0."""
    max_lag: int
    """Largest delay of a chosen sample against first-in-first-out, in rounds
    (``<= window - 1``; negative when every sample goes out early)."""

    def rank_ids(self, rank: int) -> np.ndarray:
        """Sample ids for ``rank``."""
        return self.ids[np.asarray(self.plan.ranks[rank], dtype=np.int64)]

    def micro_batch_ids(self, rank: int) -> list[np.ndarray]:
        """Sample ids of each micro-batch of ``rank`` (requires micro-batches)."""
        if self.plan.micro_batches is None:
            raise ValueError("this round was planned without micro-batches")
        return [self.ids[np.asarray(m, dtype=np.int64)] for m in self.plan.micro_batches[rank]]


# plan_dispatch's settings that every round takes as they are.
_PASSED = ("max_tokens", "num_micro_batches", "min_micro_batches", "divisible_by")
# ... and those a round cannot take from the constructor.
_REFUSED = {
    "groups": "group ids are per sample, and a round picks its samples from the window, so ids given "
              "here would be applied by position to other samples; BufferedDispatcher does not keep "
              "groups together (plan_dispatch(groups=...) does, for one global batch)",
    "equal_count": "every rank gets samples_per_rank samples a round (a last, partial round is shared "
                   "unevenly by itself); for free counts use plan_dispatch(equal_count=False)",
}


class BufferedDispatcher:
    """Dispatch rounds of ``world_size x samples_per_rank`` samples from a window.

    Example::

        disp = BufferedDispatcher(world_size=8, samples_per_rank=16, window=4,
                                  padded=True, micro_batch_size=4)
        for batch in loader:                 # 128 samples per step
            disp.put(batch.lengths, batch.ids)
            if disp.ready():
                rnd = disp.next()
                send(rnd.rank_ids(r) for r in range(8))
        for rnd in disp.drain():             # the rest, at the end
            ...

    Args:
        world_size: W.
        samples_per_rank: samples every rank gets per round.
        window: rounds of samples kept (>= 1); a sample waits at most
            ``window - 1`` rounds.
        cost, padded, micro_batch_size, max_tokens, num_micro_batches,
            min_micro_batches, divisible_by: passed to
            :func:`~balancer.dispatch.plan_dispatch` (``equal_count`` is
            ``True`` but in a last partial round: every rank gets
            ``samples_per_rank`` samples; with ``padded`` every rank gets
            the same number of length-homogeneous micro-batches instead, and
            the ``S`` samples of a round are shared unevenly).
            ``padded`` scoring needs ``micro_batch_size``.

    Raises:
        ValueError: non-positive sizes, ``padded`` without
            ``micro_batch_size`` (or that without ``padded``), or another keyword (``groups`` and
            ``equal_count=False`` of ``plan_dispatch`` among them: a round picks
            its samples from the window, so per-sample group ids cannot be
            given up front, and every rank gets ``samples_per_rank``).
    """

    def __init__(self, world_size: int, samples_per_rank: int, *, window: int = 4,
                 cost: Any = None, padded: bool = False, micro_batch_size: int | None = None,
                 **dispatch_kwargs: Any) -> None:
        for name, val in (("world_size", world_size), ("samples_per_rank", samples_per_rank),
                          ("window", window)):
            check_positive(name, val, "BufferedDispatcher")
        if padded and micro_batch_size is None:
            raise ValueError("BufferedDispatcher: padded=True needs micro_batch_size (rows per "
                             "micro-batch) to score a window's padding")
        if micro_batch_size is not None and not padded:  # else every round raised it
            raise ValueError(f"BufferedDispatcher: micro_batch_size={micro_batch_size} bounds the rows of padded "
                             "micro-batches; pass padded=True or use max_tokens")
        if dispatch_kwargs.get("equal_count") is True:  # plan_dispatch's default, what every round does
            dispatch_kwargs = {k: v for k, v in dispatch_kwargs.items() if k != "equal_count"}
        unknown = sorted(set(dispatch_kwargs) - set(_PASSED))
        if unknown:
            name = unknown[0]
            why = _REFUSED.get(name, f"expected one of {', '.join(('cost', 'padded', 'micro_batch_size') + _PASSED)}")
            raise ValueError(f"BufferedDispatcher: {name}={dispatch_kwargs[name]!r} is not accepted: {why}")
        fn = row_cost(cost)
        if fn is None:
            raise ValueError("BufferedDispatcher: cost must be a function of length (or None), "
                             "not per-sample values")
        self._w, self._b, self._window = world_size, samples_per_rank, window
        self._size = world_size * samples_per_rank
        self._cost, self._fn, self._padded, self._mbs = cost, fn, padded, micro_batch_size
        self._kwargs = dispatch_kwargs
        self._cap = dispatch_kwargs.get("max_tokens")
        check_positive("max_tokens", self._cap, "BufferedDispatcher", allow_none=True)
        self._ids = np.zeros(0, np.int64)
        self._lens = np.zeros(0, np.int64)
        self._seq = np.zeros(0, np.int64)  # arrival number q of each buffered sample
        self._round = 0
        self._next_id = 0
        self._count = 0  # samples put so far

    @property
    def pending(self) -> int:
        """Samples in the buffer."""
        return int(self._ids.size)

    def put(self, lengths: Any, ids: Any = None) -> None:
        """Add samples (their lengths; ids default to a running counter).

        An empty ``lengths`` (a producer with nothing new this round) adds nothing.

        Raises:
            ValueError: bad lengths or ids, or a sample longer than
                ``max_tokens`` (named by its id); nothing is buffered then.
        """
        if is_empty(lengths):
            if ids is not None and np.asarray(ids).size:
                raise ValueError(f"ids has shape {np.asarray(ids).shape}, expected (0,) like lengths")
            return
        lens = as_lengths(lengths, "BufferedDispatcher.put")
        if ids is None:
            new = np.arange(self._next_id, self._next_id + lens.size, dtype=np.int64)
        else:
            raw = np.asarray(ids)
            flat = raw.ravel()
            # Integers within +-2**62: int64 holds them, and the running counter of
            # default ids (one past the largest) cannot wrap. uint64 and floats beyond
            # that were cast with wrap-around (2**64 - 1 became -1).
            kind = raw.dtype.kind
            if kind == "f":
                whole = np.isfinite(flat) & (flat == np.round(flat)) & (np.abs(flat) < _ID_LIMIT)
            elif kind == "u":
                whole = flat < np.uint64(_ID_LIMIT)
            elif kind == "i":
                whole = (flat >= -_ID_LIMIT) & (flat < _ID_LIMIT)
            else:
                whole = np.zeros(flat.shape, bool)  # bools, strings, objects
            if not whole.all():
                bad = int(np.argmin(whole))  # the first id that is not such an integer
                raise ValueError(f"ids[{bad}] = {flat[bad].item()!r}, expected an integer in [-2**62, 2**62) "
                                 "(BufferedDispatcher.put)")
            new = raw.astype(np.int64)
            if new.shape != lens.shape:
                raise ValueError(f"ids has shape {new.shape}, expected {lens.shape} like lengths")
            seen, first = np.unique(new, return_index=True)
            if seen.size != new.size:
                dup = int(np.setdiff1d(np.arange(new.size), first)[0])
                raise ValueError(f"ids[{dup}] = {int(new[dup])} repeats ids[{int(np.flatnonzero(new == new[dup])[0])}]; "
                                 "ids must be unique among buffered samples (BufferedDispatcher.put)")
            again = np.intersect1d(new, self._ids)
            if again.size:
                dup = int(np.flatnonzero(new == again[0])[0])
                raise ValueError(f"ids[{dup}] = {int(again[0])} is already buffered; ids must be unique "
                                 "among buffered samples (BufferedDispatcher.put)")
        if self._cap is not None and int(lens.max()) > self._cap:
            # Buffered, it would fail every later round (the buffer is kept on an error).
            i = int(np.argmax(lens))
            raise ValueError(f"sample id {int(new[i])} has {int(lens[i])} tokens, more than max_tokens={self._cap}: "
                             "no micro-batch can hold it; nothing of this put() was buffered "
                             "(BufferedDispatcher.put)")
        self._next_id = max(self._next_id, int(new.max()) + 1)
        self._ids = np.concatenate([self._ids, new])
        self._lens = np.concatenate([self._lens, lens])
        self._seq = np.concatenate([self._seq, self._count + np.arange(lens.size)])
        self._count += int(lens.size)

    def ready(self) -> bool:
        """Whether a full window is buffered (``window x S`` samples)."""
        return self.pending >= self._window * self._size

    def next(self, flush: bool = False) -> DispatchRound:
        """Choose and split the next round's samples.

        Args:
            flush: allow a round from a partly filled window (at the end of
                data); needs ``S`` samples unless fewer remain in all, then the
                rest goes out with unequal shares where needed: a share with
                fewer samples than the round's micro-batches gets one a
                micro-batch and empty ones, and with fewer samples than ranks
                the last ranks get nothing (an empty share and no
                micro-batches), which a loop whose ranks must all step
                together has to skip or pad.

        Raises:
            ValueError: fewer than ``S`` samples buffered without ``flush``, an
                empty buffer, or ``plan_dispatch``'s error for the round (too
                few samples for the micro-batches asked for); the buffer is
                then unchanged.
        """
        n, s = self.pending, self._size
        if n == 0 or (n < s and not flush):
            raise ValueError(f"{n} samples buffered, a round needs {s} (pass flush=True at the end)")
        take = self._choose(min(n, s))
        lens = self._lens[take]
        count = take.size
        kwargs = dict(self._kwargs)
        if count % self._w and not self._padded:  # padded shares are whole micro-batches already
            kwargs["equal_count"] = False
        # A last, partial round may not give every rank the same number of
        # micro-batches (7 one-row micro-batches on 3 ranks): it then goes to
        # as many ranks as it can, the others get nothing.
        first: ValueError | None = None
        for ranks in range(min(self._w, count), 0 if count < s else self._w - 1, -1):
            try:
                plan = _with_empty_ranks(plan_dispatch(lens, ranks, cost=self._cost, padded=self._padded,
                                                       micro_batch_size=self._mbs, **kwargs), self._w)
                break
            except ValueError as e:
                first = first or e
        else:
            assert first is not None, "the loop ran at least once"
            raise first
        out = DispatchRound(ids=self._ids[take], plan=plan, round=self._round,
                            max_lag=int(self._round - (self._seq[take] // s).min()))
        keep = np.ones(n, bool)
        keep[take] = False
        self._ids, self._lens, self._seq = self._ids[keep], self._lens[keep], self._seq[keep]
        self._round += 1
        return out

    def drain(self) -> list[DispatchRound]:
        """Dispatch everything left, oldest first within the window rule."""
        rounds = []
        while self.pending:
            rounds.append(self.next(flush=True))
        return rounds

    def _choose(self, m: int) -> np.ndarray:
        """Buffer positions of this round's ``m`` samples."""
        age = self._round - self._seq // self._size  # rounds behind FIFO
        by_age = np.argsort(self._seq, kind="stable")  # oldest first
        forced = by_age[age[by_age] >= self._window - 1]
        if forced.size >= m:
            return np.sort(forced[:m])
        free = np.setdiff1d(np.arange(age.size), forced)
        need = m - forced.size
        c = self._fn(self._lens).astype(np.float64)
        order = free[np.lexsort((free, c[free]))]  # by cost, ties by position
        starts = np.arange(order.size - need + 1)
        if starts.size * m > _MAX_CELLS:
            starts = np.unique(np.linspace(0, order.size - need, _MAX_CELLS // m).astype(np.int64))
        runs = order[starts[:, None] + np.arange(need)[None, :]]  # [C, need]
        rows = np.concatenate([np.broadcast_to(forced, (starts.size, forced.size)), runs], axis=1)
        rows = np.concatenate([by_age[None, :m], rows])  # candidate 0: first in, first out
        vals = -np.sort(-c[rows], axis=1)  # [C + 1, m], descending per row
        mean = np.maximum(vals.sum(axis=1) / self._w, 1e-300)
        if self._padded:
            assert self._mbs is not None, "checked in __init__"
            # Micro-batches of the sorted candidate cost rows x cost(longest); the
            # slowest rank pays at least the padded mean, and at least the
            # largest micro-batch plus its other k - 1 at the smallest one.
            sizes = np.minimum(self._mbs, m - np.arange(0, m, self._mbs))
            chunks = vals[:, :: self._mbs] * sizes  # [C + 1, m / mbs], descending
            k = -(-chunks.shape[1] // self._w)
            rank = np.maximum(chunks.sum(axis=1) / self._w, chunks[:, 0] + (k - 1) * chunks[:, -1])
            score = rank / mean
        else:
            # Equal counts (pigeonhole, as in partition.lower_bound): of the
            # k = (j - 1) W + 1 largest, some rank holds j, plus b - j fillers.
            b = -(-m // self._w)
            desc = np.concatenate([np.zeros((vals.shape[0], 1)), np.cumsum(vals, axis=1)], axis=1)
            j = np.arange(1, min(b, m) + 1)
            k = (j - 1) * self._w + 1
            keep = k <= m
            j, k = j[keep], k[keep]
            fill = desc[:, m:m + 1] - desc[:, m - (b - j)]
            pig = (desc[:, k] - desc[:, k - j] + fill).max(axis=1)
            score = np.maximum(mean, pig) / mean
        # Balanced enough is enough: among those, the oldest candidate, so that
        # hard samples do not pile up for later rounds.
        good = np.flatnonzero(score <= max(float(score.min()), 1.0) * (1 + _TOL))
        best = good[np.argmax(age[rows[good]].sum(axis=1))]
        return np.sort(rows[best])


def _with_empty_ranks(plan: DispatchPlan, w: int) -> DispatchPlan:
    """``plan`` for fewer ranks than ``w``, extended with empty shares (unchanged if complete)."""
    extra = w - len(plan.ranks)
    if extra == 0:
        return plan
    def pad(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros(extra, a.dtype)])

    return dataclasses.replace(
        plan, ranks=plan.ranks + [[] for _ in range(extra)],
        micro_batches=None if plan.micro_batches is None else plan.micro_batches + [[] for _ in range(extra)],
        loads=pad(plan.loads), tokens=pad(plan.tokens), padded_tokens=pad(plan.padded_tokens),
        loads_before=pad(plan.loads_before), padded_tokens_before=pad(plan.padded_tokens_before))
