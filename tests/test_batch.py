"""BaseBatch invariants, padding, and sample selection against a pure-Python reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer import BaseBatch, TokenBatch, pad_batch, padding_like
from balancer._kjt import _select_cpu, kjt_index_select, kjt_index_select_reference


@dataclasses.dataclass(kw_only=True)
class DenseBatch(BaseBatch):
    dense: torch.Tensor
    note: str = "carried"


def random_kjt(
    g: torch.Generator,
    keys: list[str],
    batch_size: int,
    max_len: int = 5,
    weighted: bool = False,
    lengths_dtype: torch.dtype = torch.int64,
    real: int | None = None,
) -> KeyedJaggedTensor:
    lengths = torch.randint(0, max_len + 1, (len(keys), batch_size), generator=g)
    if real is not None:
        lengths[:, real:] = 0
    lengths = lengths.reshape(-1).to(lengths_dtype)
    n = int(lengths.sum())
    values = torch.randint(0, 10_000, (n,), generator=g)
    weights = torch.rand(n, generator=g) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def as_lists(kjt: KeyedJaggedTensor) -> dict[str, list[tuple[list[int], list[float] | None]]]:
    """Independent view: per key, per sample, (values, weights) as Python lists."""
    out: dict[str, list[tuple[list[int], list[float] | None]]] = {}
    lengths = kjt.lengths().tolist()
    values = kjt.values().tolist()
    w = kjt.weights_or_none()
    weights = w.tolist() if w is not None else None
    b = kjt.stride()
    pos = 0
    for ki, key in enumerate(kjt.keys()):
        rows = []
        for s in range(b):
            n = lengths[ki * b + s]
            rows.append((values[pos : pos + n], weights[pos : pos + n] if weights else None))
            pos += n
        out[key] = rows
    return out


def python_select(kjt: KeyedJaggedTensor, indices: list[int]):
    return {k: [rows[i] for i in indices] for k, rows in as_lists(kjt).items()}


def make_batch(g: torch.Generator, b: int = 6, real: int | None = None) -> DenseBatch:
    real_n = b if real is None else real
    dense = torch.randn(b, 2, 3, generator=g)
    dense[real_n:] = 0
    labels = torch.randint(0, 2, (b,), generator=g).float()
    labels[real_n:] = 0
    return DenseBatch(
        features=random_kjt(g, ["a", "b", "c"], b, weighted=True, real=real_n),
        labels=labels,
        batch_size=b,
        actual_batch_size=real_n,
        feature_to_max_seqlen={"a": 5},
        contextual_feature_names=["c"],
        dense=dense,
    )


# ----------------------------------------------------------------- selection
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("lengths_dtype", [torch.int32, torch.int64])
def test_kjt_select_paths_match_python_reference(weighted: bool, lengths_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        b = int(torch.randint(1, 12, (1,), generator=g))
        kjt = random_kjt(g, ["x", "y"], b, weighted=weighted, lengths_dtype=lengths_dtype)
        m = int(torch.randint(1, 2 * b + 1, (1,), generator=g))
        idx = torch.randint(0, b, (m,), generator=g)  # repeats allowed
        expected = python_select(kjt, idx.tolist())
        for fn in (kjt_index_select, kjt_index_select_reference, _select_cpu):
            got = fn(kjt, idx)
            assert got.keys() == kjt.keys()
            assert got.stride() == m, (fn.__name__, trial)
            assert got.lengths().dtype == lengths_dtype
            assert (got.weights_or_none() is not None) == weighted
            assert as_lists(got) == expected, (fn.__name__, trial)


def test_kjt_select_empty_and_all_zero_lengths() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a"], values=torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(4, dtype=torch.int64)
    )
    got = kjt_index_select(kjt, torch.tensor([3, 1]))
    assert got.lengths().tolist() == [0, 0] and got.values().numel() == 0
    empty = kjt_index_select(kjt, torch.zeros(0, dtype=torch.int64))
    assert empty.stride() == 0 and empty.lengths().numel() == 0


def test_kjt_select_rejects_variable_stride() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.arange(3),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[1], [2]],
    )
    with pytest.raises(ValueError, match="variable-stride"):
        kjt_index_select(kjt, torch.tensor([0]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kjt_select_cuda_matches_reference() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        kjt = random_kjt(g, ["x", "y", "z"], 9, weighted=True)
        idx = torch.randint(0, 9, (7,), generator=g)
        expected = python_select(kjt, idx.tolist())
        got = kjt_index_select(kjt.to(torch.device("cuda")), idx.cuda())
        assert got.values().is_cuda
        assert as_lists(got.to(torch.device("cpu"))) == expected


# --------------------------------------------------------------- invariants
def test_defaults_and_fields() -> None:
    b = make_batch(torch.Generator().manual_seed(0))
    assert b.actual_batch_size == b.batch_size == 6 and b.num_padding == 0
    assert list(b.kjt_fields()) == ["features"]
    assert list(b.dense_fields()) == ["labels", "dense"]


def test_invalid_batches_raise_naming_value() -> None:
    g = torch.Generator().manual_seed(0)
    kjt = random_kjt(g, ["a", "b"], 4)
    ok = dict(features=kjt, batch_size=4, feature_to_max_seqlen={})
    with pytest.raises(ValueError, match=r"len\(lengths\)=8, expected batch_size \* num_keys = 5 \* 2 = 10"):
        BaseBatch(**{**ok, "batch_size": 5})
    with pytest.raises(ValueError, match=r"actual_batch_size=5, expected an int with 0 <= actual_batch_size "
                                         r"<= batch_size=4"):
        BaseBatch(**ok, actual_batch_size=5)
    for bad in (2.5, True, "2"):  # accepted once, or a TypeError from the comparison
        with pytest.raises(ValueError, match=rf"actual_batch_size={bad!r}, expected an int"):
            BaseBatch(**ok, actual_batch_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"actual_batch_size=-1"):
        BaseBatch(**ok, actual_batch_size=-1)
    with pytest.raises(ValueError, match=r"batch_size=0, expected >= 1"):
        BaseBatch(**{**ok, "batch_size": 0})
    with pytest.raises(ValueError, match=r"labels: shape \(3,\), expected \[batch_size=4, \.\.\.\]"):
        BaseBatch(**ok, labels=torch.zeros(3))
    with pytest.raises(ValueError, match=r"labels: len\(lengths\)=3"):
        BaseBatch(**ok, labels=KeyedJaggedTensor(keys=["l"], values=torch.zeros(0), lengths=torch.zeros(3, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"contextual_feature_names \['zz'\] are not keys"):
        BaseBatch(**ok, contextual_feature_names=["zz"])
    with pytest.raises(ValueError, match=r"duplicate keys"):
        BaseBatch(**{**ok, "features": KeyedJaggedTensor(keys=["a", "a"], values=kjt.values(), lengths=kjt.lengths())})
    with pytest.raises(ValueError, match=r"feature_to_max_seqlen\['a'\]=-3"):
        BaseBatch(**{**ok, "feature_to_max_seqlen": {"a": -3}})
    with pytest.raises(TypeError, match="features must be a KeyedJaggedTensor"):
        BaseBatch(**{**ok, "features": torch.zeros(4)})


def test_padding_contents_are_checked() -> None:
    g = torch.Generator().manual_seed(0)
    kjt = random_kjt(g, ["a", "b"], 4, max_len=3)
    lengths = kjt.lengths().clone()
    lengths[7] = 2  # key b, sample 3
    lengths[3] = 0
    bad = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(int(lengths.sum())), lengths=lengths)
    with pytest.raises(ValueError, match=r"padding sample 3 \(actual_batch_size=3\) has length 2 for key 'b'"):
        BaseBatch(features=bad, batch_size=4, feature_to_max_seqlen={}, actual_batch_size=3)
    dense = torch.zeros(4, 2)
    dense[3, 1] = 1.0
    good = random_kjt(g, ["a"], 4, real=2)
    with pytest.raises(ValueError, match=r"dense: padding row 3 \(actual_batch_size=2\) is not zero"):
        DenseBatch(features=good, batch_size=4, feature_to_max_seqlen={}, actual_batch_size=2, dense=dense)


def test_real_samples_may_be_empty() -> None:
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(3, dtype=torch.int64))
    b = BaseBatch(features=kjt, batch_size=3, feature_to_max_seqlen={}, actual_batch_size=3)
    assert b.actual_batch_size == 3  # nothing inferred from zero lengths


# -------------------------------------------------------------- operations
def test_index_select_keeps_fields_aligned() -> None:
    g = torch.Generator().manual_seed(3)
    for real in (6, 4, 0):
        batch = make_batch(g, b=6, real=real)
        idx = torch.tensor([i for i in (5, 0, 3, 2) if i < real] + [i for i in (5, 0, 3, 2) if i >= real])
        out = batch.index_select(idx)
        assert isinstance(out, DenseBatch) and out.note == "carried"
        assert out.batch_size == 4
        assert out.actual_batch_size == sum(1 for i in idx.tolist() if i < real)
        assert out.dense.shape == (4, 2, 3)
        assert torch.equal(out.dense, batch.dense[idx])
        assert torch.equal(out.labels, batch.labels[idx])
        assert as_lists(out.features) == python_select(batch.features, idx.tolist())
        assert out.feature_to_max_seqlen == {"a": 5} and out.contextual_feature_names == ["c"]


def test_index_select_rejects_padding_before_real() -> None:
    batch = make_batch(torch.Generator().manual_seed(0), b=4, real=2)
    with pytest.raises(ValueError, match="padding sample precedes a real one"):
        batch.index_select(torch.tensor([3, 0]))
    with pytest.raises(ValueError, match="indices is empty"):
        batch.index_select(torch.zeros(0, dtype=torch.int64))


def test_pad_batch_appends_zero_padding() -> None:
    g = torch.Generator().manual_seed(4)
    batch = make_batch(g, b=3)
    padded = pad_batch(batch, 5)
    assert (padded.batch_size, padded.actual_batch_size) == (5, 3)
    assert torch.equal(padded.dense[:3], batch.dense) and not padded.dense[3:].any()
    assert torch.equal(padded.labels[:3], batch.labels) and not padded.labels[3:].any()
    rows = as_lists(padded.features)
    assert {k: v[:3] for k, v in rows.items()} == as_lists(batch.features)
    assert all(v[3:] == [([], []), ([], [])] for v in rows.values())
    assert pad_batch(padded, 5) is padded
    twice = pad_batch(padded, 7)
    assert (twice.batch_size, twice.actual_batch_size) == (7, 3)
    with pytest.raises(ValueError, match=r"pad_batch: batch_size=2, expected an int >= the batch's batch_size=3"):
        pad_batch(batch, 2)
    # A float or a string failed deep inside torch or a comparison (TypeError).
    for bad in (5.0, "4", True):
        with pytest.raises(ValueError, match=rf"pad_batch: batch_size={bad!r}, expected an int >= the batch's"):
            pad_batch(batch, bad)  # type: ignore[arg-type]
    assert pad_batch(batch, np.int64(4)).batch_size == 4


def test_to_pin_record_stream_on_cpu() -> None:
    batch = make_batch(torch.Generator().manual_seed(5), b=4, real=3)
    moved = batch.to(torch.device("cpu"), non_blocking=True)
    assert isinstance(moved, DenseBatch) and moved.actual_batch_size == 3
    assert torch.equal(moved.dense, batch.dense)
    assert as_lists(moved.features) == as_lists(batch.features)
    if not torch.cuda.is_available():
        assert batch.pin_memory() is batch
    batch.record_stream(None)  # type: ignore[arg-type]  # CPU: no streams, a no-op


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batch_cuda_round_trip() -> None:
    batch = make_batch(torch.Generator().manual_seed(6), b=5, real=4)
    cuda = batch.pin_memory().to(torch.device("cuda"), non_blocking=True)
    cuda.record_stream(torch.cuda.current_stream())
    sel = cuda.index_select(torch.tensor([3, 1, 4], device="cuda"), actual_batch_size=2)
    ref = batch.index_select(torch.tensor([3, 1, 4]), actual_batch_size=2)
    back = sel.to(torch.device("cpu"))
    assert torch.equal(back.dense, ref.dense)
    assert as_lists(back.features) == as_lists(ref.features)
    # TorchRec's in-place copy mode (enable_inplace_copy_batch) passes its memcpy stream
    stream = torch.cuda.Stream()
    copied = batch.pin_memory().to(torch.device("cuda"), non_blocking=True, data_copy_stream=stream)
    torch.cuda.current_stream().wait_stream(stream)
    again = copied.to(torch.device("cpu"))
    assert torch.equal(again.dense, batch.dense) and as_lists(again.features) == as_lists(batch.features)


def test_to_takes_torchrec_data_copy_stream() -> None:
    # TorchRec's enable_inplace_copy_batch calls batch.to(..., data_copy_stream=...),
    # which BaseBatch.to did not take (a TypeError in the pipeline's first step).
    batch = make_batch(torch.Generator().manual_seed(7), b=5, real=4)
    cpu = torch.device("cpu")
    copied = batch.to(cpu, non_blocking=False, data_copy_stream=torch.cpu.Stream())
    assert torch.equal(copied.dense, batch.dense) and as_lists(copied.features) == as_lists(batch.features)
    assert copied.actual_batch_size == batch.actual_batch_size


def test_a_kjt_without_keys_keeps_its_stride() -> None:
    # KeyedJaggedTensor infers the stride from the lengths; with no key there are
    # none, so padding and selection gave stride 0 next to batch_size 5.
    empty = KeyedJaggedTensor(keys=[], values=torch.zeros(0, dtype=torch.int64),
                              lengths=torch.zeros(0, dtype=torch.int64), stride=3)
    batch = BaseBatch(features=empty, batch_size=3, feature_to_max_seqlen={}, actual_batch_size=2)
    assert pad_batch(batch, 5).features.stride() == 5
    idx = torch.tensor([2, 0, 0, 1])
    for select in (kjt_index_select_reference, _select_cpu):
        assert select(empty, idx).stride() == 4


def test_pad_batch_rejects_a_field_shorter_than_the_batch() -> None:
    # A field replaced after construction (b.dense = b.dense[:2]) was zero-filled up
    # to the new size: a real sample's row silently became padding.
    g = torch.Generator().manual_seed(8)
    batch = make_batch(g, b=3)
    short = make_batch(g, b=3)
    short.dense = short.dense[:2]
    with pytest.raises(ValueError, match=r"pad_batch: dense: shape \(2, 2, 3\), expected \[batch_size=3, \.\.\.\]"):
        pad_batch(short, 4)
    with pytest.raises(ValueError, match=r"pad_batch: dense: shape \(2, 2, 3\)"):
        pad_batch(short, 3)  # even when no padding is added, the batch is not passed on
    fewer = make_batch(g, b=3)
    fewer.features = random_kjt(g, list(batch.features.keys()), 2)
    with pytest.raises(ValueError, match=r"pad_batch: features: len\(lengths\)=\d+, expected batch_size \* num_keys"):
        pad_batch(fewer, 5)
    assert pad_batch(batch, 4).batch_size == 4


def test_padding_like_keeps_the_layout_and_holds_no_sample() -> None:
    batch = make_batch(torch.Generator().manual_seed(3), b=5, real=4)
    empty = padding_like(batch)
    assert type(empty) is type(batch) and empty.batch_size == 5 and empty.actual_batch_size == 0
    assert empty.features.keys() == batch.features.keys() and empty.features.lengths().sum() == 0
    assert empty.features.lengths().dtype == batch.features.lengths().dtype
    assert empty.features.weights().numel() == 0 and empty.features.values().numel() == 0
    assert empty.dense.shape == batch.dense.shape and not empty.dense.any() and not empty.labels.any()
    assert empty.feature_to_max_seqlen == batch.feature_to_max_seqlen
    empty.validate()  # padding contents included
    lens = torch.tensor([2, 3, 0])
    tokens = TokenBatch(batch_size=3, seq_lens=lens, tokens={"ids": torch.ones(3, 4, dtype=torch.int64)},
                        samples={"r": torch.ones(3)}, actual_batch_size=2, pad_values={"ids": -1})
    t = padding_like(tokens)
    assert t.actual_batch_size == 0 and t.seq_lens.tolist() == [0, 0, 0] and not t.samples["r"].any()
    assert (t.tokens["ids"] == -1).all() and t.tokens["ids"].shape == (3, 4)
    packed = TokenBatch(batch_size=3, seq_lens=lens, tokens={"e": torch.ones(5, 2)}, packed=True)
    assert padding_like(packed).tokens["e"].shape == (0, 2)
    with pytest.raises(TypeError, match="padding_like: batch is a dict, expected a BaseBatch or a TokenBatch"):
        padding_like({"x": 1})


def test_padding_and_padded_kjts_carry_their_key_lengths_to_the_device() -> None:
    # TorchRec's input dist asks every KJT for length_per_key (KJT.dist_splits); a
    # device KJT without it cached answers with a .tolist(), a host sync. A padding
    # batch's are zeros, known on the host (a rank out of data shuffled one with
    # comm "none" and TorchRec read them from the device every step); a padded one's
    # are its input's (padding samples have zero length). They must survive the copy
    # to the device (meta stands in for it: nothing can be read there).
    batch = make_batch(torch.Generator().manual_seed(4), b=5, real=4)
    meta = torch.device("meta")
    empty = padding_like(batch).to(meta).features
    assert empty.length_per_key_or_none() == [0, 0, 0]
    assert empty.offset_per_key_or_none() == [0, 0, 0, 0]
    lpk, opk = batch.features.length_per_key(), batch.features.offset_per_key()  # now cached on the input
    padded = pad_batch(batch, 8).to(meta).features
    assert padded.length_per_key_or_none() == lpk and padded.offset_per_key_or_none() == opk
    assert pad_batch(make_batch(torch.Generator().manual_seed(4), b=5), 8).features.length_per_key_or_none() is None


def test_a_field_on_another_device_is_refused() -> None:
    # Accepted before: the shuffle then failed in phase 2 on that rank with
    # "Tensor on device meta is not on the expected device cpu!", naming no field.
    batch = make_batch(torch.Generator().manual_seed(1), b=4)
    with pytest.raises(ValueError, match=r"dense is on meta, expected features.values' device cpu \(every tensor"):
        dataclasses.replace(batch, dense=torch.zeros(4, 2, 3, device="meta"))
    with pytest.raises(ValueError, match=r"labels is on meta, expected features.values' device cpu"):
        dataclasses.replace(batch, labels=torch.zeros(4, device="meta"))


# --------------------------------------------------- fields a shuffle cannot move
@dataclasses.dataclass(kw_only=True)
class HiddenBatch(BaseBatch):
    extra: object = None


@dataclasses.dataclass(kw_only=True)
class CarryBatch(BaseBatch):
    table: dict = dataclasses.field(default_factory=dict, metadata={"balancer": "carry"})


def _hidden_cases() -> list[tuple[str, object]]:
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor
    rows = torch.arange(3.0)
    return [
        ("dict", {"age": rows}),
        ("list", [rows, rows]),
        ("tuple", (1, {"nested": rows})),
        ("JaggedTensor", JaggedTensor(values=rows, lengths=torch.ones(3, dtype=torch.int64))),
        ("KeyedTensor", KeyedTensor(keys=["x"], length_per_key=[1], values=rows[:, None])),
    ]


@pytest.mark.parametrize("kind", [k for k, _ in _hidden_cases()])
def test_fields_holding_tensors_a_shuffle_cannot_move_are_refused(kind: str) -> None:
    # A dict of dense features (or a JaggedTensor, a KeyedTensor) stayed behind in a
    # shuffle while uid and features moved: the received sample 10 carried sample 3's age.
    value = dict(_hidden_cases())[kind]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a"], values=torch.arange(3), lengths=torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match=rf"field 'extra' holds tensors in a {type(value).__name__}: a shuffle moves "
                                        r"only torch.Tensor \[batch_size, \.\.\.\] and KeyedJaggedTensor fields"):
        HiddenBatch(features=kjt, batch_size=3, feature_to_max_seqlen={}, extra=value)
    # values without tensors are carried over as before
    b = HiddenBatch(features=kjt, batch_size=3, feature_to_max_seqlen={}, extra={"name": [1, "x"]})
    assert b.index_select(torch.tensor([2, 0])).extra == {"name": [1, "x"]}
    # the settings keep their own check and its ValueError (a tensor max length)
    with pytest.raises(ValueError, match=r"feature_to_max_seqlen\['a'\]=tensor\(3\), expected an int >= 0"):
        BaseBatch(features=kjt, batch_size=3, feature_to_max_seqlen={"a": torch.tensor(3)})  # type: ignore[dict-item]


def test_a_field_marked_carry_keeps_its_batch_level_tensors() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a"], values=torch.arange(3), lengths=torch.ones(3, dtype=torch.int64))
    table = {"mean": torch.tensor([0.5])}
    b = CarryBatch(features=kjt, batch_size=3, feature_to_max_seqlen={}, table=table)
    assert b.index_select(torch.tensor([2, 0])).table is table
    assert pad_batch(b, 5).table is table


def test_to_takes_the_tensors_of_a_carry_field_along() -> None:
    # to() moved the tensor and KJT fields only: on a GPU the pipeline's copy left a
    # carry field's tensors on the CPU, next to a batch on the device. The meta
    # device stands in for CUDA here (the CUDA tier runs the same on a GPU).
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a"], values=torch.arange(3), lengths=torch.ones(3, dtype=torch.int64))
    jt = JaggedTensor(values=torch.arange(4.0), lengths=torch.tensor([1, 3]))
    kt = KeyedTensor(keys=["x"], length_per_key=[2], values=torch.ones(3, 2))
    table = {"mean": torch.tensor([0.5]), "parts": [jt, (kt, "name")], "step": 7}
    b = CarryBatch(features=kjt, batch_size=3, feature_to_max_seqlen={}, table=table)
    m = b.to(torch.device("meta"))
    assert m.features.values().device.type == "meta"
    moved = m.table
    assert moved["mean"].device.type == "meta" and moved["step"] == 7 and moved["parts"][1][1] == "name"
    assert isinstance(moved["parts"][0], JaggedTensor) and moved["parts"][0].values().device.type == "meta"
    assert isinstance(moved["parts"][1][0], KeyedTensor) and moved["parts"][1][0].values().device.type == "meta"
    assert moved["parts"][0].lengths().device.type == "meta"
    assert b.table is table and table["mean"].device.type == "cpu"  # the source batch is unchanged
    assert b.to(torch.device("cpu")).table["mean"] is table["mean"]  # a no-op copy, as torch's to()
