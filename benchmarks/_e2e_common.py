"""Model, batch type and length samplers shared by the end-to-end benchmark."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from balancer import BaseBatch

HIDDEN = 64
HEADS = 2
HEAD_DIM = HIDDEN // HEADS
DISTRIBUTIONS = ("zipf", "lognormal", "uniform")


@dataclasses.dataclass(kw_only=True)
class E2EBatch(BaseBatch):
    dense: torch.Tensor  # [B, 4] per-user dense features


def sample_lengths(name: str, n: int, max_len: int, rng: np.random.Generator, alpha: float = 1.2) -> np.ndarray:
    """``n`` sequence lengths in ``[1, max_len]``.

    zipf: truncated Zipf, P(L) proportional to L^-alpha on 1..max_len (the
    predecessor's published setting is alpha=1.2, max 4096); lognormal:
    exp(N(6, 1)) clipped; uniform: uniform on 1..max_len.
    """
    if name == "zipf":
        support = np.arange(1, max_len + 1)
        p = support.astype(np.float64) ** -alpha
        return rng.choice(support, size=n, p=p / p.sum())
    if name == "lognormal":
        return np.clip(np.exp(rng.normal(6.0, 1.0, n)), 1, max_len).astype(np.int64)
    if name == "uniform":
        return rng.integers(1, max_len + 1, n)
    raise ValueError(f"unknown length distribution {name!r}, expected one of {DISTRIBUTIONS}")


class AttentionLayer(nn.Module):
    """Embedding -> one causal multi-head self-attention layer -> mean pool -> logit."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN + 4, 1)

    def forward(self, seq: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        n = seq.numel()
        if n == 0:
            pooled = torch.zeros(HIDDEN)
        else:
            x = self.emb(seq)
            # Contiguous [1, H, L, hd] inputs let SDPA use its fused CPU kernel;
            # permuted views fall back to the math path, which materialises the
            # L x L scores and grows faster than L^2 (590 ms vs 70 ms at L=4096).
            q, k, v = self.qkv(x).view(n, 3, HEADS, HEAD_DIM).permute(1, 2, 0, 3).unsqueeze(1).contiguous()
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [1, H, L, hd]
            pooled = self.proj(att[0].transpose(0, 1).reshape(n, HIDDEN)).mean(0)
        return self.head(torch.cat([pooled, dense])).squeeze(0)
