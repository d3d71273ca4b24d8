"""Globally normalised losses: shuffling must not change what the model learns.

The balanced shuffler changes *which rank* computes a sample, and how many
real (non-padding) samples or tokens each rank holds. A loss averaged per rank
(``loss.mean()`` on every rank, then DDP's gradient average) weights a sample
by ``1 / (W * n_r)``, where ``n_r`` is its rank's count: moving samples changes
the weights and hence the gradient. Normalising by the *global* count removes
the dependence on placement.

Math. Rank ``r`` holds real samples (or tokens) ``i`` with losses ``l_i`` and
weights ``w_i`` (1 for a plain mean). Let ``S_r = sum_i w_i l_i`` over rank
``r``'s items and ``N = sum_r sum_i w_i`` (one all-reduce). Each rank returns::

    grad_reduction="mean":  loss_r = W * S_r / N
    grad_reduction="sum":   loss_r =     S_r / N

* Dense parameters under DDP (gradients *averaged* over the ``W`` ranks, the
  default of ``DistributedModelParallel``) get
  ``(1 / W) sum_r grad(W S_r / N) = grad(sum_i w_i l_i) / N``: the gradient of
  the global mean, whatever the placement. Use ``"mean"``.
* With gradients *summed* over ranks (a SUM comm hook, or no DDP and a manual
  all-reduce), ``"sum"`` gives the same global-mean gradient.
* Model-parallel embedding tables (TorchRec row/table-wise sharding) receive
  the *sum* over ranks of the per-rank gradients through the backward of the
  output all-to-all, so with ``"mean"`` they see ``W`` times the global-mean
  gradient -- the same factor as a standard TorchRec job with per-rank mean
  losses and equal batches. The factor is a constant: it does not depend on
  where samples are, so balancing still leaves the update unchanged.

Either way the loss, and every gradient, depends only on the *set* of samples
in the global batch, not on their placement (up to float32 summation order).

Padding samples (``index >= actual_batch_size``) are excluded by slicing, so a
NaN in a padding row cannot leak into the loss. It can still reach the
gradient: the padding rows get a zero gradient, and backward multiplies it by
the local derivative of the op that made the NaN (``0 * nan`` and ``0 * inf``
are NaN). Keep padding inputs finite -- ``pad_batch`` and the shuffler write
zeros -- or mask them before such ops.

Tracing. TorchRec's pipeline fx-traces the model's forward; these functions run
a collective, so they are registered with :func:`torch.fx.wrap` here. fx patches
wrapped functions only in the namespace where they were registered: call them
as ``balancer.loss.global_mean_loss`` (module attribute), or, after ``from
balancer.loss import global_mean_loss``, register the name again in your module
with ``torch.fx.wrap("global_mean_loss")``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from balancer._ints import is_int

__all__ = ["global_loss_value", "global_mean_loss", "global_weighted_mean_loss"]

_REDUCTIONS = ("mean", "sum")


def _world(pg: ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(pg)


def _rank(pg: ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(pg)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or float32 for half-precision losses (sums and counts past 65504)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _normalise(
    local_sum: torch.Tensor,
    local_count: torch.Tensor,
    pg: ProcessGroup | None,
    grad_reduction: str,
) -> torch.Tensor:
    if grad_reduction not in _REDUCTIONS:
        raise ValueError(
            f"grad_reduction={grad_reduction!r}, expected one of {list(_REDUCTIONS)} "
            f"(rank {_rank(pg)})"
        )
    world = _world(pg)
    # Half precision overflows at 65504: sums and the count of a large batch
    # would turn into inf (and the loss into 0 or NaN). Accumulate in float32
    # at least; the count travels as float64.
    local_sum = local_sum.to(_accumulate_dtype(local_sum.dtype))
    count = local_count.detach().to(torch.float64).reshape(1).clone()
    if world > 1:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=pg)
    # No real item anywhere (e.g. a step made only of padding): return a zero
    # that still depends on the parameters, so backward and DDP run as usual.
    denom = torch.where(count > 0, count, torch.ones_like(count)).to(local_sum.dtype)
    scale = float(world) if grad_reduction == "mean" else 1.0
    return (local_sum * scale / denom).reshape(())


def global_weighted_mean_loss(
    losses: torch.Tensor,
    weights: torch.Tensor,
    *,
    pg: ProcessGroup | None = None,
    grad_reduction: str = "mean",
) -> torch.Tensor:
    """``W * sum(w * l) / all_reduce(sum(w))`` (``"mean"``), see the module doc.

    Use for per-token losses (``weights`` = 1 for real tokens, 0 for masked
    ones) or weighted samples. Items with weight 0 contribute nothing to the
    loss, even if their loss is NaN or inf (the gradient: see the module doc).

    Args:
        losses: ``[N]`` per-item losses on this rank (floating point).
        weights: ``[N]`` non-negative weights, same device.
        pg: the data-parallel process group; ``None`` is the default group.
        grad_reduction: ``"mean"`` if gradients are averaged over ranks (DDP),
            ``"sum"`` if summed.

    Returns:
        A scalar loss to call ``backward`` on (float32 for half-precision
        ``losses``). Its average over ranks (``"mean"``) or sum over ranks
        (``"sum"``) is the global weighted mean.

    Raises:
        ValueError: on a shape mismatch or an unknown ``grad_reduction``, before
            any collective.
    """
    if losses.dim() != 1 or weights.shape != losses.shape:
        raise ValueError(
            f"losses shape {tuple(losses.shape)} and weights shape {tuple(weights.shape)}, "
            f"expected both [N] (rank {_rank(pg)})"
        )
    acc = _accumulate_dtype(losses.dtype)
    w = weights.to(acc)
    contrib = torch.where(w != 0, losses.to(acc) * w, torch.zeros((), dtype=acc, device=losses.device))
    return _normalise(contrib.sum(), weights.detach().to(torch.float64).sum(), pg, grad_reduction)


def global_mean_loss(
    per_sample_loss: torch.Tensor,
    num_real: int,
    *,
    pg: ProcessGroup | None = None,
    grad_reduction: str = "mean",
) -> torch.Tensor:
    """Mean of the real samples' losses over *all* ranks, see the module doc.

    Example: rank 0 holds losses ``[1, 3]`` (both real), rank 1 holds ``[2,
    pad]`` (``num_real=1``). ``N = 3``, the global mean is ``(1 + 3 + 2) / 3 =
    2``. With ``"mean"`` rank 0 returns ``2 * 4 / 3``, rank 1 ``2 * 2 / 3``;
    their average is 2 and DDP's averaged gradient is that of the global mean.

    Args:
        per_sample_loss: ``[B]`` losses, samples ``[0, num_real)`` real, the
            rest padding (``batch.actual_batch_size`` real samples first).
        num_real: number of real samples on this rank, ``0 <= num_real <= B``.
        pg: the data-parallel process group; ``None`` is the default group.
        grad_reduction: ``"mean"`` (DDP averages gradients) or ``"sum"``.

    Returns:
        A scalar loss to call ``backward`` on (float32 for half-precision
        ``per_sample_loss``).

    Raises:
        ValueError: on a bad shape, ``num_real`` or ``grad_reduction``, before
            any collective.
    """
    if per_sample_loss.dim() != 1:
        raise ValueError(
            f"per_sample_loss shape {tuple(per_sample_loss.shape)}, expected [B] (rank {_rank(pg)})"
        )
    b = per_sample_loss.shape[0]
    if not is_int(num_real, 0) or num_real > b:
        raise ValueError(f"num_real={num_real!r}, expected an int in [0, {b}] (rank {_rank(pg)})")
    real = per_sample_loss[:num_real].to(_accumulate_dtype(per_sample_loss.dtype))
    count = torch.tensor(float(num_real), dtype=torch.float64, device=per_sample_loss.device)
    return _normalise(real.sum(), count, pg, grad_reduction)


def global_loss_value(
    loss: torch.Tensor, *, pg: ProcessGroup | None = None, grad_reduction: str = "mean"
) -> float:
    """The global mean loss, for logging: one all-reduce of ``loss``'s value.

    Args:
        loss: this rank's output of :func:`global_mean_loss` (or the weighted
            variant) with the same ``grad_reduction``.
        pg: the data-parallel process group; ``None`` is the default group.
        grad_reduction: as passed to the loss function.

    Returns:
        The same float on every rank.
    """
    if grad_reduction not in _REDUCTIONS:
        raise ValueError(f"grad_reduction={grad_reduction!r}, expected one of {list(_REDUCTIONS)}")
    world = _world(pg)
    value = loss.detach().to(torch.float64).reshape(1).clone()
    if world > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=pg)
    if grad_reduction == "mean":
        value /= world
    return float(value.item())


# TorchRec's pipeline fx-traces model.forward; keep these as opaque calls.
torch.fx.wrap("global_mean_loss")
torch.fx.wrap("global_weighted_mean_loss")
