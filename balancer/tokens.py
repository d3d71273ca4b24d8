"""`TokenBatch`: token sequences without KJTs, padded or packed, with explicit padding.

LLM training loops hold per-token tensors in one of two layouts:

* **padded**: ``tokens[name]`` is ``[B, L, *shape]``; sample ``i`` owns its first
  ``seq_lens[i]`` positions, the rest is padding (right padding);
* **packed** (varlen): ``tokens[name]`` is ``[T, *shape]``, the samples'
  tokens back to back, ``T = sum(seq_lens)``; ``cu_seqlens()`` gives the
  boundaries that varlen attention kernels take.

Per-sample tensors (a reward, a prompt id, a loss weight) go in ``samples``
as ``[B, *shape]``. As in :class:`balancer.BaseBatch`, samples
``[0, actual_batch_size)`` are real and the rest are padding samples, with
``seq_lens == 0`` and zero rows.

:class:`balancer.BatchShuffler` moves ``TokenBatch`` es like KJT batches --
every real sample exactly once, only the valid tokens on the wire -- and
returns the same layout: a padded batch comes back padded to its longest
sample, rounded up to ``pad_multiple``.

Example::

    batch = TokenBatch(batch_size=4, seq_lens=torch.tensor([3, 5, 2, 0]), actual_batch_size=3,
                       tokens={"input_ids": ids, "labels": labels},    # [4, L]
                       samples={"advantage": adv})                      # [4]
    workload_fn = cost                      # a TransformerCost (or any estimator) prices seq_lens
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from balancer._ints import as_count, is_int
from balancer._pinned import grown

__all__ = ["TokenBatch"]


@dataclasses.dataclass(kw_only=True)
class TokenBatch:
    """A batch of token sequences (see the module docstring).

    Attributes:
        batch_size: samples, real and padding (B).
        seq_lens: [B] integer tokens per sample (0 for padding samples).
        tokens: per-token tensors by name: ``[B, L, *shape]`` (padded) or
            ``[T, *shape]`` (packed), all in the same layout.
        packed: the layout of ``tokens``.
        samples: per-sample tensors by name, ``[B, *shape]``.
        actual_batch_size: real samples (default ``batch_size``).
        pad_multiple: a shuffled padded batch is padded to its longest
            sample rounded up to this multiple (e.g. 8 for tensor cores).
        pad_values: per token field, the value of a padded batch's padding
            positions: beyond each sample's ``seq_lens``, and the rows of
            padding samples (default 0; e.g. ``{"labels": -100, "input_ids":
            pad_id}``). A shuffle's output holds it whether or not samples
            moved, and :meth:`pad` writes it. Unused by a packed batch.

    Raises:
        ValueError: on a shape that breaks the layout, naming the field, its
            shape and the expectation (shapes only: nothing is read).
    """

    batch_size: int
    seq_lens: torch.Tensor
    tokens: dict[str, torch.Tensor]
    packed: bool = False
    samples: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    actual_batch_size: int | None = None
    pad_multiple: int = 1
    pad_values: dict[str, int | float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        b = self.batch_size
        if not is_int(b, 1):
            raise ValueError(f"batch_size={b!r}, expected an int >= 1")
        if self.actual_batch_size is None:
            self.actual_batch_size = b
        a = as_count(self.actual_batch_size)
        if a is None or not 0 <= a <= b:
            raise ValueError(f"actual_batch_size={self.actual_batch_size!r}, expected an int with "
                             f"0 <= actual_batch_size <= batch_size={b}")
        self.actual_batch_size = a
        if not is_int(self.pad_multiple, 1):
            raise ValueError(f"pad_multiple={self.pad_multiple!r}, expected an int >= 1")
        s = self.seq_lens
        if not isinstance(s, torch.Tensor) or s.shape != (b,) or s.is_floating_point() or s.dtype == torch.bool:
            raise ValueError(f"seq_lens: {_describe(s)}, expected an integer tensor [batch_size={b}]")
        for field in ("tokens", "samples"):
            value = getattr(self, field)
            if not isinstance(value, dict):
                raise ValueError(f"{field}: a {type(value).__name__}, expected a dict of name -> tensor")
            bad = [k for k in value if not isinstance(k, str)]
            if bad:
                key = bad[0]
                raise ValueError(f"{field}: key {key!r} ({type(key).__name__}), expected str names")
        if not self.tokens:
            raise ValueError("tokens is empty, expected at least one per-token tensor")
        for name, t in self.tokens.items():
            lead = 1 if self.packed else 2
            if not isinstance(t, torch.Tensor) or t.dim() < lead or (not self.packed and t.shape[0] != b):
                want = "[T, ...]" if self.packed else f"[batch_size={b}, L, ...]"
                raise ValueError(f"tokens[{name!r}]: {_describe(t)}, expected {want}")
        lead_shapes = {tuple(t.shape[: (1 if self.packed else 2)]) for t in self.tokens.values()}
        if len(lead_shapes) > 1:
            raise ValueError(f"tokens have different leading shapes {sorted(lead_shapes)}; every per-token "
                             f"tensor needs the same {'[T]' if self.packed else '[B, L]'}")
        for name, t in self.samples.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != b:
                raise ValueError(f"samples[{name!r}]: {_describe(t)}, expected [batch_size={b}, ...]")
        for field in ("tokens", "samples"):
            for name, t in getattr(self, field).items():
                if t.device != s.device:
                    raise ValueError(f"{field}[{name!r}] is on {t.device}, expected seq_lens' device {s.device} "
                                     "(every tensor of a batch lives on one device)")
        problems = pad_value_problems(self.tokens, self.pad_values)
        if problems:
            raise ValueError(problems[0])

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor, tokens: dict[str, torch.Tensor], *,
                  samples: dict[str, torch.Tensor] | None = None, actual_batch_size: int | None = None,
                  pad_multiple: int = 1, pad_values: dict[str, int | float] | None = None) -> TokenBatch:
        """A padded batch from tensors whose valid tokens ``attention_mask`` marks, padded on
        the left, the right or both (an RL rollout: the prompt left-padded, the response
        right-padded).

        A padded ``TokenBatch`` holds sample ``i``'s tokens in its first ``seq_lens[i]``
        positions; this moves each row's valid tokens there, in their order, and writes
        ``pad_values`` behind them (device ops: nothing is read on the host).

        Args:
            attention_mask: ``[B, L]``, nonzero (or True) on valid tokens.
            tokens: per-token tensors ``[B, L, *shape]``; the others as in the class.

        Example: mask rows ``[0, 0, 1, 1, 0]`` and ``[1, 1, 1, 0, 0]`` give ``seq_lens``
        ``[2, 3]``, the first row's two tokens moved to positions 0 and 1.
        """
        m = attention_mask
        if not isinstance(m, torch.Tensor) or m.dim() != 2:
            raise ValueError(f"attention_mask: {_describe(m)}, expected [B, L]")
        if not isinstance(tokens, dict):
            raise ValueError(f"tokens: a {type(tokens).__name__}, expected a dict of name -> tensor")
        for name, t in tokens.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or tuple(t.shape[:2]) != tuple(m.shape):
                raise ValueError(f"tokens[{name!r}]: {_describe(t)}, expected [B, L, ...] with [B, L] = "
                                 f"attention_mask's {tuple(m.shape)}")
            if t.device != m.device:
                raise ValueError(f"tokens[{name!r}] is on {t.device}, expected attention_mask's {m.device}")
        pads = {} if pad_values is None else pad_values
        problems = pad_value_problems(tokens, pads)
        if problems:
            raise ValueError(problems[0])
        valid = m != 0
        # A stable sort of "is padding" puts each row's valid positions first, in order.
        order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices
        seq_lens = valid.sum(dim=1)
        beyond = padding_positions(seq_lens, m.shape[1])
        moved = {}
        for name, t in tokens.items():
            index = _per_token(order, t).expand(*order.shape, *t.shape[2:])
            moved[name] = fill_padding(t.gather(1, index), beyond, pads.get(name, 0))
        return cls(batch_size=int(m.shape[0]), seq_lens=seq_lens, tokens=moved,
                   samples={} if samples is None else samples, actual_batch_size=actual_batch_size,
                   pad_multiple=pad_multiple, pad_values=pads)

    @property
    def device(self) -> torch.device:
        """The device of ``seq_lens`` (every token field lives there too)."""
        return self.seq_lens.device

    @property
    def max_len(self) -> int:
        """L of a padded batch (its second dimension); the total T of a packed one."""
        t = next(iter(self.tokens.values()))
        return int(t.shape[0] if self.packed else t.shape[1])

    def cu_seqlens(self, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """``[B + 1]`` sample boundaries in the packed token dimension (a device op, no read)."""
        out = torch.zeros(self.batch_size + 1, dtype=dtype, device=self.device)
        torch.cumsum(self.seq_lens, 0, out=out[1:])
        return out

    def attention_mask(self) -> torch.Tensor:
        """``[B, L]`` bool, True on a padded batch's valid tokens (a device op, no read)."""
        if self.packed:
            raise ValueError("attention_mask: a packed batch has no padding; use cu_seqlens()")
        return ~padding_positions(self.seq_lens, self.max_len)

    def map_tensors(self, fn: Any, **changes: Any) -> TokenBatch:
        """A new batch with ``fn`` applied to every tensor; ``changes`` override fields."""
        new = dict(seq_lens=fn(self.seq_lens), tokens={k: fn(v) for k, v in self.tokens.items()},
                   samples={k: fn(v) for k, v in self.samples.items()})
        new.update(changes)
        return dataclasses.replace(self, **new)

    def to(self, device: torch.device, non_blocking: bool = False) -> TokenBatch:
        """Copy every tensor to ``device``."""
        return self.map_tensors(lambda t: t.to(device=device, non_blocking=non_blocking))

    def pin_memory(self) -> TokenBatch:
        """Pinned-memory copy when CUDA is available, else ``self``."""
        if not torch.cuda.is_available() or self.device.type != "cpu":
            return self
        return self.map_tensors(lambda t: t.pin_memory())

    def pad(self, batch_size: int) -> TokenBatch:
        """This batch with padding samples appended up to ``batch_size`` (zero
        ``seq_lens`` and ``samples`` rows, token rows of ``pad_values``; a packed
        batch's tokens are unchanged)."""
        size = as_count(batch_size)  # numpy ints too; not floats, strings or bools
        if size is None or size < self.batch_size:
            raise ValueError(f"pad: batch_size={batch_size!r}, expected an int >= the batch's {self.batch_size}")
        batch_size = size
        if batch_size == self.batch_size:
            return self

        # (pinned where the batch is: balancer._pinned)
        tokens = self.tokens if self.packed else {k: grown(v, batch_size, pad_value(self, k))
                                                  for k, v in self.tokens.items()}
        return dataclasses.replace(self, batch_size=batch_size, seq_lens=grown(self.seq_lens, batch_size),
                                   tokens=tokens, samples={k: grown(v, batch_size) for k, v in self.samples.items()})

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every CUDA tensor as used on ``stream``; a no-op on the CPU."""
        if self.device.type == "cuda":
            self.map_tensors(lambda t: t.record_stream(stream) or t)  # type: ignore[func-returns-value]


def padding_positions(seq_lens: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]`` bool, True beyond each sample's ``seq_lens`` (a device op, no read)."""
    return torch.arange(length, device=seq_lens.device)[None, :] >= seq_lens[:, None]


