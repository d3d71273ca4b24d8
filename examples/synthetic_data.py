"""Synthetic user histories for the HSTU example: variable-length, per-rank data.

Every sample is one user: a history of ``L`` (item id, action id) pairs, four
dense user features and a binary label. ``L`` follows a chosen distribution, so
some ranks draw much longer histories than others in the same step: exactly
the straggler the balancer removes.

Data is deterministic per ``(seed, rank)``. Each rank yields ``num_batches``
batches; the last one holds fewer real samples and is padded with
:func:`balancer.pad_batch` (every rank holds the same number here; the balanced
pipeline also runs uneven loaders, whose ranks stop together).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer import BaseBatch, pad_batch

ITEM_FEATURE = "item_ids"
ACTION_FEATURE = "action_ids"
DENSE_DIM = 4
DISTRIBUTIONS = ("uniform", "normal", "zipf", "lognormal")


@dataclasses.dataclass(kw_only=True)
class HSTUBatch(BaseBatch):
    """A batch of user histories: ``features`` holds ``item_ids`` and
    ``action_ids`` (equal lengths per sample), ``labels`` is float ``[B]``.

    Attributes:
        dense: ``[B, 4]`` float user features (zero rows for padding).
    """

    dense: torch.Tensor


def sample_lengths(
    rng: np.random.Generator, dist: str, n: int, max_seqlen: int
) -> np.ndarray:
    """``n`` history lengths in ``[1, max_seqlen]`` drawn from ``dist``.

    * ``uniform``: every length equally likely.
    * ``normal``: mean ``max/2``, standard deviation ``max/6``.
    * ``zipf``: ``P(L) ~ L**-1.1`` on ``[1, max]`` -- mostly short, a few long.
    * ``lognormal``: median ``max/8``, sigma 1 -- a long right tail.
    """
    if dist == "uniform":
        x = rng.integers(1, max_seqlen + 1, n).astype(np.float64)
    elif dist == "normal":
        x = rng.normal(max_seqlen / 2, max_seqlen / 6, n)
    elif dist == "zipf":
        p = np.arange(1, max_seqlen + 1, dtype=np.float64) ** -1.1
        x = (rng.choice(max_seqlen, n, p=p / p.sum()) + 1).astype(np.float64)
    elif dist == "lognormal":
        x = rng.lognormal(np.log(max_seqlen / 8), 1.0, n)
    else:
        raise ValueError(f"dist={dist!r}, expected one of {list(DISTRIBUTIONS)}")
    return np.clip(np.rint(x), 1, max_seqlen).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class SyntheticHSTUData:
    """An iterable of :class:`HSTUBatch` for one rank.

    Attributes:
        rank: this rank; seeds the data with ``seed``.
        batch_size: samples per batch (real + padding).
        num_batches: batches per epoch; the last is incomplete and padded.
        dist: length distribution, one of :data:`DISTRIBUTIONS`.
        max_seqlen: longest history.
        num_items: item id vocabulary.
        num_actions: action id vocabulary.
        seed: base seed.
        last_batch_fill: fraction of real samples in the last batch.
    """

    rank: int
    batch_size: int
    num_batches: int
    dist: str = "lognormal"
    max_seqlen: int = 256
    num_items: int = 10_000
    num_actions: int = 8
    seed: int = 0
    last_batch_fill: float = 0.5

    def __post_init__(self) -> None:
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"dist={self.dist!r}, expected one of {list(DISTRIBUTIONS)}")
        for name in ("batch_size", "num_batches", "max_seqlen", "num_items", "num_actions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}, expected >= 1")
        if not 0.0 < self.last_batch_fill <= 1.0:
            raise ValueError(f"last_batch_fill={self.last_batch_fill}, expected in (0, 1]")

    def __iter__(self) -> Iterator[HSTUBatch]:
        rng = np.random.default_rng([self.seed, self.rank])
        # Hidden "taste" per item id modulo 97, shared by all ranks: labels are
        # learnable from the history and the dense features.
        taste = np.random.default_rng([self.seed, 1 << 20]).normal(0.0, 1.0, 97)
        for step in range(self.num_batches):
            last = step == self.num_batches - 1
            n = max(1, round(self.batch_size * self.last_batch_fill)) if last else self.batch_size
            batch = self._make_batch(rng, taste, n)
            yield pad_batch(batch, self.batch_size)

    def _make_batch(self, rng: np.random.Generator, taste: np.ndarray, n: int) -> HSTUBatch:
        lengths = sample_lengths(rng, self.dist, n, self.max_seqlen)
        total = int(lengths.sum())
        items = rng.integers(0, self.num_items, total)
        actions = rng.integers(0, self.num_actions, total)
        dense = rng.normal(0.0, 1.0, (n, DENSE_DIM))
        seg = np.repeat(np.arange(n), lengths)
        score = np.bincount(seg, taste[items % 97] * (actions > 0), minlength=n) / lengths
        logit = 2.0 * score + dense[:, 0] - 0.5 * dense[:, 1]
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        lengths_t = torch.from_numpy(np.concatenate([lengths, lengths]))
        features = KeyedJaggedTensor(
            keys=[ITEM_FEATURE, ACTION_FEATURE],
            values=torch.from_numpy(np.concatenate([items, actions])),
            lengths=lengths_t,
        )
        return HSTUBatch(
            features=features,
            batch_size=n,
            feature_to_max_seqlen={ITEM_FEATURE: self.max_seqlen, ACTION_FEATURE: self.max_seqlen},
            labels=torch.from_numpy(labels),
            dense=torch.from_numpy(dense.astype(np.float32)),
        )
