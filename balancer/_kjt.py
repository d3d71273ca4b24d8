"""Sample selection on KeyedJaggedTensors along the batch dimension.

A KJT with keys ``[k0, k1]`` and stride ``B`` stores ``lengths`` key-major,
``[K * B]``: the B lengths of k0, then the B lengths of k1; ``values`` (and
``weights``) follow the same order. Selecting samples ``indices`` ([M]) keeps,
for every key, the segments ``k * B + indices``.

Three implementations, one contract (tested against each other):

* CUDA: ``torch.ops.fbgemm.keyed_jagged_index_select_dim1``.
* CPU: ``torch.ops.fbgemm.permute_1D_sparse_data`` with int32 segment ids,
  near memcpy speed (``keyed_jagged_index_select_dim1`` has no CPU kernel).
* :func:`kjt_index_select_reference`: pure torch, used when fbgemm is absent and
  as the independent reference in tests.
"""

from __future__ import annotations

import logging

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

logger = logging.getLogger(__name__)

__all__ = ["kjt_index_select", "kjt_index_select_reference", "segment_ids"]


def _has_fbgemm_op(name: str) -> bool:
    try:
        getattr(torch.ops.fbgemm, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _check_kjt(kjt: KeyedJaggedTensor, what: str) -> None:
    if kjt.variable_stride_per_key():
        raise ValueError(f"{what}: variable-stride (VBE) KeyedJaggedTensors are not supported")


def segment_ids(indices: torch.Tensor, num_keys: int, stride: int) -> torch.Tensor:
    """Segment ids ``k * stride + indices[j]`` for every key ``k``, key-major.

    Args:
        indices: [M] sample indices into a batch of ``stride`` samples.
        num_keys: number of keys K.
        stride: samples per key in the source KJT.

    Returns:
        [K * M] segment ids with the dtype and device of ``indices``.
    """
    base = torch.arange(num_keys, device=indices.device, dtype=indices.dtype) * stride
    return (base.unsqueeze(1) + indices.unsqueeze(0)).reshape(-1)


def _rebuild(
    kjt: KeyedJaggedTensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    stride: int,
) -> KeyedJaggedTensor:
    # The stride given: a KJT without keys has no lengths to infer it from.
    return KeyedJaggedTensor(
        keys=kjt.keys(), values=values, weights=weights, lengths=lengths.to(kjt.lengths().dtype), stride=stride
    )


def kjt_index_select_reference(
    kjt: KeyedJaggedTensor, indices: torch.Tensor
) -> KeyedJaggedTensor:
    """Pure-torch sample selection: a gather of every selected segment's values.

    Args:
        kjt: source KJT with stride B.
        indices: [M] int64 indices in ``[0, B)``; repeats allowed.

    Returns:
        KJT with the same keys and stride M; weights kept.
    """
    _check_kjt(kjt, "kjt_index_select_reference")
    keys = kjt.keys()
    seg = segment_ids(indices.to(torch.int64), len(keys), kjt.stride())
    lengths = kjt.lengths().to(torch.int64)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    sel_len = lengths[seg]
    starts = offsets[seg]
    total = int(sel_len.sum())
    # Position j of the output belongs to segment s(j) and sits at
    # starts[s] + (j - first output position of s).
    out_seg = torch.repeat_interleave(torch.arange(seg.numel(), device=seg.device), sel_len)
    out_start = torch.zeros(seg.numel(), dtype=torch.int64, device=seg.device)
    if seg.numel() > 1:
        torch.cumsum(sel_len[:-1], 0, out=out_start[1:])
    gather = starts[out_seg] + torch.arange(total, device=seg.device) - out_start[out_seg]
    values = kjt.values()[gather]
    w = kjt.weights_or_none()
    weights = w[gather] if w is not None else None
    return _rebuild(kjt, values, sel_len, weights, indices.numel())


# The CPU kernel copies values of these dtypes and weights of float32/float64
# only; other dtypes travel as a same-size one (bits are copied, never computed).
_CPU_VALUE_VIEWS = {8: torch.int64, 4: torch.int32, 2: torch.float16}
_CPU_WEIGHT_VIEWS = {8: torch.float64, 4: torch.float32}


def _select_cpu(kjt: KeyedJaggedTensor, indices: torch.Tensor) -> KeyedJaggedTensor:
    v, w = kjt.values(), kjt.weights_or_none()
    v_as = _CPU_VALUE_VIEWS.get(v.element_size())
    w_as = None if w is None else _CPU_WEIGHT_VIEWS.get(w.element_size())
    if v_as is None or (w is not None and w_as is None):  # 1-byte values, 2-byte weights
        return kjt_index_select_reference(kjt, indices)
    seg = segment_ids(indices.to(torch.int32), len(kjt.keys()), kjt.stride())
    sel_lengths, values, weights = torch.ops.fbgemm.permute_1D_sparse_data(
        seg, kjt.lengths(), v.view(v_as), None if w is None else w.view(w_as)
    )
    return _rebuild(kjt, values.view(v.dtype), sel_lengths, None if w is None else weights.view(w.dtype),
                    indices.numel())


def _select_cuda(kjt: KeyedJaggedTensor, indices: torch.Tensor) -> KeyedJaggedTensor:
    out = torch.ops.fbgemm.keyed_jagged_index_select_dim1(
        kjt.values(),
        kjt.lengths(),
        kjt.offsets(),
        indices.to(torch.int64),
        kjt.stride(),
        kjt.weights_or_none(),
    )
    weights = out[2] if len(out) > 2 else None
    return _rebuild(kjt, out[0], out[1], weights, indices.numel())


def kjt_index_select(kjt: KeyedJaggedTensor, indices: torch.Tensor) -> KeyedJaggedTensor:
    """Select samples ``indices`` of ``kjt`` along the batch dimension.

    Example (keys ``[a, b]``, stride 3, ``indices = [2, 0]``)::

        lengths  a: [1, 0, 2]  b: [1, 1, 0]     values a: [x, y, z]  b: [u, v]
        result   a: [2, 1]     b: [0, 1]        values a: [y, z, x]  b: [u]

    Args:
        kjt: source KJT of stride B (not variable-stride).
        indices: [M] integer indices in ``[0, B)`` on the KJT's device.

    Returns:
        KJT with the same keys, stride M, weights kept.
    """
    _check_kjt(kjt, "kjt_index_select")
    if indices.numel() == 0 or kjt.stride() == 0:
        return kjt_index_select_reference(kjt, indices)
    if kjt.values().is_cuda and _has_fbgemm_op("keyed_jagged_index_select_dim1"):
        return _select_cuda(kjt, indices)
    if _has_fbgemm_op("permute_1D_sparse_data"):
        return _select_cpu(kjt, indices)
    return kjt_index_select_reference(kjt, indices)
