"""A small HSTU-style ranking model (Zhai et al. 2024) for the balancer example.

``HSTURanker(batch) -> (loss, (loss, logits, labels))``:

1. ``EmbeddingCollection`` (sharded by ``DistributedModelParallel``) looks up an
   item and an action embedding per history position; they are summed.
2. :class:`HSTUEncoder`: ``num_layers`` causal HSTU layers over each user's
   jagged history (token-wise projections on all tokens at once, attention
   sample by sample, no padding). Per layer::

       U, V, Q, K = split(silu(W1 norm(x)))
       A = tril(silu(Q K^T)) / max_seqlen
       x = x + W2 (norm(A V) * U)

   The user representation is the output at the last history position. The
   attention costs ``~L**2`` per sample: a rank that draws long histories is
   slow, and its cost is what ``HSTUAttentionCost`` estimates.
3. :class:`RankingHead`: MLP over ``[user, dense]`` -> one logit; per-sample
   binary cross-entropy normalised by the *global* number of real samples
   (:func:`balancer.loss.global_mean_loss`), so moving samples between ranks
   leaves the gradient unchanged.

TorchRec's pipeline fx-traces :meth:`HSTURanker.forward` to find the input of
the sharded ``EmbeddingCollection``. Submodules without a sharded child are
leaves of that trace, so the data-dependent code (the per-sample loop, the
loss's all-reduce) lives inside the leaf modules ``HSTUEncoder`` and
``RankingHead`` and the top-level forward only routes. (Data-dependent code
called directly in the top-level forward would need ``torch.fx.wrap``.)
Every sample's result depends on that sample alone (the attention divides by
the constant ``max_seqlen``), so moving it to another rank does not change it.
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
    """One HSTU layer on jagged sequences: token-wise work on all ``[T, d]``
    tokens at once, causal attention per sample (cost ``~L**2`` each)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, linear_dim: int, max_seqlen: int) -> None:
        super().__init__()
        self.h, self.da, self.dl, self.max_seqlen = num_heads, head_dim, linear_dim, max_seqlen
        self.norm_in = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, num_heads * (2 * linear_dim + 2 * head_dim))
        self.norm_attn = nn.LayerNorm(num_heads * linear_dim)
        self.out = nn.Linear(num_heads * linear_dim, dim)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        h, da, dl = self.h, self.da, self.dl
        u, v, q, k = F.silu(self.uvqk(self.norm_in(x))).split([h * dl, h * dl, h * da, h * da], -1)
        attn = []
        for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            n = qs.shape[0]
            if n == 0:  # a padding sample
                continue
            qh, kh, vh = (t.view(n, h, -1).transpose(0, 1) for t in (qs, ks, vs))  # [H, n, *]
            scores = F.silu(qh @ kh.transpose(-1, -2)) / self.max_seqlen
            scores = scores.tril()  # causal: position i attends to j <= i
            attn.append((scores @ vh).transpose(0, 1).reshape(n, h * dl))
        a = torch.cat(attn) if attn else x.new_zeros(0, h * dl)
        return x + self.out(self.norm_attn(a) * u)


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
        x = items.values() + actions.values()  # [T, d]
        sizes = lengths.tolist()  # per-sample attention is data-dependent: a leaf module
        for layer in self.layers:
            x = layer(x, sizes)
        # The user representation: the output at each history's last position.
        user = x.new_zeros(lengths.numel(), x.shape[1])
        has = lengths > 0
        last = torch.cumsum(lengths, 0) - 1
        user[has] = x[last[has]]
        return user


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
