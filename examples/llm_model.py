"""A small decoder-only causal LM for examples/train_llm.py (pure torch).

Packed variable-length input, as LLM trainers feed it: the tokens of a
micro-batch's sequences are concatenated into one ``[T]`` tensor and
``lengths`` says where each sequence ends. Projections and the MLP run on all
``T`` tokens at once; attention runs per sequence (causal SDPA), so a
micro-batch costs ``sum(a L^2 + b L)`` like a variable-length flash-attention
kernel, never ``T^2``. Grouped-query attention and a SwiGLU MLP, Llama style,
so :meth:`TinyCausalLM.hf_config` describes it to
:meth:`balancer.TransformerCost.from_hf_config`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1 = nn.RMSNorm(dim)
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        h = self.norm1(x)
        q = self.q(h).view(t, self.heads, hd).transpose(0, 1)  # [H, T, hd]
        k, v = self.kv(h).view(t, 2, self.kv_heads, hd).permute(1, 2, 0, 3)  # [G, T, hd] each
        rep = self.heads // self.kv_heads
        outs = []
        for qs, ks, vs in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1), strict=True):
            # One sequence at a time: causal attention never crosses sequences.
            outs.append(F.scaled_dot_product_attention(
                qs.unsqueeze(0).contiguous(), ks.repeat_interleave(rep, 0).unsqueeze(0).contiguous(),
                vs.repeat_interleave(rep, 0).unsqueeze(0).contiguous(), is_causal=True)[0])
        att = torch.cat(outs, dim=1).transpose(0, 1).reshape(t, -1)
        x = x + self.o(att)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyCausalLM(nn.Module):
    """Embedding, ``layers`` GQA + SwiGLU blocks, final norm, LM head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.vocab, self.dim, self.ffn = vocab, dim, ffn
        self.n_layers, self.heads, self.kv_heads = layers, heads, kv_heads
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Logits ``[T, vocab]`` for packed ``tokens`` ``[T]`` of sequences ``lengths``."""
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, lengths)
        return self.head(self.norm(x))

    def hf_config(self) -> dict[str, Any]:
        """The fields of a Hugging Face ``config.json`` for this model."""
        return {
            "model_type": "llama", "hidden_size": self.dim, "intermediate_size": self.ffn,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab, "hidden_act": "silu",
        }


def token_losses(model: nn.Module, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Summed next-token cross-entropy over the packed sequences (the last token of each has no target)."""
    logits = model(tokens, lengths)
    ends = torch.tensor(lengths).cumsum(0) - 1
    keep = torch.ones(tokens.numel(), dtype=torch.bool)
    keep[ends] = False
    return F.cross_entropy(logits[:-1][keep[:-1]], tokens[1:][keep[:-1]], reduction="sum")
