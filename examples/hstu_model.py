"""A small HSTU-style ranking model (Zhai et al. 2024) for the balancer example.

``HSTURanker(batch) -> (loss, (loss, logits, labels))``:

1. ``EmbeddingCollection`` (sharded by ``DistributedModelParallel``) looks up an
   item and an action embedding per history position; they are summed.
2. :class:`HSTUEncoder`: ``num_layers`` causal HSTU layers over each user's
   history, padded to the batch's longest history with a mask. Per layer::

       U, V, Q, K = split(silu(W1 norm(x)))
       A = silu(Q K^T) / max_seqlen * causal_mask * valid_mask
       x = x + W2 (norm(A V) * U)

   The user representation is the output at the last history position. Its
   cost grows with ``L**2``: long histories make a rank slow.
3. :class:`RankingHead`: MLP over ``[user, dense]`` -> one logit; per-sample
   binary cross-entropy normalised by the *global* number of real samples
   (:func:`balancer.loss.global_mean_loss`), so moving samples between ranks
   leaves the gradient unchanged.

TorchRec's pipeline fx-traces :meth:`HSTURanker.forward` to find the input of
the sharded ``EmbeddingCollection``. Submodules without a sharded child are
leaves of that trace, so the data-dependent code (padding to the batch's
longest history, the loss's all-reduce) lives inside the leaf modules
``HSTUEncoder`` and ``RankingHead`` and the top-level forward only routes.
Every sample's result depends on that sample alone: dividing by the constant
``max_seqlen`` (not the batch's longest history) keeps padding out of it.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from synthetic_data import ACTION_FEATURE, DENSE_DIM, ITEM_FEATURE, HSTUBatch
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor

from balancer.loss import global_mean_loss


class HSTULayer(nn.Module):
    """One HSTU layer on padded sequences ``[B, L, d]`` with a validity mask."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, linear_dim: int, max_seqlen: int) -> None:
        super().__init__()
        self.h, self.da, self.dl, self.max_seqlen = num_heads, head_dim, linear_dim, max_seqlen
        self.norm_in = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, num_heads * (2 * linear_dim + 2 * head_dim))
        self.norm_attn = nn.LayerNorm(num_heads * linear_dim)
        self.out = nn.Linear(num_heads * linear_dim, dim)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h, da, dl = self.h, self.da, self.dl
        u, v, q, k = F.silu(self.uvqk(self.norm_in(x))).split([h * dl, h * dl, h * da, h * da], -1)
        q = q.view(b, n, h, da).transpose(1, 2)
        k = k.view(b, n, h, da).transpose(1, 2)
        v = v.view(b, n, h, dl).transpose(1, 2)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        allowed = causal.unsqueeze(0) & valid.unsqueeze(1)  # [B, L, L], key j valid and j <= i
        scores = F.silu(q @ k.transpose(-1, -2)) / self.max_seqlen
        scores = scores * allowed.unsqueeze(1).to(scores.dtype)
        attn = (scores @ v).transpose(1, 2).reshape(b, n, h * dl)
        y = self.out(self.norm_attn(attn) * u)
        return x + y * valid.unsqueeze(-1).to(y.dtype)


class HSTUEncoder(nn.Module):
    """Jagged item/action embeddings -> one ``[B, d]`` vector per user."""

    def __init__(
        self, dim: int, num_heads: int, head_dim: int, linear_dim: int, num_layers: int, max_seqlen: int
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            HSTULayer(dim, num_heads, head_dim, linear_dim, max_seqlen) for _ in range(num_layers)
        )

    def forward(self, items: JaggedTensor, actions: JaggedTensor) -> torch.Tensor:
        lengths = items.lengths().to(torch.int64)
        values = items.values() + actions.values()
        b, d = lengths.numel(), values.shape[-1]
        n = max(int(lengths.max()) if b else 0, 1)
        # Scatter the jagged [T, d] values into [B, n, d]; position p of sample s.
        offsets = torch.cumsum(lengths, 0) - lengths
        sample = torch.repeat_interleave(torch.arange(b, device=values.device), lengths)
        pos = torch.arange(values.shape[0], device=values.device) - offsets[sample]
        x = values.new_zeros(b, n, d).index_put((sample, pos), values)
        valid = torch.arange(n, device=values.device).unsqueeze(0) < lengths.unsqueeze(1)
        for layer in self.layers:
            x = layer(x, valid)
        last = (lengths - 1).clamp(min=0)
        return x[torch.arange(b, device=x.device), last]


class RankingHead(nn.Module):
    """MLP over ``[user, dense]`` -> logit, and the globally normalised loss."""

    def __init__(self, dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim + DENSE_DIM, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(
        self, user: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor, num_real: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.mlp(torch.cat([user, dense], dim=1)).squeeze(1)
        per_sample = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        return global_mean_loss(per_sample, num_real), logits


class HSTURanker(nn.Module):
    """Embeddings -> HSTU encoder -> ranking head; see the module docstring."""

    def __init__(
        self,
        *,
        num_items: int,
        num_actions: int,
        dim: int = 32,
        num_heads: int = 2,
        head_dim: int = 16,
        linear_dim: int = 16,
        num_layers: int = 2,
        max_seqlen: int = 256,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="item_table", feature_names=[ITEM_FEATURE], num_embeddings=num_items, embedding_dim=dim
                ),
                EmbeddingConfig(
                    name="action_table", feature_names=[ACTION_FEATURE], num_embeddings=num_actions, embedding_dim=dim
                ),
            ],
            device=device,
        )
        self.encoder = HSTUEncoder(dim, num_heads, head_dim, linear_dim, num_layers, max_seqlen)
        self.head = RankingHead(dim)

    def forward(
        self, batch: HSTUBatch
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        # No isinstance check here: under TorchRec's fx trace batch.labels is a Proxy.
        labels = cast(torch.Tensor, batch.labels)  # HSTUBatch labels: dense float [B]
        emb = self.ec(batch.features)
        user = self.encoder(emb[ITEM_FEATURE], emb[ACTION_FEATURE])
        loss, logits = self.head(user, batch.dense, labels, batch.actual_batch_size)
        return loss, (loss.detach(), logits.detach(), labels)
