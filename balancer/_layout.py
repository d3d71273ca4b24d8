"""How a batch travels: its fields as wire sections, and a schema every rank must share.

A batch is a set of per-sample tensors. On the wire each tensor is a *section*:

* a KJT field's ``values`` (and ``weights``): jagged, sample ``i`` of key ``k``
  holds ``lengths[k, i]`` elements, stored key-major (all samples of key 0,
  then key 1, ...);
* a dense field ``[B, *shape]``: every sample holds ``width = prod(shape)``
  elements, stored sample-major;
* a :class:`~balancer.tokens.TokenBatch` token field: jagged by ``seq_lens``
  with ``width = prod(per-token shape)`` elements per token, stored back to
  back (packed) or in fixed per-sample slots of ``stride = L * width``
  elements (``padded``; only the valid prefix travels; ``L`` may be 0).

The per-sample lengths (every KJT key, or a token batch's ``seq_lens``) form
one ``[K_total, B]`` matrix; a jagged section owns rows ``[row, row + count)``
of it. The lengths never travel in phase 2: every rank learns all of them in
phase 1, so every size of phase 2 is a host integer.

:func:`wire_layout` re-derives all of this from the batch's tensors at every
shuffle -- nothing is trusted from construction -- and :func:`layout_problems`
reports what makes a batch unshufflable (a dense field whose first dimension is
not ``B``, values that do not match their lengths, ...) without raising, so the
rank can still tell its peers.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any, Literal

import torch

from balancer._ints import is_int
from balancer._plan_layout import KJTPlan, PlanLayout, SectionPlan
from balancer.tokens import TokenBatch, holds, pad_value_problems

if TYPE_CHECKING:  # the token path runs without TorchRec (balancer._torchrec)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "OPAQUE", "DenseSpec", "KJTSpec", "Section", "WireLayout", "fingerprint", "layout_problems",
    "lengths_tensors", "opaque", "section_name", "wire_layout",
]

OPAQUE = {8: torch.int64, 4: torch.int32, 2: torch.float16, 1: torch.uint8}
"""Per element size, the dtype whose bits a gather copies (see :func:`opaque`)."""


@dataclasses.dataclass(frozen=True)
class KJTSpec:
    """One KJT field: its ``keys`` own rows ``[row, row + len(keys))`` of the
    ``[K_total, B]`` lengths matrix."""

    name: str
    keys: tuple[str, ...]
    row: int
    lengths_dtype: torch.dtype
    values_dtype: torch.dtype
    weights_dtype: torch.dtype | None


@dataclasses.dataclass(frozen=True)
class DenseSpec:
    """One dense field ``[B, *shape]``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Section:
    """One tensor of the batch on the wire.

    Attributes:
        field: the batch field it belongs to.
        part: ``"values"`` or ``"weights"`` of a KJT field, ``"dense"`` (a dense
            field of a ``BaseBatch``), ``"tokens"`` or ``"samples"`` (the
            per-token and per-sample tensors of a ``TokenBatch``).
        dtype: its dtype; ``itemsize`` its element size in bytes.
        row: first row of its keys in the lengths matrix (``-1`` if not jagged).
        count: number of keys (1 if not jagged).
        width: elements per length unit (jagged; 1 for KJTs) or per sample.
        stride: elements per sample slot of a padded token field (0 for
            the others, and for a padded one whose ``L`` or width is 0).
        padded: a padded token field (fixed per-sample slots); else the
            samples are stored back to back. Not ``stride > 0``: a padded
            batch of empty sequences has ``L = 0``.
    """

    field: str
    part: Literal["values", "weights", "dense", "tokens", "samples"]
    dtype: torch.dtype
    itemsize: int
    row: int
    count: int
    width: int
    stride: int = 0
    padded: bool = False

    @property
    def jagged(self) -> bool:
        return self.part in ("values", "weights", "tokens")


