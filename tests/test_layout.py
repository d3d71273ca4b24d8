"""Wire layout: sections, the schema description and fingerprint, shape problems."""

from __future__ import annotations

import dataclasses

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer._layout import layout_problems, wire_layout
from balancer.batch import BaseBatch
from balancer.tokens import TokenBatch


@dataclasses.dataclass(kw_only=True)
class _DenseBatch(BaseBatch):
    dense: torch.Tensor


def layout_batch(keys: list[str], vdtype: torch.dtype = torch.int64, dense_shape: tuple[int, ...] = (3,),
                 weights: bool = True, b: int = 4) -> _DenseBatch:
    n = b * len(keys)
    f = KeyedJaggedTensor(keys=keys, values=torch.zeros(n, dtype=vdtype), lengths=torch.ones(n, dtype=torch.int64),
                          weights=torch.ones(n, dtype=torch.float16) if weights else None)
    return _DenseBatch(features=f, batch_size=b, feature_to_max_seqlen={},
                       dense=torch.zeros(b, *dense_shape, dtype=torch.float64), labels=torch.zeros(b))


def test_sections_and_fingerprint() -> None:
    batch = layout_batch(["a", "b"])
    lay = wire_layout(batch)
    assert [(s.field, s.part, s.itemsize, s.count, s.row, s.width) for s in lay.sections] == [
        ("features", "values", 8, 2, 0, 1), ("features", "weights", 2, 2, 0, 1),
        ("labels", "dense", 4, 1, -1, 1), ("dense", "dense", 8, 1, -1, 3)]
    assert lay.num_lengths == 2
    assert wire_layout(layout_batch(["a", "b"])).fingerprint == lay.fingerprint
    variants = {"features.keys": layout_batch(["b", "a"]),
                "features.values dtype": layout_batch(["a", "b"], torch.int32),
                "dense per-sample shape": layout_batch(["a", "b"], dense_shape=(4,)),
                "features.weights dtype": layout_batch(["a", "b"], weights=False),
                "batch_size": layout_batch(["a", "b"], b=5)}
    for field, other in variants.items():
        o = wire_layout(other)
        assert o.fingerprint != lay.fingerprint, field
        diff = [k for k in lay.describe() if lay.describe()[k] != o.describe().get(k)]
        assert diff == [field], (field, diff)


def test_layout_problems_are_read_from_the_tensors_now() -> None:
    batch = layout_batch(["a"])
    assert layout_problems(batch, wire_layout(batch)) == []
    batch.dense = torch.zeros(7, 3, dtype=torch.float64)  # replaced after construction
    assert layout_problems(batch, wire_layout(batch)) == ["dense: shape (7, 3), expected [batch_size=4, ...]"]
    batch = layout_batch(["a"])
    batch.labels = torch.zeros(4, dtype=torch.complex128)
    assert layout_problems(batch, wire_layout(batch)) == [
        "labels: torch.complex128 has 16-byte elements, expected one of [1, 2, 4, 8] bytes"]


def test_token_layout_problems_name_the_field() -> None:
    lens = torch.tensor([3, 1, 0, 2])
    batch = TokenBatch(batch_size=4, seq_lens=lens, tokens={"ids": torch.zeros(4, 3, dtype=torch.int64)},
                       samples={"r": torch.zeros(4)})
    assert layout_problems(batch, wire_layout(batch)) == []
    batch.samples["r"] = torch.zeros(4, dtype=torch.complex128)
    batch.tokens["ids"] = torch.zeros(5, 3, dtype=torch.int64)
    assert layout_problems(batch, wire_layout(batch)) == [
        "tokens: leading shapes [(5, 3)], expected one [4, L]",
        "samples['r']: torch.complex128 has 16-byte elements, expected one of [1, 2, 4, 8] bytes"]


def test_the_settings_are_in_the_fingerprint_whatever_the_dict_order() -> None:
    # feature_to_max_seqlen and contextual_feature_names stay on their rank in a shuffle,
    # so ranks must agree on them; the order a dict was filled in must not matter, and
    # keys of mixed types (which plain sorting refuses) must not break the capture.
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.arange(6),
                                              lengths=torch.ones(6, dtype=torch.int64))

    def fp(**kw: object) -> int:
        return wire_layout(BaseBatch(features=kjt, batch_size=3, **kw)).fingerprint  # type: ignore[arg-type]

    assert fp(feature_to_max_seqlen={"b": 2, 1: 3, "a": 4}) == fp(feature_to_max_seqlen={"a": 4, 1: 3, "b": 2})
    assert fp(feature_to_max_seqlen={"a": 4}) != fp(feature_to_max_seqlen={"a": 5})
    assert fp(feature_to_max_seqlen={}, contextual_feature_names=["b"]) != fp(feature_to_max_seqlen={})
    # names compared as a set: a set iterates in each process's own hash order (torchrun
    # gives every rank its own seed), and ranks holding the same names were told they differ
    assert fp(feature_to_max_seqlen={}, contextual_feature_names=["a", "b"]) == \
        fp(feature_to_max_seqlen={}, contextual_feature_names=["b", "a"])
