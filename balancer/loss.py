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

One call per optimizer step. Under gradient accumulation a call per
micro-batch normalises each by its own count, weighting micro-batches alike
rather than samples; there, all-reduce the step's count once and divide each
micro-batch's summed loss by it (``docs/llm.md``, section 3).

Padding samples (``index >= actual_batch_size``) are excluded by slicing, so a
NaN in a padding row cannot leak into the loss. It can still reach the
gradient: the padding rows get a zero gradient, and backward multiplies it by
the local derivative of the op that made the NaN (``0 * nan`` and ``0 * inf``
are NaN). Keep padding inputs finite -- ``pad_batch`` and the shuffler write
zeros -- or mask them before such ops.

Tracing. TorchRec's pipeline fx-traces the model's forward; these functions run
a collective and check their input, so under a trace each becomes one opaque
call node of the graph, whatever name it was imported by (``from balancer
import global_mean_loss`` too: :func:`torch.fx.wrap`, also applied here, patches
only this module's names, and the traced call once failed on its input checks
with ``TraceError``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from balancer._ints import as_count

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
    fn: str,
    local_sum: torch.Tensor,
    local_count: torch.Tensor,
    pg: ProcessGroup | None,
    grad_reduction: str,
    problem: str | None = None,
    bad: torch.Tensor | None = None,
    describe: Callable[[], str] | None = None,
) -> torch.Tensor:
    """``W * local_sum / global count`` (``"mean"``), with this rank's input checks agreed.

    ``problem``: what is wrong with this rank's input, known on the host (its
    shapes, ``num_real``, ``grad_reduction``); ``bad``: a device flag for what
    only the values show (weights), ``describe`` its message. Both travel in
    the one all-reduce (see :func:`_agree`), so a rank with bad input still
    takes part in it and every rank's collectives stay paired.
    """
    if problem is None and grad_reduction not in _REDUCTIONS:
        problem = f"grad_reduction={grad_reduction!r}, expected one of {list(_REDUCTIONS)} (rank {_rank(pg)})"
    # Half precision overflows at 65504: sums and the count of a large batch
    # would turn into inf (and the loss into 0 or NaN). Accumulate in float32
    # at least; the count travels as float64.
    local_sum = local_sum.to(_accumulate_dtype(local_sum.dtype))
    count = local_count.detach().to(torch.float64).reshape(())
    count, rejected = _agree(fn, count, pg, problem, bad, describe)
    # No real item anywhere (e.g. a step made only of padding): return a zero
    # that still depends on the parameters, so backward and DDP run as usual.
    denom = torch.where(count > 0, count, torch.ones_like(count)).to(local_sum.dtype)
    scale = float(_world(pg)) if grad_reduction == "mean" else 1.0
    out = (local_sum * scale / denom).reshape(())
    if rejected is not None:
        # On a device (no host read): a rank rejected its input. NaN times the loss makes the
        # loss and the gradients NaN (items of weight 0 keep a zero one), so the step is visibly
        # bad (and an AMP GradScaler skips it).
        out = out * torch.where(rejected > 0, torch.full_like(out, float("nan")), torch.ones_like(out))
    return out


