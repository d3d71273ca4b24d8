"""Tests for balancer.transformer_cost: hand counts, torch's FLOP counter, HF configs, verl."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer import BaseBatch, TransformerCost
from balancer.workloads import TransformerCost as FromWorkloads

SMALL = {"hidden_size": 8, "intermediate_size": 12, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2, "head_dim": 3, "vocab_size": 10}


def _hand_count(length: int, d: int, f: int, layers: int, heads: int, kv: int, hd: int,
                vocab: int, gated: bool, causal: bool) -> int:
    """Forward FLOPs by listing every matmul as (rows, inner, cols) -> 2 * r * i * c."""
    mm = []
    for _ in range(layers):
        mm += [(length, d, heads * hd), (length, d, kv * hd), (length, d, kv * hd)]  # q, k, v
        for _h in range(heads):
            for i in range(length):  # query i sees keys 0..i (causal) or all
                keys = i + 1 if causal else length
                mm += [(1, hd, keys), (1, keys, hd)]  # scores, A V
        mm += [(length, heads * hd, d)]  # output projection
        mm += [(length, d, f)] * (2 if gated else 1) + [(length, f, d)]
    if vocab:
        mm += [(length, d, vocab)]
    return sum(2 * r * i * c for r, i, c in mm)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_hand_count(gated: bool, causal: bool) -> None:
    cost = TransformerCost(**SMALL, gated_mlp=gated, causal=causal, backward=False)
    lengths = np.array([0, 1, 2, 7, 16])
    want = [_hand_count(int(n), 8, 12, 2, 4, 2, 3, 10, gated, causal) for n in lengths]
    assert cost.of_lengths(lengths).tolist() == want
    both = TransformerCost(**SMALL, gated_mlp=gated, causal=causal, backward=True)
    assert both.of_lengths(lengths).tolist() == [3 * w for w in want]


class _TinyLM(torch.nn.Module):
    """A GQA + SwiGLU decoder written with explicit matmuls (non-causal: full L x L scores)."""

    def __init__(self, d: int, f: int, layers: int, heads: int, kv: int, hd: int, vocab: int) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, hd
        self.emb = torch.nn.Embedding(vocab, d)
        lin = torch.nn.Linear
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({
                "q": lin(d, heads * hd, bias=False), "k": lin(d, kv * hd, bias=False),
                "v": lin(d, kv * hd, bias=False), "o": lin(heads * hd, d, bias=False),
                "gate": lin(d, f, bias=False), "up": lin(d, f, bias=False), "down": lin(f, d, bias=False),
            }) for _ in range(layers)
        )
        self.head = lin(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        n = tokens.numel()
        rep = self.heads // self.kv
        for blk in self.layers:
            q = blk["q"](x).view(n, self.heads, self.hd).transpose(0, 1)
            k = blk["k"](x).view(n, self.kv, self.hd).transpose(0, 1).repeat_interleave(rep, 0)
            v = blk["v"](x).view(n, self.kv, self.hd).transpose(0, 1).repeat_interleave(rep, 0)
            att = torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v
            x = x + blk["o"](att.transpose(0, 1).reshape(n, -1))
            x = x + blk["down"](torch.nn.functional.silu(blk["gate"](x)) * blk["up"](x))
        return self.head(x)


def test_matches_torch_flop_counter_forward_and_backward() -> None:
    """torch's own FLOP counter on a real module: an independent count of every matmul."""
    torch.manual_seed(0)
    model = _TinyLM(8, 12, 2, 4, 2, 3, 10)
    cost = TransformerCost(**SMALL, causal=False, backward=True)
    fwd = TransformerCost(**SMALL, causal=False, backward=False)
    for length in (1, 5, 13):
        tokens = torch.randint(0, 10, (length,))
        with FlopCounterMode(display=False) as fc:
            out = model(tokens)
        assert fc.get_total_flops() == fwd.of_lengths(np.array([length]))[0]
        with FlopCounterMode(display=False) as fc:
            model(tokens).sum().backward()
        assert fc.get_total_flops() == cost.of_lengths(np.array([length]))[0]
        assert out.shape == (length, 10)


def test_causal_counts_half_the_pairs_plus_diagonal() -> None:
    full = TransformerCost(**SMALL, causal=False)
    half = TransformerCost(**SMALL, causal=True)
    (a_f, b_f, _), (a_h, b_h, _) = full.coefficients(), half.coefficients()
    assert a_h == a_f / 2 and b_h == b_f + a_f / 2  # P = L (L + 1) / 2


LLAMA2_7B = {  # fields of meta-llama/Llama-2-7b-hf config.json
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "vocab_size": 32000, "hidden_act": "silu", "rms_norm_eps": 1e-5, "head_dim": None,
}


