"""Per-sample FLOPs of a decoder-only transformer (LLM) from its configuration.

:class:`TransformerCost` counts the matmul FLOPs one sequence of ``L`` tokens
costs a dense decoder-only model (Llama, Qwen, Mistral, GPT-NeoX shapes):
grouped-query attention, gated (SwiGLU) or plain MLP, the LM head, causal
masking, and optionally the backward pass. It is a quadratic ``a L^2 + b L``
like the other estimators of :mod:`balancer.workloads` (it is re-exported
there), built from explicit sizes or from a Hugging Face ``config.json`` dict
with :meth:`TransformerCost.from_hf_config`. The formula is derived in
``docs/workloads.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from balancer._ints import is_int
from balancer._quadratic import (
    _evaluate,
    _names,
    _positive_int,
    _Quadratic,
    is_token_batch,
    sequence_lengths,
)

__all__ = ["TransformerCost"]

_A = TypeVar("_A", np.ndarray, torch.Tensor)

# Hugging Face model types whose MLP is gated (down(act(gate(x)) * up(x))),
# whatever their activation is called (Gemma's is a GELU).
_GATED_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
    "phi3", "olmo", "olmo2", "internlm2", "deepseek", "yi", "baichuan", "cohere", "granite",
})
_GATED_ACTS = frozenset({"silu", "swish", "swiglu", "geglu"})
_MOE_FIELDS = ("num_experts_per_tok", "num_local_experts", "num_experts", "moe_intermediate_size")


@dataclasses.dataclass(frozen=True)
class TransformerCost(_Quadratic):
    """Matmul FLOPs of a dense decoder-only transformer on one sequence.

    With ``d = hidden_size``, ``f = intermediate_size``, ``N = num_layers``,
    ``H`` query heads, ``G = num_kv_heads`` key/value heads of size ``h =
    head_dim``, vocabulary ``V`` and a multiply-add counted as 2 FLOPs, one
    forward pass over ``L`` tokens costs::

        per layer   Q, K, V projections   2 L d h (H + 2 G)
                    output projection     2 L H h d
                    scores + A V          4 H h P
                    MLP                   2 m L d f      m = 3 gated (SwiGLU), 2 plain
        LM head                           2 L d V

        FLOPs = N * (2 L d h (2 H + 2 G) + 2 m L d f + 4 H h P) + 2 L d V

    with ``P = L (L + 1) / 2`` query-key pairs when ``causal`` (``P = L**2``
    otherwise). ``backward=True`` multiplies by 3: the backward pass computes
    two matmuls (input and weight gradient) per forward matmul. Norms,
    rotary embeddings, softmax, activations and the embedding lookup are not
    counted (elementwise, ``O(L d)``).

    Example: Llama-2-7B (``d=4096, f=11008, N=32, H=G=32, V=32000``), forward
    only, non-causal, without the LM head gives ``b / a = 24704``: verl's
    hard-coded ``seqlen**2 + 24576 * seqlen`` is this model, with ``P = L**2``.
    Counting only the causal pairs ``L (L + 1) / 2`` halves ``a`` and adds half a
    pair per token to ``b`` (``b / a = 49409``).

    Attributes:
        hidden_size, intermediate_size, num_layers, num_heads: ``d, f, N, H``.
        num_kv_heads: ``G`` (grouped-query attention); ``None`` means ``H``.
        head_dim: ``h``; ``None`` means ``d / H``.
        vocab_size: ``V`` of the LM head; 0 leaves the head out.
        gated_mlp: three ``d x f`` matmuls (SwiGLU/GeGLU) instead of two.
        causal: count only the causal half of the attention pairs.
        backward: count forward + backward (x3) instead of the forward only.
        feature_names: the batch feature(s) forming the sequence when called on
            a :class:`~balancer.batch.BaseBatch`; empty means every key of
            ``batch.features`` (with ``include_contextual``, every key but the
            contextual ones, which are added once as such).
        interleaved, include_contextual: see
            :func:`~balancer.workloads.sequence_lengths`.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int = 0
    gated_mlp: bool = True
    causal: bool = True
    backward: bool = True
    feature_names: Sequence[str] = ()
    interleaved: bool = False
    include_contextual: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.feature_names, str) or len(tuple(self.feature_names)):
            object.__setattr__(self, "feature_names", _names(self.feature_names))
        else:
            object.__setattr__(self, "feature_names", ())
        _positive_int(self, "hidden_size", "intermediate_size", "num_layers", "num_heads")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"TransformerCost: hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}; pass head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _positive_int(self, "num_kv_heads", "head_dim")
        assert self.num_kv_heads is not None, "set above"
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TransformerCost: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        v = self.vocab_size
        if not is_int(v, 0):
            raise ValueError(f"TransformerCost: vocab_size={v!r}, expected an int >= 0")
        self._check_coefficients()

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], **overrides: Any) -> TransformerCost:
        """Build from a Hugging Face ``config.json`` (a plain dict is enough).

        Reads ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``
        (required), ``intermediate_size`` (default ``4 * hidden_size``),
        ``num_key_value_heads`` (default: the attention heads), ``head_dim``
        (default ``hidden_size / heads``; ``None`` counts as missing),
        ``vocab_size`` (default 0: no LM head) and decides ``gated_mlp`` from
        ``model_type`` (Llama, Qwen, Mistral, Gemma, ... are gated) or else
        ``hidden_act`` (``silu``/``swish`` gated, ``gelu``/``relu`` plain).
        Keyword ``overrides`` replace any field (``backward=False``,
        ``gated_mlp=True``, ``feature_names=["tokens"]``, ...). Multimodal
        configs: pass ``cfg["text_config"]``.

        Example::

            TransformerCost.from_hf_config({"hidden_size": 4096, "intermediate_size": 11008,
                "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000,
                "hidden_act": "silu"})

        Raises:
            ValueError: a required field is missing, a field is not a positive
                int, the config describes a mixture of experts (not modelled:
                pass the active FFN width as ``intermediate_size`` override),
                or ``cfg`` is not a mapping.
        """
        if not isinstance(cfg, Mapping):
            raise ValueError(f"cfg is a {type(cfg).__name__}, expected a mapping (config.json as a dict)")
        moe = [k for k in _MOE_FIELDS if cfg.get(k)]
        if moe and "intermediate_size" not in overrides:
            raise ValueError(
                f"config has mixture-of-experts fields {moe}; TransformerCost models dense "
                "MLPs: pass intermediate_size=<active experts x expert width> as an override"
            )

        def get(key: str, default: Any = None, required: bool = False) -> Any:
            value = cfg.get(key)
            if value is None:
                if required:
                    raise ValueError(f"config is missing {key!r} (required by TransformerCost.from_hf_config)")
                return default
            if not is_int(value, 0):
                raise ValueError(f"config field {key}={value!r}, expected a non-negative int")
            return value

        hidden = get("hidden_size", required=True)
        heads = get("num_attention_heads", required=True)
        act = str(cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))).lower()
        gated = cfg.get("model_type") in _GATED_MODEL_TYPES or act in _GATED_ACTS
        fields: dict[str, Any] = {
            "hidden_size": hidden,
            "intermediate_size": get("intermediate_size", 4 * hidden),
            "num_layers": get("num_hidden_layers", required=True),
            "num_heads": heads,
            "num_kv_heads": get("num_key_value_heads", heads),
            "head_dim": get("head_dim"),
            "vocab_size": get("vocab_size", 0),
            "gated_mlp": gated,
        }
        fields.update(overrides)
        return cls(**fields)

    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, c)`` with ``FLOPs(L) = a L^2 + b L + c`` (``c = 0``)."""
        assert self.head_dim is not None and self.num_kv_heads is not None, "set in __post_init__"
        d, f, n, h = self.hidden_size, self.intermediate_size, self.num_layers, self.head_dim
        q, g = self.num_heads, self.num_kv_heads
        linear = 2 * d * h * (2 * q + 2 * g) + 2 * (3 if self.gated_mlp else 2) * d * f
        pair = 4 * q * h  # scores and A V, all heads, per query-key pair
        mult = 3 if self.backward else 1
        head = 2 * d * self.vocab_size
        if self.causal:  # pair * L (L + 1) / 2
            return float(mult * n * pair / 2), float(mult * (n * (linear + pair / 2) + head)), 0.0
        return float(mult * n * pair), float(mult * (n * linear + head)), 0.0

    def of_lengths(self, lengths: _A) -> _A:
        """FLOPs per sequence for ``lengths`` ``[N]``, float64, same type and device.

        A numpy array (or list) gives a numpy array, a tensor a tensor on its
        device; nothing is copied between host and device. Exact up to
        ``2**53`` FLOPs.

        Example: ``TransformerCost(64, 256, 2, 4, vocab_size=0).of_lengths(np.array([0, 1]))``
        is ``[0, a + b]``.

        Raises:
            ValueError: a numpy/list input has negative or non-finite entries
                (a tensor is not inspected: that would read device memory).
        """
        a, b, c = self.coefficients()
        if isinstance(lengths, torch.Tensor):
            x = lengths.to(torch.float64)
            return (a * x + b) * x + c
        arr = np.asarray(lengths, dtype=np.float64)
        if arr.size and not (np.isfinite(arr).all() and arr.min() >= 0):
            i = int(np.flatnonzero(~(np.isfinite(arr) & (arr >= 0)))[0])
            raise ValueError(f"lengths[{i}] = {arr.flat[i]}, expected a finite value >= 0")
        return np.asarray((a * arr + b) * arr + c, dtype=np.float64)

    def __call__(self, batch: Any) -> torch.Tensor:
        """Per-sample FLOPs, int64 ``[batch.batch_size]`` on the batch's device.

        Rounded and clamped to ``[0, MAX_COST]``; padding samples cost 0. With
        empty ``feature_names`` the length sums every key of ``batch.features``
        (each once: with ``include_contextual`` the contextual keys count as
        contextual, not twice).
        """
        names = self.feature_names
        if not names and not is_token_batch(batch):  # a token batch's length is its seq_lens
            skip = set(batch.contextual_feature_names) if self.include_contextual else set()
            keys: list[str] = batch.features.keys()  # a KJT: iterating it is not its keys
            names = tuple(k for k in keys if k not in skip)
        lengths = sequence_lengths(
            batch, names, interleaved=self.interleaved, include_contextual=self.include_contextual
        )
        return _evaluate(batch, lengths, *self.coefficients())