@dataclasses.dataclass(frozen=True)
class WireLayout:
    """A batch's wire format and its schema.

    Attributes:
        batch_class: ``module.qualname`` of the batch type.
        batch_size: samples per batch, B.
        kjts: KJT fields in declaration order.
        dense: dense fields in declaration order.
        sections: every tensor, KJT fields first (values, then weights), then dense.
        num_lengths: K_total, rows of the lengths matrix.
        fingerprint: int64 hash of :meth:`describe`; equal on two ranks iff their
            batches can be merged sample by sample.
    """

    batch_class: str
    batch_size: int
    kjts: tuple[KJTSpec, ...]
    dense: tuple[DenseSpec, ...]
    sections: tuple[Section, ...]
    num_lengths: int
    fingerprint: int
    tokens: tuple[DenseSpec, ...] = ()  # a TokenBatch's per-token fields (shape: per token)
    seq_lens_dtype: torch.dtype | None = None  # a TokenBatch's; None for a BaseBatch
    pad_multiple: int = 1
    token_pads: tuple[int | float | bool, ...] = ()  # a padded TokenBatch's pad value per token field
    # A BaseBatch's rank-independent settings (contextual_feature_names, feature_to_max_seqlen),
    # as described: every rank must hold the same, since samples travel without them.
    settings: tuple[tuple[str, str], ...] = ()

    @property
    def is_tokens(self) -> bool:
        return self.seq_lens_dtype is not None

    def plan_layout(self) -> PlanLayout:
        """The numpy view the planner works with (picklable without torch)."""
        rows: tuple[KJTPlan, ...]
        if self.is_tokens:  # seq_lens play the part of a one-key KJT's lengths
            rows = (KJTPlan(0, 1, self.seq_lens_dtype == torch.int32),)
        else:
            rows = tuple(KJTPlan(k.row, len(k.keys), k.lengths_dtype == torch.int32) for k in self.kjts)
        return PlanLayout(
            self.batch_size, self.num_lengths,
            tuple(SectionPlan(s.jagged, s.row, s.count, s.itemsize, s.width, s.stride, s.padded)
                  for s in self.sections),
            rows, self.pad_multiple)

    def describe(self) -> dict[str, str]:
        """Every schema property as ``{name: value}``: what phase 1 compares
        field by field when fingerprints differ, to name the difference."""
        if self.is_tokens:
            return _describe_tokens(self.batch_class, self.batch_size, self.tokens, self.dense,
                                    self.seq_lens_dtype, not any(s.padded for s in self.sections if s.jagged),
                                    self.pad_multiple, self.token_pads)
        return describe(self.batch_class, self.batch_size, self.kjts, self.dense, self.settings)