def _agree(
    fn: str,
    value: torch.Tensor,
    pg: ProcessGroup | None,
    problem: str | None,
    bad: torch.Tensor | None,
    describe: Callable[[], str] | None,
    read: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All-reduce (sum) ``value`` with this rank's verdict on its input: ``[value, rejected,
    rejected * (rank + 1)]``, one collective whatever the verdict.

    Then the rank with a ``problem`` raises it, and where the verdicts can be
    read without a device sync (CPU tensors) every rank raises: the bad rank
    its own message (``describe()`` for ``bad``), the others one naming it.
    On a device, reading them would stall the host every step: the bad rank
    still raises what its host knows, and the summed verdict comes back for
    the others (the caller makes their loss and gradients NaN with it),
    unless ``read`` (the caller reads the value on the host anyway).

    Returns:
        ``(sum of value, None)`` on the CPU, ``(sum of value, sum of verdicts)`` on a device.
    """
    world, rank = _world(pg), _rank(pg)
    flag = torch.full((), float(problem is not None), dtype=torch.float64, device=value.device)
    if bad is not None:
        flag = torch.maximum(flag, bad.to(torch.float64))
    msg = torch.stack([value.to(torch.float64), flag, flag * (rank + 1)])
    if world > 1:
        dist.all_reduce(msg, op=dist.ReduceOp.SUM, group=pg)
    if problem is not None:
        raise ValueError(problem)
    if not (read or _host_readable(msg)):
        return msg[0], msg[1]
    rejected, who = msg[1:].tolist()
    if rejected > 0:
        if describe is not None and flag.item() > 0:
            raise ValueError(describe())
        if rejected == 1:
            raise ValueError(f"rank {int(who) - 1} of {world} rejected its input to {fn} (see its error); "
                             f"rank {rank} stops too")
        raise ValueError(f"{int(rejected)} of {world} ranks rejected their input to {fn} (see their errors); "
                         f"rank {rank} stops too")
    return msg[0], None


def _host_readable(t: torch.Tensor) -> bool:
    """Whether reading ``t`` on the host costs no device sync (a CPU tensor)."""
    return t.device.type == "cpu"


def _weights_problem(weights: torch.Tensor, rank: int) -> str:
    """What is wrong with ``weights`` (CPU): counts of negative and non-finite values."""
    w = weights.detach().to(torch.float64)
    negative, not_finite = w < 0, ~torch.isfinite(w)
    first = w[negative | not_finite][0].item()
    return (f"weights hold {int(negative.sum())} negative and {int(not_finite.sum())} NaN or infinite values "
            f"(first {first}), expected finite weights >= 0 (rank {rank})")


def _in_trace(fn: Callable[..., torch.Tensor], args: tuple[object, ...], pg: ProcessGroup | None,
              grad_reduction: str) -> torch.Tensor | None:
    """While fx traces a forward (TorchRec's pipeline does), ``fn`` as one opaque call node
    of the graph, whatever name the caller imported it by (``torch.fx.wrap`` below patches
    only this module's names); ``None`` outside a trace."""
    for a in args:
        if isinstance(a, torch.fx.Proxy):
            kwargs = {"pg": pg, "grad_reduction": grad_reduction}
            fn = getattr(fn, "__wrapped__", fn)  # the function, not fx.wrap's patch of this module's name
            return a.tracer.create_proxy("call_function", fn, args, kwargs)  # type: ignore[return-value]
    return None


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
        weights: ``[N]`` finite non-negative weights, same device.
        pg: the data-parallel process group; ``None`` is the default group.
        grad_reduction: ``"mean"`` if gradients are averaged over ranks (DDP),
            ``"sum"`` if summed.

    Returns:
        A scalar loss to call ``backward`` on (float32 for half-precision
        ``losses``). Its average over ranks (``"mean"``) or sum over ranks
        (``"sum"``) is the global weighted mean. On a device, where reading
        the verdicts on the host would stall it every step, bad input on any
        rank makes the other ranks' loss and gradients NaN instead of raising
        there (and a bad weight, which only its values show, every rank's).

    Raises:
        ValueError: CPU tensors: a shape mismatch, an unknown
            ``grad_reduction`` or a negative, NaN or infinite weight, on
            *every* rank: the bad rank names its input, the others name the
            bad rank. The check travels in the one all-reduce, so a loop
            that catches the error and goes on keeps its collectives paired.
            On a device: a shape mismatch or ``grad_reduction`` on the bad
            rank only (after the all-reduce).
    """
    traced = _in_trace(global_weighted_mean_loss, (losses, weights), pg, grad_reduction)
    if traced is not None:
        return traced
    rank = _rank(pg)
    if losses.dim() != 1 or weights.shape != losses.shape:
        problem = (f"losses shape {tuple(losses.shape)} and weights shape {tuple(weights.shape)}, "
                   f"expected both [N] (rank {rank})")
        zero = torch.zeros((), dtype=torch.float64, device=losses.device)
        return _normalise("global_weighted_mean_loss", zero, zero, pg, grad_reduction, problem)
    acc = _accumulate_dtype(losses.dtype)
    w = weights.to(acc)
    contrib = torch.where(w != 0, losses.to(acc) * w, torch.zeros((), dtype=acc, device=losses.device))
    w64 = weights.detach().to(torch.float64)
    bad = ((w64 < 0) | ~torch.isfinite(w64)).any()
    return _normalise("global_weighted_mean_loss", contrib.sum(), w64.sum(), pg, grad_reduction, bad=bad,
                      describe=lambda: _weights_problem(weights, rank))


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
        num_real: number of real samples on this rank, ``0 <= num_real <= B``
            (a Python or numpy integer).
        pg: the data-parallel process group; ``None`` is the default group.
        grad_reduction: ``"mean"`` (DDP averages gradients) or ``"sum"``.

    Returns:
        A scalar loss to call ``backward`` on (float32 for half-precision
        ``per_sample_loss``); on a device, NaN (with NaN gradients) where
        another rank's input was bad.

    Raises:
        ValueError: on a bad shape, ``num_real`` or ``grad_reduction``: CPU
            tensors on *every* rank (the bad rank names its input, the others
            name the bad rank; the check travels in the one all-reduce), on a
            device on the bad rank only.
    """
    traced = _in_trace(global_mean_loss, (per_sample_loss, num_real), pg, grad_reduction)
    if traced is not None:
        return traced
    rank = _rank(pg)
    device = per_sample_loss.device
    problem = None
    count = None if isinstance(num_real, torch.Tensor) else as_count(num_real)
    if per_sample_loss.dim() != 1:
        problem = f"per_sample_loss shape {tuple(per_sample_loss.shape)}, expected [B] (rank {rank})"
    elif count is None or not 0 <= count <= per_sample_loss.shape[0]:
        why = " (a Python or numpy integer: a tensor would be read on the host)" \
            if isinstance(num_real, torch.Tensor) else ""
        problem = f"num_real={num_real!r}, expected an int in [0, {per_sample_loss.shape[0]}]{why} (rank {rank})"
    if problem is not None or count is None:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return _normalise("global_mean_loss", zero, zero, pg, grad_reduction, problem)
    real = per_sample_loss[:count].to(_accumulate_dtype(per_sample_loss.dtype))
    return _normalise("global_mean_loss", real.sum(), torch.full((), float(count), dtype=torch.float64,
                                                                 device=device), pg, grad_reduction)


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

    Raises:
        ValueError: an unknown ``grad_reduction`` or a ``loss`` of more than
            one element, on every rank (as the loss functions).
    """
    rank = _rank(pg)
    problem = None
    if grad_reduction not in _REDUCTIONS:
        problem = f"grad_reduction={grad_reduction!r}, expected one of {list(_REDUCTIONS)} (rank {rank})"
    elif loss.numel() != 1:
        problem = f"loss shape {tuple(loss.shape)}, expected one element (rank {rank})"
    value = loss.detach().to(torch.float64).reshape(-1)[0] if problem is None else \
        torch.zeros((), dtype=torch.float64, device=loss.device)
    total, _ = _agree("global_loss_value", value, pg, problem, None, None, read=True)
    if grad_reduction == "mean":
        total = total / _world(pg)
    return float(total.item())


# TorchRec's pipeline fx-traces model.forward; keep these as opaque calls.
torch.fx.wrap("global_mean_loss")
torch.fx.wrap("global_weighted_mean_loss")