def fill_padding(t: torch.Tensor, beyond: torch.Tensor, value: int | float) -> torch.Tensor:
    """``t`` (``[B, L, *shape]``) with the positions ``beyond`` marks (``[B, L]``) set to ``value``."""
    return t.masked_fill(_per_token(beyond, t), value)


def _per_token(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` ``x`` viewed to broadcast over ``t``'s per-token dimensions."""
    return x.view(*x.shape, *([1] * (t.dim() - 2)))


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)} and dtype {t.dtype}"
    return f"a {type(t).__name__}"


def pad_value_problems(tokens: Any, pad_values: Any) -> list[str]:
    """What is wrong with ``pad_values`` for these ``tokens`` (empty: nothing):
    a dict naming token fields, each value a Python number the field's dtype
    holds (:func:`holds`)."""
    if not isinstance(pad_values, dict):
        return [f"pad_values: a {type(pad_values).__name__}, expected a dict of token field name -> value"]
    out = []
    for name, value in pad_values.items():
        t = tokens.get(name) if isinstance(tokens, dict) and isinstance(name, str) else None
        if not isinstance(t, torch.Tensor):
            names = sorted(k for k in tokens if isinstance(k, str)) if isinstance(tokens, dict) else []
            out.append(f"pad_values: key {name!r} names no token field, expected one of {names}")
            continue
        if not holds(t.dtype, value):
            out.append(f"pad_values[{name!r}]={value!r} ({type(value).__name__}), expected a Python number "
                       f"that tokens[{name!r}]'s dtype {t.dtype} holds")
    return out


def pad_value(batch: TokenBatch, name: str) -> int | float:
    """The padding value of token field ``name`` (0 where ``pad_values`` has none)."""
    return batch.pad_values.get(name, 0)


def holds(dtype: torch.dtype, value: Any) -> bool:
    """Whether ``dtype`` holds the Python number ``value``: exactly for integer and
    bool fields; for floating fields any int or float that does not overflow to
    an infinity (it rounds to the dtype, as ``torch.full`` does)."""
    if dtype == torch.bool:
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if dtype.is_floating_point or dtype.is_complex:
        return not math.isfinite(value) or abs(value) <= torch.finfo(dtype.to_real()).max
    if not isinstance(value, int):
        return False
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max