def describe(batch_class: str, b: int, kjts: tuple[KJTSpec, ...] | list[KJTSpec],
             dense: tuple[DenseSpec, ...] | list[DenseSpec],
             settings: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    out = {"batch class": batch_class, "batch_size": str(b),
           "KJT fields": str([k.name for k in kjts]), "dense fields": str([d.name for d in dense]),
           **dict(settings)}
    for k in kjts:
        out[f"{k.name}.keys"] = str(list(k.keys))
        out[f"{k.name}.lengths dtype"] = str(k.lengths_dtype)
        out[f"{k.name}.values dtype"] = str(k.values_dtype)
        out[f"{k.name}.weights dtype"] = "absent" if k.weights_dtype is None else str(k.weights_dtype)
    for d in dense:
        out[f"{d.name} dtype"] = str(d.dtype)
        out[f"{d.name} per-sample shape"] = str(list(d.shape))
    return out


def _describe_tokens(batch_class: str, b: int, tokens: tuple[DenseSpec, ...], samples: tuple[DenseSpec, ...],
                     seq_lens_dtype: Any, packed: bool, pad_multiple: int,
                     pads: tuple[int | float | bool, ...]) -> dict[str, str]:
    out = {"batch class": batch_class, "batch_size": str(b), "layout": "packed" if packed else "padded",
           "seq_lens dtype": str(seq_lens_dtype), "pad_multiple": str(pad_multiple),
           "token fields": str([t.name for t in tokens]), "sample fields": str([t.name for t in samples])}
    for t, pad in zip(tokens, pads, strict=True):
        out[f"tokens[{t.name!r}] dtype"] = str(t.dtype)
        out[f"tokens[{t.name!r}] per-token shape"] = str(list(t.shape))
        if not packed:
            out[f"tokens[{t.name!r}] pad value"] = repr(pad)
    for t in samples:
        out[f"samples[{t.name!r}] dtype"] = str(t.dtype)
        out[f"samples[{t.name!r}] per-sample shape"] = str(list(t.shape))
    return out


def fingerprint(description: dict[str, str]) -> int:
    """int64 hash of a description (the same on every process and platform)."""
    text = repr(sorted(description.items()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _fields(batch: Any) -> tuple[dict[str, KeyedJaggedTensor], dict[str, torch.Tensor]]:
    return batch.kjt_fields(), batch.dense_fields()


def _width(shape: tuple[int, ...]) -> int:
    width = 1
    for s in shape:
        width *= s
    return width


def _token_layout(batch: TokenBatch) -> WireLayout:
    b, packed = batch.batch_size, batch.packed
    lead = 1 if packed else 2
    tokens = tuple(DenseSpec(n, t.dtype, tuple(int(x) for x in t.shape[lead:])) for n, t in batch.tokens.items())
    samples = tuple(DenseSpec(n, t.dtype, tuple(int(x) for x in t.shape[1:])) for n, t in batch.samples.items())
    length = 0 if packed else batch.max_len
    sections = [Section(t.name, "tokens", t.dtype, _itemsize(t.dtype), 0, 1, _width(t.shape),
                        0 if packed else length * _width(t.shape), not packed) for t in tokens]
    sections += [Section(t.name, "samples", t.dtype, _itemsize(t.dtype), -1, 1, _width(t.shape)) for t in samples]
    cls = f"{type(batch).__module__}.{type(batch).__qualname__}"
    pads = tuple(_pad(batch, t) for t in tokens)
    desc = _describe_tokens(cls, b, tokens, samples, batch.seq_lens.dtype, packed, batch.pad_multiple, pads)
    return WireLayout(cls, b, (), samples, tuple(sections), 1, fingerprint(desc), tokens, batch.seq_lens.dtype,
                      batch.pad_multiple, pads)


def _pad(batch: TokenBatch, spec: DenseSpec) -> int | float | bool:
    """Token field ``spec``'s pad value as its dtype holds it (0 where ``pad_values``
    names none or is invalid: :func:`scalar_problems` reports that)."""
    pads = batch.pad_values
    value = pads.get(spec.name, 0) if isinstance(pads, dict) else 0
    if not holds(spec.dtype, value):
        value = 0
    if spec.dtype == torch.bool:
        return bool(value)
    if spec.dtype.is_complex:
        return complex(value)  # type: ignore[return-value]  # repr'd, and given to torch.full
    return float(value) if spec.dtype.is_floating_point else int(value)


def wire_layout(batch: Any) -> WireLayout:
    """The wire layout of ``batch`` (a ``BaseBatch`` or a ``TokenBatch``),
    derived from its tensors now.

    Reads shapes and dtypes only, never tensor values: no device sync.
    """
    if isinstance(batch, TokenBatch):
        return _token_layout(batch)
    kjt_fields, dense_fields = _fields(batch)
    kjts: list[KJTSpec] = []
    sections: list[Section] = []
    row = 0
    for name, kjt in kjt_fields.items():
        w = kjt.weights_or_none()
        spec = KJTSpec(name, tuple(kjt.keys()), row, kjt.lengths().dtype, kjt.values().dtype,
                       None if w is None else w.dtype)
        kjts.append(spec)
        sections.append(Section(name, "values", spec.values_dtype, _itemsize(spec.values_dtype),
                                row, len(spec.keys), 1))
        if spec.weights_dtype is not None:
            sections.append(Section(name, "weights", spec.weights_dtype, _itemsize(spec.weights_dtype),
                                    row, len(spec.keys), 1))
        row += len(spec.keys)
    dense: list[DenseSpec] = []
    for name, t in dense_fields.items():
        shape = tuple(int(s) for s in t.shape[1:])
        dense.append(DenseSpec(name, t.dtype, shape))
        sections.append(Section(name, "dense", t.dtype, _itemsize(t.dtype), -1, 1, _width(shape)))
    cls = f"{type(batch).__module__}.{type(batch).__qualname__}"
    b = int(batch.batch_size)
    # Settings that describe every sample alike and stay on their rank (a received sample
    # takes the receiver's): they must agree (design.md: "must not depend on the rank").
    # (as sorted lists: a set of names iterates in each process's own hash order)
    settings = (("contextual_feature_names", repr(sorted(batch.contextual_feature_names, key=repr))),
                ("feature_to_max_seqlen", repr(dict(sorted(batch.feature_to_max_seqlen.items(),
                                                           key=lambda kv: repr(kv[0]))))))
    fp = fingerprint(describe(cls, b, kjts, dense, settings))
    return WireLayout(cls, b, tuple(kjts), tuple(dense), tuple(sections), row, fp, settings=settings)


def layout_problems(batch: Any, layout: WireLayout) -> list[str]:
    """What makes ``batch`` unshufflable under its own layout, from shapes alone.

    Checked at every shuffle because tensors can be replaced after the batch
    was built: every dense field is ``[B, ...]``, every KJT has ``B * K``
    lengths and no variable stride, and every element size can travel.
    Value-level checks (values vs. ``sum(lengths)``, negative lengths) happen
    where the lengths are on the host.
    """
    out = _token_problems(batch, layout) if layout.is_tokens else _kjt_problems(batch, layout)
    for s in layout.sections:
        if s.itemsize not in OPAQUE:
            out.append(f"{section_name(s)}: {s.dtype} has {s.itemsize}-byte elements, expected one of "
                       f"{sorted(OPAQUE)} bytes")
        kind = _not_plain(section_tensor(batch, s))
        if kind:
            out.append(f"{section_name(s)}: a {kind} tensor, expected a plain (strided) tensor "
                       f"({_PLAIN_FIX.get(kind, 't.to_dense()')} gives one)")
    names = ["seq_lens"] if layout.is_tokens else [f"{k.name}.lengths" for k in layout.kjts]
    for name, t in zip(names, lengths_tensors(batch, layout), strict=True):
        kind = _not_plain(t)
        if kind:
            out.append(f"{name}: a {kind} tensor, expected a plain (strided) tensor")
    return out


_PLAIN_FIX = {"conjugate-view": "t.resolve_conj()", "negative-view": "t.resolve_neg()"}


def _not_plain(t: torch.Tensor) -> str:
    """What keeps ``t`` from travelling as bytes ('' for a plain strided tensor): a sparse
    or other non-strided layout, or a lazy conjugate or negative view (phase 2 views
    the memory as bytes, which none of them hold as their values)."""
    if t.layout != torch.strided:
        return str(t.layout).removeprefix("torch.")
    if t.is_conj():
        return "conjugate-view"
    if t.is_neg():
        return "negative-view"
    return ""


def scalar_problems(batch: Any) -> list[str]:
    """The batch's plain fields that a layout is built from, checked first
    (they may have been set after construction): ``batch_size`` a Python int
    >= 1 (the batch is rebuilt with it after phase 2), and for a
    ``TokenBatch`` ``pad_multiple`` an int >= 1, at least one token field and
    ``pad_values`` that name token fields and fit their dtypes."""
    out = []
    b = getattr(batch, "batch_size", None)
    if not is_int(b, 1):
        out.append(f"batch_size={b!r} ({type(b).__name__}), expected an int >= 1")
    if isinstance(batch, TokenBatch):
        m = batch.pad_multiple
        if not is_int(m, 1):
            out.append(f"pad_multiple={m!r}, expected an int >= 1")
        if not batch.tokens:
            out.append("tokens is empty, expected at least one per-token tensor")
        out += pad_value_problems(batch.tokens, batch.pad_values)
    return out


def section_name(s: Section) -> str:
    """How a section is named in errors: ``tokens['ids']``, ``feats.values``, ``dense``."""
    if s.part in ("tokens", "samples"):
        return f"{s.part}[{s.field!r}]"
    return s.field if s.part == "dense" else f"{s.field}.{s.part}"


def _kjt_problems(batch: Any, layout: WireLayout) -> list[str]:
    """Shape problems of a batch of KJT and dense fields."""
    b = layout.batch_size
    out = []
    kjt_fields, dense_fields = _fields(batch)
    for spec in layout.kjts:
        kjt = kjt_fields[spec.name]
        if kjt.variable_stride_per_key():
            out.append(f"{spec.name}: variable-stride (VBE) KeyedJaggedTensors cannot be shuffled")
        n = kjt.lengths().numel()
        if n != b * len(spec.keys):
            out.append(f"{spec.name}: len(lengths)={n}, expected batch_size * num_keys = "
                       f"{b} * {len(spec.keys)} = {b * len(spec.keys)}")
    for d in layout.dense:
        t = dense_fields[d.name]
        if t.dim() == 0 or t.shape[0] != b:
            out.append(f"{d.name}: shape {tuple(t.shape)}, expected [batch_size={b}, ...]")
    return out


def _token_problems(batch: TokenBatch, layout: WireLayout) -> list[str]:
    """Shape problems of a ``TokenBatch`` (its fields may have been replaced since it was built)."""
    b, out = layout.batch_size, []
    if tuple(batch.seq_lens.shape) != (b,):
        out.append(f"seq_lens: shape {tuple(batch.seq_lens.shape)}, expected [batch_size={b}]")
    lead = {tuple(t.shape[: 1 if batch.packed else 2]) for t in batch.tokens.values()}
    if len(lead) > 1 or (not batch.packed and next(iter(lead))[0] != b):
        out.append(f"tokens: leading shapes {sorted(lead)}, expected one {'[T]' if batch.packed else f'[{b}, L]'}")
    for name, t in batch.samples.items():
        if t.dim() == 0 or t.shape[0] != b:
            out.append(f"samples[{name!r}]: shape {tuple(t.shape)}, expected [batch_size={b}, ...]")
    return out


def lengths_tensors(batch: Any, layout: WireLayout) -> list[torch.Tensor]:
    """The 1-D lengths behind the rows of the lengths matrix, in row order:
    every KJT's lengths (key-major), or a token batch's ``seq_lens``."""
    if layout.is_tokens:
        return [batch.seq_lens]
    kjts = batch.kjt_fields()
    return [kjts[k.name].lengths().reshape(-1) for k in layout.kjts]


def section_tensor(batch: Any, s: Section) -> torch.Tensor:
    """The tensor behind section ``s`` of ``batch``."""
    if s.part in ("tokens", "samples"):
        return getattr(batch, s.part)[s.field]  # type: ignore[no-any-return]
    if s.part == "dense":
        return batch.dense_fields()[s.field]  # type: ignore[no-any-return]
    kjt = batch.kjt_fields()[s.field]
    return kjt.values() if s.part == "values" else kjt.weights()  # type: ignore[no-any-return]


def opaque(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened and viewed as the same-size dtype that gathers copy
    (int64, int32, float16, uint8): bits are moved, never computed on."""
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        # An empty tensor counts as contiguous whatever its strides; one with
        # stride 0 (torch.from_numpy of an empty array) cannot be viewed as
        # bytes later (phase 2's pack): use a fresh one.
        flat = torch.empty(0, dtype=t.dtype, device=t.device)
    return flat.view(OPAQUE[flat.element_size()])