def test_verl_constant_is_a_7b_model_without_causal_masking() -> None:
    # verl's workload seqlen^2 + 24576 seqlen: b / a of a d = 4096 model whose
    # MLP is 4d wide (24 L d^2 + 4 L^2 d per layer), counting all L^2 pairs.
    gpt = TransformerCost(hidden_size=4096, intermediate_size=4 * 4096, num_layers=32,
                          num_heads=32, gated_mlp=False, causal=False, backward=False)
    a, b, _ = gpt.coefficients()
    assert b / a == 24576
    # Llama-2-7B is within 0.6 % of it; causal masking halves a, doubling b / a.
    llama = TransformerCost.from_hf_config(LLAMA2_7B, vocab_size=0, causal=False)
    a, b, _ = llama.coefficients()
    assert b / a == 24704 and abs(b / a / 24576 - 1) < 0.006
    a_c, b_c, _ = TransformerCost.from_hf_config(LLAMA2_7B, vocab_size=0).coefficients()
    assert b_c / a_c == pytest.approx(2 * 24704, rel=1e-4)


def test_from_hf_config_fields_and_six_n_rule() -> None:
    cost = TransformerCost.from_hf_config(LLAMA2_7B)
    assert (cost.hidden_size, cost.intermediate_size, cost.num_layers, cost.num_heads,
            cost.num_kv_heads, cost.head_dim, cost.vocab_size, cost.gated_mlp) == (
        4096, 11008, 32, 32, 32, 128, 32000, True)
    # Linear term of forward + backward = 6 x matmul parameters (the "6 N D" rule).
    params = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 4096 * 32000
    a, b, _ = TransformerCost.from_hf_config(LLAMA2_7B, causal=False).coefficients()
    assert b == 6 * params
    qwen = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "vocab_size": 151936, "hidden_act": "silu"}
    q = TransformerCost.from_hf_config(qwen)
    assert (q.num_kv_heads, q.head_dim) == (2, 64)
    neox = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "gelu"}
    n = TransformerCost.from_hf_config(neox)
    assert (n.gated_mlp, n.intermediate_size, n.vocab_size, n.num_kv_heads) == (False, 256, 0, 4)
    assert TransformerCost.from_hf_config(neox, gated_mlp=True).gated_mlp
    assert FromWorkloads is TransformerCost


@pytest.mark.parametrize(("cfg", "match"), [
    ({"num_hidden_layers": 2, "num_attention_heads": 4}, "config is missing 'hidden_size'"),
    ({"hidden_size": 64, "num_attention_heads": 4}, "config is missing 'num_hidden_layers'"),
    ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": "4"},
     "config field num_attention_heads='4', expected a non-negative int"),
    ({"hidden_size": 64, "num_hidden_layers": 0, "num_attention_heads": 4},
     r"TransformerCost: num_layers=0, expected an int >= 1"),
    ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3},
     "num_heads=4 is not a multiple of num_kv_heads=3"),
    ({"hidden_size": 60, "num_hidden_layers": 2, "num_attention_heads": 8},
     "hidden_size=60 is not divisible by num_heads=8; pass head_dim"),
    ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts_per_tok": 2},
     "mixture-of-experts fields"),
])
def test_from_hf_config_errors(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TransformerCost.from_hf_config(cfg)


def test_of_lengths_numpy_torch_and_batch() -> None:
    cost = TransformerCost(**SMALL)
    a, b, _ = cost.coefficients()
    lens = [0, 3, 9]
    want = [a * n * n + b * n for n in lens]
    assert cost.of_lengths(np.array(lens)).tolist() == want
    t = cost.of_lengths(torch.tensor(lens))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.tolist() == want
    with pytest.raises(ValueError, match=r"lengths\[1\] = nan, expected a finite value >= 0"):
        cost.of_lengths(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match=r"lengths\[0\] = -2.0"):
        cost.of_lengths([-2, 1])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["tok", "img"], values=torch.arange(15),
                                              lengths=torch.tensor([3, 9, 0, 1, 2, 0]))
    batch = BaseBatch(features=kjt, batch_size=3, feature_to_max_seqlen={"tok": 16, "img": 4},
                      actual_batch_size=2)
    # No feature_names: every key counts (3 + 1, 9 + 2); the padding sample costs 0.
    assert cost(batch).tolist() == [round(a * 16 + b * 4), round(a * 121 + b * 11), 0]
    only = TransformerCost(**SMALL, feature_names=["tok"])
    assert only(batch).tolist() == [round(a * 9 + b * 3), round(a * 81 + b * 9), 0]


def test_every_key_with_contextual_features_counts_each_once() -> None:
    # Empty feature_names ("every key") with include_contextual=True always raised:
    # the contextual key was both in "every key" and contextual.
    f = KeyedJaggedTensor(keys=["item", "user"], values=torch.zeros(4, dtype=torch.int64),
                          lengths=torch.tensor([2, 1, 1, 0]))
    batch = BaseBatch(features=f, batch_size=2, feature_to_max_seqlen={}, contextual_feature_names=["user"])
    with_ctx = TransformerCost(64, 128, 1, 4, include_contextual=True)
    a, b, c = with_ctx.coefficients()
    lens = torch.tensor([3.0, 1.0], dtype=torch.float64)  # item + user, once each
    assert with_ctx(batch).tolist() == torch.round((a * lens + b) * lens + c).long().tolist()
    assert with_ctx(batch).tolist() == TransformerCost(64, 128, 1, 4)(batch).tolist()
