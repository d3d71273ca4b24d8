"""`BaseBatch`: a batch of jagged and dense per-sample data with explicit padding.

A batch holds ``batch_size`` samples. Every tensor field is per-sample along
dimension 0:

* ``KeyedJaggedTensor`` fields (``features``, KJT ``labels`` and any KJT field a
  subclass adds) have stride ``batch_size``: ``len(lengths) == batch_size * K``.
* dense ``torch.Tensor`` fields (dense ``labels`` and any tensor field a
  subclass adds) have shape ``[batch_size, ...]``; the per-sample shape is kept.

Samples ``[0, actual_batch_size)`` are real, samples
``[actual_batch_size, batch_size)`` are padding: zero lengths in every KJT, zero
rows in every dense field. Padding is known from ``actual_batch_size``, never
inferred from lengths: a real sample may have only empty sequences.

Users subclass ``BaseBatch`` to add fields::

    @dataclasses.dataclass(kw_only=True)
    class MyBatch(BaseBatch):
        dense: torch.Tensor            # [batch_size, 13]

Fields are keyword-only, so a subclass may add fields without defaults.
Non-tensor fields (``feature_to_max_seqlen``, ...) are carried over unchanged by
every operation. A field that holds tensors in another form (a dict or list of
tensors, a ``JaggedTensor``, a ``KeyedTensor``) is refused: a shuffle would
leave its rows behind while the samples move. Declare one ``torch.Tensor``
field per feature, or a KJT; such a container whose tensors describe the whole
batch rather than its samples may opt out with
``dataclasses.field(metadata={"balancer": "carry"})``: a shuffle, ``index_select``
and ``pad_batch`` carry it over unchanged, while ``to()``, ``pin_memory()`` and
``record_stream()`` reach the tensors inside it (dicts, lists, tuples,
``JaggedTensor``, ``KeyedTensor``), so the pipeline's copy to the device takes
them along. A ``torch.Tensor`` field is always per sample, marked or not.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Pipelineable

from balancer._ints import as_count, is_int
from balancer._kjt import kjt_index_select
from balancer._padding import padding_like  # noqa: F401 - public here too
from balancer._pinned import filled_like, grown, new_full
from balancer._trust import CHECK_CONTENTS, replace_unchecked, trusted  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

__all__ = ["BaseBatch", "pad_batch", "padding_like"]

_B = TypeVar("_B", bound="BaseBatch")


@dataclasses.dataclass(kw_only=True)
class BaseBatch(Pipelineable):
    """A batch of per-sample KJT and dense fields with explicit padding.

    Attributes:
        features: sparse/sequence features, stride ``batch_size``, unique keys.
        batch_size: number of samples (real + padding); every tensor field's
            batch dimension.
        feature_to_max_seqlen: maximum sequence length per feature name (used by
            models to size attention); carried over unchanged.
        contextual_feature_names: keys of ``features`` that are per-user context
            rather than the sequence itself; must be keys of ``features``.
        labels: per-sample labels: a KJT of stride ``batch_size``, a dense
            tensor ``[batch_size, ...]``, or ``None``.
        actual_batch_size: number of real samples, ``0 <= actual_batch_size <=
            batch_size``; defaults to ``batch_size``. Samples from
            ``actual_batch_size`` on are padding.

    Raises:
        ValueError: on any violated invariant; the message names the field,
            the value and the expectation. Padding *contents* (zero lengths,
            zero rows) are checked only when the data is on the CPU, where the
            check costs no device synchronisation; see :meth:`validate`.
    """

    features: KeyedJaggedTensor
    batch_size: int
    feature_to_max_seqlen: dict[str, int]
    contextual_feature_names: list[str] = dataclasses.field(default_factory=list)
    labels: KeyedJaggedTensor | torch.Tensor | None = None
    actual_batch_size: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.batch_size):
            raise TypeError(f"batch_size must be an int, got {type(self.batch_size).__name__}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}, expected >= 1")
        if self.actual_batch_size is None:
            self.actual_batch_size = self.batch_size
        a = as_count(self.actual_batch_size)
        if a is None or not 0 <= a <= self.batch_size:
            raise ValueError(
                f"actual_batch_size={self.actual_batch_size!r}, expected an int with "
                f"0 <= actual_batch_size <= batch_size={self.batch_size}"
            )
        self.actual_batch_size = a
        if not isinstance(self.features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(self.features).__name__}")
        self._refuse_hidden_tensors()
        keys = self.features.keys()
        missing = [n for n in self.contextual_feature_names if n not in keys]
        if missing:
            raise ValueError(f"contextual_feature_names {missing} are not keys of features {keys}")
        self.validate(contents=self._on_cpu() and CHECK_CONTENTS.get())

    def _refuse_hidden_tensors(self) -> None:
        """A field holding tensors that are neither a ``torch.Tensor`` nor a KJT would stay
        behind in a shuffle: its rows would then belong to other samples, silently."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, KeyedJaggedTensor)) or f.name in _SETTINGS or _is_carry(f):
                continue
            if _holds_tensors(v):
                raise TypeError(
                    f"field {f.name!r} holds tensors in a {type(v).__name__}: a shuffle moves only torch.Tensor "
                    "[batch_size, ...] and KeyedJaggedTensor fields with their samples, and would leave its rows "
                    "behind; declare one torch.Tensor field per feature (or a KeyedJaggedTensor), or, for tensors "
                    "that describe the whole batch, dataclasses.field(metadata={'balancer': 'carry'})")

    # ------------------------------------------------------------------ fields
    def kjt_fields(self) -> dict[str, KeyedJaggedTensor]:
        """The KJT fields by name (``features`` first), in declaration order."""
        return {n: v for n, v in self._fields() if isinstance(v, KeyedJaggedTensor)}

    def dense_fields(self) -> dict[str, torch.Tensor]:
        """The dense per-sample tensor fields by name, in declaration order."""
        return {n: v for n, v in self._fields() if isinstance(v, torch.Tensor)}

    def _fields(self) -> Iterator[tuple[str, Any]]:
        for f in dataclasses.fields(self):
            yield f.name, getattr(self, f.name)

    def _on_cpu(self) -> bool:
        return self.features.values().device.type == "cpu"

    @property
    def device(self) -> torch.device:
        """Device of the batch (that of ``features``)."""
        return self.features.values().device

    @property
    def num_padding(self) -> int:
        """Number of padding samples, ``batch_size - actual_batch_size``."""
        assert self.actual_batch_size is not None, "set in __post_init__"
        return self.batch_size - self.actual_batch_size

    # -------------------------------------------------------------- validation
    def validate(self, contents: bool = True) -> None:
        """Check the batch invariants.

        Args:
            contents: also check that padding samples have zero lengths and
                zero dense rows (reads the data; a device sync on CUDA).

        Raises:
            ValueError: naming the field, the value and the expectation.
        """
        b = self.batch_size
        for name, kjt in self.kjt_fields().items():
            keys = kjt.keys()
            if len(set(keys)) != len(keys):
                raise ValueError(f"{name}: duplicate keys in {keys}")
            if kjt.variable_stride_per_key():
                raise ValueError(f"{name}: variable-stride (VBE) KJTs are not supported")
            n = kjt.lengths().numel()
            if n != b * len(keys):
                raise ValueError(
                    f"{name}: len(lengths)={n}, expected batch_size * num_keys = "
                    f"{b} * {len(keys)} = {b * len(keys)}"
                )
        for name, t in self.dense_fields().items():
            if t.dim() == 0 or t.shape[0] != b:
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)}, expected [batch_size={b}, ...]"
                )
        self._check_one_device()
        for k, v in self.feature_to_max_seqlen.items():
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"feature_to_max_seqlen[{k!r}]={v!r}, expected an int >= 0")
        if contents and self.num_padding > 0:
            self._validate_padding()

    def _check_one_device(self) -> None:
        """Every tensor on the device of ``features``' values (a field elsewhere failed in
        phase 2 on its rank with an error that named neither it nor its device)."""
        home = self.features.values().device
        tensors: list[tuple[str, torch.Tensor | None]] = []
        for name, kjt in self.kjt_fields().items():
            tensors += [(f"{name}.values", kjt.values()), (f"{name}.lengths", kjt.lengths()),
                        (f"{name}.weights", kjt.weights_or_none())]
        tensors += list(self.dense_fields().items())
        for name, t in tensors:
            if t is not None and t.device != home:
                raise ValueError(f"{name} is on {t.device}, expected features.values' device {home} "
                                 "(every tensor of a batch lives on one device)")

    def _validate_padding(self) -> None:
        a, b = self.batch_size - self.num_padding, self.batch_size
        for name, kjt in self.kjt_fields().items():
            tail = kjt.lengths().view(-1, b)[:, a:]
            if bool(tail.any()):
                key_idx, sample = (tail != 0).nonzero()[0].tolist()
                raise ValueError(
                    f"{name}: padding sample {a + sample} (actual_batch_size={a}) has "
                    f"length {int(tail[key_idx, sample])} for key {kjt.keys()[key_idx]!r}, "
                    "expected 0"
                )
        for name, t in self.dense_fields().items():
            tail = t[a:]
            if tail.numel() and bool(tail.reshape(tail.shape[0], -1).any()):
                row = int(tail.reshape(tail.shape[0], -1).any(dim=1).nonzero()[0])
                raise ValueError(
                    f"{name}: padding row {a + row} (actual_batch_size={a}) is not zero"
                )

    # -------------------------------------------------------------- transforms
    def map_tensors(
        self: _B,
        kjt_fn: Callable[[KeyedJaggedTensor], KeyedJaggedTensor],
        dense_fn: Callable[[torch.Tensor], torch.Tensor],
        **changes: Any,
    ) -> _B:
        """A new batch with ``kjt_fn``/``dense_fn`` applied to every tensor field.

        Non-tensor fields are carried over; ``changes`` overrides fields (e.g.
        ``batch_size``, ``actual_batch_size``). The result is validated.
        """
        new: dict[str, Any] = {}
        for name, v in self._fields():
            if isinstance(v, KeyedJaggedTensor):
                new[name] = kjt_fn(v)
            elif isinstance(v, torch.Tensor):
                new[name] = dense_fn(v)
        new.update(changes)
        return dataclasses.replace(self, **new)

    def to(self: _B, device: torch.device, non_blocking: bool = False,
           data_copy_stream: torch.Stream | None = None) -> _B:
        """Copy every tensor field to ``device``.

        ``data_copy_stream`` (TorchRec's ``enable_inplace_copy_batch``): the
        copies run on that stream; TorchRec then records no stream for the
        batch, so the stream current at the call is recorded on every output
        tensor here, keeping the memory from reuse while it works on them.
        """
        if data_copy_stream is not None:
            module = torch.get_device_module(torch.device(device).type)
            current = module.current_stream(device)
            with module.stream(data_copy_stream):
                out = self.to(device, non_blocking)
            out.record_stream(current)
            return out
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, non_blocking=non_blocking)

        return self.map_tensors(lambda k: k.to(device=device, non_blocking=non_blocking), move,
                                **self._map_carried(move))

    def _map_carried(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
        """Every ``carry`` field with ``fn`` applied to each tensor inside it (rebuilt
        by ``torch.utils._pytree``: dicts, lists, tuples, ``JaggedTensor``, ``KeyedTensor``)."""
        return {n: pytree.tree_map_only(torch.Tensor, fn, v) for n, v in self._carried().items()}

    def _carried(self) -> dict[str, Any]:
        """The fields marked ``carry``, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if _is_carry(f)}

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every CUDA tensor as used on ``stream``; a no-op on the CPU."""
        if self.device.type != "cuda":
            return
        for kjt in self.kjt_fields().values():
            kjt.record_stream(stream)  # type: ignore[arg-type]
        for t in self.dense_fields().values():
            t.record_stream(stream)  # type: ignore[arg-type]
        for t in pytree.tree_leaves(list(self._carried().values())):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(stream)  # type: ignore[arg-type]

    def pin_memory(self: _B) -> _B:
        """Pinned-memory copy when CUDA is available, else ``self``."""
        if not torch.cuda.is_available() or self.device.type != "cpu":
            return self
        def pin(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory() if t.device.type == "cpu" else t

        return self.map_tensors(lambda k: k.pin_memory(), pin, **self._map_carried(pin))

    def index_select(self: _B, indices: torch.Tensor, actual_batch_size: int | None = None) -> _B:
        """Select samples along the batch dimension.

        Example: a batch of 4 samples with ``actual_batch_size=3`` and
        ``indices=[2, 0, 3]`` gives a batch of 3 samples ``[s2, s0, pad]`` with
        ``actual_batch_size=2``.

        Args:
            indices: [M] int64 indices in ``[0, batch_size)``. Real samples must
                come before padding ones in the selection.
            actual_batch_size: number of real samples in the result. ``None``
                counts the selected indices below ``self.actual_batch_size``
                (reads ``indices``: a sync on CUDA).

        Returns:
            A batch of ``batch_size = M``; KJT weights are kept; dense fields
            keep their per-sample shape.

        Raises:
            ValueError: if M == 0, or (when counting) padding precedes a real
                sample.
        """
        m = int(indices.numel())
        if m == 0:
            raise ValueError("index_select: indices is empty, expected >= 1 index")
        if actual_batch_size is None:
            real = indices.cpu() < int(self.actual_batch_size or 0)
            actual_batch_size = int(real.sum())
            if actual_batch_size and not bool(real[:actual_batch_size].all()):
                raise ValueError(
                    "index_select: a padding sample precedes a real one in indices; "
                    "real samples must come first"
                )
        idx = indices.to(device=self.device, dtype=torch.int64)
        return self.map_tensors(
            lambda k: kjt_index_select(k, idx),
            lambda t: t.index_select(0, idx.to(t.device)),
            batch_size=m,
            actual_batch_size=actual_batch_size,
        )


def _pad_kjt(kjt: KeyedJaggedTensor, batch_size: int) -> KeyedJaggedTensor:
    lengths = kjt.lengths()
    k = len(kjt.keys())
    n = kjt.stride()
    out = new_full(lengths, (k, batch_size))  # pinned where the input is (balancer._pinned)
    out[:, :n] = lengths.view(k, n)
    # Padding samples have zero length, so values and weights are unchanged, and so are
    # the per-key lengths where the input has them cached (TorchRec's input dist reads
    # them; on a device KJT without them that is a host sync).
    return KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values(), weights=kjt.weights_or_none(), lengths=out.view(-1),
        stride=batch_size,  # a KJT without keys has no lengths to infer it from
        length_per_key=kjt.length_per_key_or_none(), offset_per_key=kjt.offset_per_key_or_none(),
    )


def pad_batch(batch: _B, batch_size: int) -> _B:
    """Pad an incomplete batch with padding samples up to ``batch_size``.

    Example: a last batch of 3 real samples padded to 4 has ``batch_size=4``,
    ``actual_batch_size=3``; sample 3 has zero lengths and zero dense rows.

    Args:
        batch: a batch whose samples are all real (``actual_batch_size ==
            batch.batch_size``) or already padded (its padding is kept).
        batch_size: target size, ``>= batch.batch_size``.

    Returns:
        A batch of ``batch_size`` samples with the same real samples.

    Raises:
        ValueError: if ``batch_size`` is not an int ``>= batch.batch_size``, or
            a field does not hold ``batch.batch_size`` samples (one replaced
            after construction: padding it would turn real samples into padding).
    """
    try:
        batch.validate(contents=False)  # shapes only: no device sync
    except ValueError as e:
        raise ValueError(f"pad_batch: {e}") from None
    size = as_count(batch_size)  # numpy ints too; not floats, strings or bools
    if size is None or size < batch.batch_size:
        raise ValueError(
            f"pad_batch: batch_size={batch_size!r}, expected an int >= the batch's "
            f"batch_size={batch.batch_size}"
        )
    batch_size = size
    if batch_size == batch.batch_size:
        return batch
    return batch.map_tensors(
        lambda k: _pad_kjt(k, batch_size),
        lambda t: grown(t, batch_size),
        batch_size=batch_size,
        actual_batch_size=batch.actual_batch_size,
    )


def base_padding(batch: BaseBatch) -> BaseBatch:
    """:func:`~balancer._padding.padding_like` of a ``BaseBatch`` (public as
    ``balancer.padding_like``, which takes either batch type)."""
    b = batch.batch_size

    def kjt(k: KeyedJaggedTensor) -> KeyedJaggedTensor:
        w = k.weights_or_none()
        keys = len(k.keys())
        # Per-key lengths known on the host: TorchRec's input dist reads them, and would
        # read them from the device otherwise (a sync on every step of an exhausted rank).
        return KeyedJaggedTensor(keys=k.keys(), values=k.values().new_empty(0),
                                 weights=None if w is None else w.new_empty(0),
                                 lengths=filled_like(k.lengths()), stride=b,
                                 length_per_key=[0] * keys, offset_per_key=[0] * (keys + 1))
    return batch.map_tensors(kjt, filled_like, actual_batch_size=0)


# Checked by validate() with their own messages.
_SETTINGS = frozenset({"feature_to_max_seqlen", "contextual_feature_names"})
_PLAIN = frozenset({int, float, str, bool, bytes, type(None)})
# Elements of a container looked at: with every element checked, a batch with a
# per-sample list of 65,536 ints took 131 ms per replace_unchecked, 0.07 ms with 8 (a
# reviewer's script, both versions on this box); a container of tensors shows one
# among its first few.
_PEEK = 8


def _is_carry(f: dataclasses.Field[Any]) -> bool:
    """Whether field ``f`` is marked ``metadata={"balancer": "carry"}`` (module docstring)."""
    return f.metadata.get("balancer") == "carry"


def _holds_tensors(v: Any, depth: int = 0) -> bool:
    """Whether ``v`` is, or holds among the first ``_PEEK`` elements of its dicts, lists,
    tuples and sets (two levels deep), a tensor, a KJT, a ``JaggedTensor`` or a
    ``KeyedTensor``."""
    if type(v) in _PLAIN:
        return False
    if isinstance(v, (torch.Tensor, KeyedJaggedTensor, JaggedTensor, KeyedTensor)):
        return True
    if depth < 2 and isinstance(v, dict):
        return any(_holds_tensors(x, depth + 1) for x in itertools.islice(v.values(), _PEEK))
    if depth < 2 and isinstance(v, (list, tuple, set, frozenset)):
        return any(_holds_tensors(x, depth + 1) for x in itertools.islice(v, _PEEK))
    return False
