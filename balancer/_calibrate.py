"""Online calibration: fit the cost model to the compute times ranks measure (numpy only).

A cost model is a guess; every rank knows, step after step, how long its own
compute took. Each rank reports that time with a later phase-1 message; the
planner records, for every shuffle, what each rank received:

    F[r] = sum over rank r's real samples of  [w, L**2, L, 1]

where ``w`` is ``workload_fn``'s cost and ``L`` the sample's total length (every
KJT key, or ``seq_lens``). :class:`OnlineFit` fits

    time[r] = c0 + alpha * sum(w) + beta * sum(L**2) + gamma * sum(L) + delta * n

by non-negative least squares on relative residuals over a window of recent
(rank, shuffle) observations, twice, dropping observations whose relative
residual exceeds 3 robust standard deviations (a rank that was preempted, a
step with a checkpoint). Directions the data cannot tell apart -- a
per-sample constant when every rank has the same count, ``alpha`` and
``gamma`` when ``workload_fn`` is the length -- may be split either way; they
change no partition. The
per-sample model ``alpha w + beta L**2 + gamma L + delta`` then replaces
``workload_fn``'s cost in later partitions; ``c0`` (per-step overhead) does not
depend on placement and is not used. With an exact ``workload_fn`` the fit
keeps ``alpha``; with a wrong one the length terms take over.

Every rank has the same observations (the features come from the gathered
data, the times from the gathered headers) and runs the same arithmetic, so
every rank gets the same model: the partitions stay identical.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from balancer._header import H_MEAS_SEQ, H_MEAS_TIME

__all__ = ["CalibrationState", "CostModel", "OnlineFit", "features", "nnls_small"]

FEATURES = ("w", "L^2", "L", "1")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-sample seconds ``alpha * w + beta * L**2 + gamma * L + delta`` (plus ``c0`` per step).

    Attributes:
        alpha, beta, gamma, delta: coefficients (>= 0).
        c0: per-step constant (seconds), not used for balancing.
        observations: (rank, shuffle) pairs the fit used (after outlier rejection).
        rel_error: median relative residual of the fit over those observations.
    """

    alpha: float
    beta: float
    gamma: float
    delta: float
    c0: float
    observations: int
    rel_error: float

    def costs(self, w: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Per-sample costs (seconds) for workloads ``w`` and total lengths ``lengths``."""
        x = lengths.astype(np.float64)
        return self.alpha * w + (self.beta * x + self.gamma) * x + self.delta


def features(workloads: np.ndarray, lengths: np.ndarray, dest: np.ndarray, real: np.ndarray,
             world_size: int) -> np.ndarray:
    """[W, 4] per-rank sums of ``[w, L**2, L, 1]`` over the real samples it receives.

    Args:
        workloads: [W * B] workload_fn costs (0 for padding).
        lengths: [W * B] total length per sample.
        dest: [W * B] destination rank.
        real: [W * B] bool, real samples.
    """
    x = lengths.astype(np.float64)
    cols = np.stack([workloads, x * x, x, np.ones_like(x)], axis=1)[real]
    out = np.zeros((world_size, len(FEATURES)))
    np.add.at(out, dest[real], cols)
    return out


# OnlineFit.fit drops times below this fraction of the window's median time.
_MIN_REL_TIME = 1e-6
_ROUNDS = 8  # outlier rejection rounds at most


def nnls_small(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns: the best unconstrained
    fit among all supports whose coefficients are all >= 0 (deterministic)."""
    n = a.shape[1]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    scaled = a / norms
    best, best_res = np.zeros(n), float(y @ y)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sol = np.linalg.lstsq(scaled[:, cols], y, rcond=None)[0]
            if (sol < 0).any():
                continue
            res = float(np.sum((scaled[:, cols] @ sol - y) ** 2))
            if res < best_res:
                best, best_res = np.zeros(n), res
                best[list(cols)] = sol
    return best / norms


class OnlineFit:
    """Observations of one shuffler on one group, and the fit over them.

    ``record(seq, feats)`` keeps each shuffle's per-rank features (for up to
    ``history`` shuffles back); ``observe(seq_by_rank, seconds_by_rank)`` pairs
    the times ranks reported with those features; ``fit()`` returns the
    current :class:`CostModel`, or ``None`` until ``min_observations`` pairs.
    """

    def __init__(self, window: int = 256, history: int = 16, min_observations: int = 16) -> None:
        self._features: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._rows: collections.deque[np.ndarray] = collections.deque(maxlen=window)
        self._times: collections.deque[float] = collections.deque(maxlen=window)
        self._seen: set[tuple[int, int]] = set()
        self.history, self.min_observations = history, min_observations

    def record(self, seq: int, feats: np.ndarray) -> None:
        self._features[seq] = feats
        while len(self._features) > self.history:
            old, _ = self._features.popitem(last=False)
            self._seen = {k for k in self._seen if k[1] != old}

    def observe(self, seqs: np.ndarray, seconds: np.ndarray) -> None:
        """Rank r measured ``seconds[r]`` for its output of shuffle ``seqs[r]`` (-1: nothing new)."""
        for r, (seq, t) in enumerate(zip(seqs.tolist(), seconds.tolist(), strict=True)):
            if seq < 0 or (r, seq) in self._seen or seq not in self._features or not np.isfinite(t) or t <= 0:
                continue
            self._seen.add((r, seq))
            self._rows.append(self._features[seq][r])
            self._times.append(t)

    @property
    def observations(self) -> int:
        """(rank, shuffle) times paired with their features so far (within the window)."""
        return len(self._times)

    def fit(self) -> CostModel | None:
        if len(self._times) < self.min_observations:
            return None
        feats = np.array(self._rows)
        y = np.array(self._times)
        # A time a million times below the median is a misread clock, not a
        # step: 1/y of a denormal (5e-324 s) overflowed the relative rows to
        # inf, and every later fit raised LinAlgError (or found nothing).
        sane = y >= np.median(y) * _MIN_REL_TIME
        feats, y = feats[sane], y[sane]
        if y.size < self.min_observations:
            return None
        # Relative residuals: timing noise grows with the time, and a fit in
        # absolute terms would be decided by the slowest ranks alone.
        a = np.concatenate([np.ones((feats.shape[0], 1)), feats], axis=1) / y[:, None]  # c0, then the features
        target = np.ones(y.size)
        keep = np.ones(y.size, bool)
        # Rejection rounds until the kept set settles (at most _ROUNDS). With
        # two rounds, one step reported 10-100x too short (its row weighs 1 /
        # time) pulled the first fit towards it, and ~8 good observations were
        # dropped in its place: cost differences 2 % -> 10-12 % off in the
        # median of 20 seeds; until settled 4-6 %, and 2.5-3 % with 4 such steps.
        for _ in range(_ROUNDS):
            coef = nnls_small(a[keep], target[keep])
            res = a @ coef - target
            mad = float(np.median(np.abs(res[keep] - np.median(res[keep]))))
            kept = np.abs(res - np.median(res[keep])) <= 3 * max(1.4826 * mad, 1e-9)
            if kept.sum() < self.min_observations // 2:
                keep = np.ones(y.size, bool)
                break
            if np.array_equal(kept, keep):
                break
            keep = kept
        coef = nnls_small(a[keep], target[keep])
        rel = float(np.median(np.abs(a[keep] @ coef - target[keep])))
        c0, alpha, beta, gamma, delta = (float(c) for c in coef)
        if alpha + beta + gamma + delta <= 0:  # nothing per sample: keep the workload_fn
            return None
        return CostModel(alpha, beta, gamma, delta, c0, int(keep.sum()), rel)


class CalibrationState:
    """The shuffler's side of online calibration.

    On the calling thread, the latest compute time this rank reports (a
    number, or CUDA events read once complete, never waited for); on the
    background thread, per process group, the fit of the gathered times and
    the model later partitions use.
    """

    def __init__(self) -> None:
        self._measured: tuple[int, float] = (-1, 0.0)  # the latest compute time to report
        self._timing: tuple[int, list[tuple[Any, Any]]] | None = None  # CUDA events not yet complete
        self._refused = ""  # a bad report, raised by the next latest()
        self._fits: dict[str, OnlineFit] = {}  # background thread only
        self._models: dict[str, CostModel | None] = {}  # background thread only

    def report(self, seq: int, seconds: float | None, events: Sequence[tuple[Any, Any]]) -> None:
        """Shuffle ``seq``'s compute took ``seconds``, or the time between each ``(start, end)`` pair."""
        if seconds is not None:
            self._measured, self._timing = (seq, float(seconds)), None
        elif events:
            self._timing = (seq, list(events))

    def refuse(self, problem: str) -> None:
        """A report that is not one (``problem`` says why): the next :meth:`latest`
        raises it, so that it fails a shuffle on every rank, not a call on this one."""
        self._refused = problem

    def latest(self) -> tuple[int, float]:
        """``(shuffle, seconds)`` of the latest complete report, ``(-1, 0.0)`` before any.

        Raises:
            ValueError: a refused report, or reported events that cannot be timed
                (never recorded, made without ``enable_timing``); either is
                dropped, so a later call goes on with the previous report.
        """
        if self._refused:
            problem, self._refused = self._refused, ""
            raise ValueError(problem)
        if self._timing is not None:
            seq, pairs = self._timing
            try:
                if all(end.query() for _, end in pairs):  # never waits: read once complete
                    self._measured = (seq, sum(start.elapsed_time(end) for start, end in pairs) / 1e3)
                    self._timing = None
            except Exception as e:  # noqa: BLE001 - whatever the events raise, named in the error
                self._timing = None
                raise ValueError(f"record_compute: the events reported for shuffle #{seq} cannot be timed: "
                                 f"{type(e).__name__}: {e}") from e
        return self._measured

    def update(self, key: str, rows: np.ndarray, seq: int) -> OnlineFit:
        """Add the measurements in the gathered messages ``rows`` to group ``key``'s
        fit; refit every few shuffles (at the same shuffles on every rank, from
        the same data)."""
        fit = self._fits.setdefault(key, OnlineFit())
        fit.observe(rows[:, H_MEAS_SEQ].astype(np.int64), rows[:, H_MEAS_TIME].copy().view(np.float64))
        if seq % 4 == 0 or self._models.get(key) is None:
            self._models[key] = fit.fit()
        return fit

    def model(self, key: str) -> CostModel | None:
        """The model group ``key`` partitions with, ``None`` before the first fit."""
        return self._models.get(key)
