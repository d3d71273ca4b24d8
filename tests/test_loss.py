"""Global loss normalisation: placement of samples on ranks must not matter."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
import torch

from balancer.loss import global_loss_value, global_mean_loss, global_weighted_mean_loss
from balancer.testing import run_workers

# 7 real samples spread over 2 ranks in different ways; each rank has B = 5 slots.
LOSSES = [0.5, 1.25, 2.0, 0.125, 3.0, 0.75, 1.5]
B = 5


def _placements() -> list[tuple[list[int], list[int]]]:
    """Sample indices on (rank 0, rank 1): every split with <= B per rank, shuffled."""
    out = []
    for n0 in range(len(LOSSES) - B, B + 1):  # 2..5 real samples on rank 0
        perm = np.random.default_rng(n0).permutation(len(LOSSES)).tolist()
        out.append((perm[:n0], perm[n0:]))
    return out


def _rank_tensor(indices: list[int]) -> torch.Tensor:
    # Real samples first, padding after with a NaN loss: it must be masked out.
    vals = [LOSSES[i] for i in indices] + [math.nan] * (B - len(indices))
    return torch.tensor(vals, dtype=torch.float32)


def _worker_mean(rank: int, world: int) -> list[tuple[float, float, list[float]]]:
    """Per placement: the loss value, the DDP-averaged gradient, and the logged value."""
    results = []
    for placement in _placements():
        mine = placement[rank]
        x = _rank_tensor(mine).requires_grad_(True)
        loss = global_mean_loss(x, len(mine))
        loss.backward()
        grad = x.grad
        assert grad is not None
        # DDP averages gradients: (1 / W) * sum over ranks; the sample's grad
        # lives on the rank holding it, so scale by 1 / W to mimic the average.
        per_sample_grad = [float(g) / world for g in grad[: len(mine)]]
        full = [0.0] * len(LOSSES)
        for i, g in zip(mine, per_sample_grad, strict=True):
            full[i] = g
        results.append((float(loss), global_loss_value(loss), full))
    return results


def test_global_mean_matches_single_process_mean_for_any_placement() -> None:
    outs = run_workers(_worker_mean, 2)
    expected = sum(LOSSES) / len(LOSSES)
    n = len(_placements())
    assert n == 4
    for p in range(n):
        (l0, v0, g0), (l1, v1, g1) = outs[0][p], outs[1][p]
        # "mean" convention: the average of the ranks' losses is the global mean.
        assert (l0 + l1) / 2 == pytest.approx(expected, rel=1e-6)
        assert v0 == v1 == pytest.approx(expected, rel=1e-6)
        # Every sample's (DDP-averaged) gradient is 1 / N, wherever it lives.
        grads = [a + b for a, b in zip(g0, g1, strict=True)]
        assert grads == pytest.approx([1 / len(LOSSES)] * len(LOSSES), rel=1e-6)


def _worker_variants(rank: int, world: int) -> dict[str, float]:
    out: dict[str, float] = {}
    # "sum" convention: the *sum* over ranks is the global mean.
    x = torch.tensor([1.0, 3.0] if rank == 0 else [2.0, 100.0])
    out["sum"] = float(global_mean_loss(x, 2 if rank == 0 else 1, grad_reduction="sum"))
    # Weighted (per-token) mean: sum(w l) / sum(w) over both ranks.
    losses = torch.tensor([1.0, 2.0, math.inf] if rank == 0 else [4.0, 8.0, 0.0])
    weights = torch.tensor([1.0, 1.0, 0.0] if rank == 0 else [0.5, 0.5, 1.0])
    out["weighted"] = global_loss_value(global_weighted_mean_loss(losses, weights))
    # A step made only of padding on every rank: zero loss, finite gradient.
    z = torch.zeros(3, requires_grad=True)
    zl = global_mean_loss(z, 0)
    zl.backward()
    assert z.grad is not None
    out["empty"] = float(zl)
    out["empty_grad_finite"] = float(bool(torch.isfinite(z.grad).all()))
    return out


def test_sum_convention_weighted_and_empty() -> None:
    r0, r1 = run_workers(_worker_variants, 2)
    assert r0["sum"] + r1["sum"] == pytest.approx((1 + 3 + 2) / 3)
    expected_weighted = (1 + 2 + 0.5 * 4 + 0.5 * 8 + 0.0) / (2 + 2)
    assert r0["weighted"] == r1["weighted"] == pytest.approx(expected_weighted)
    assert r0["empty"] == r1["empty"] == 0.0
    assert r0["empty_grad_finite"] == r1["empty_grad_finite"] == 1.0


def test_single_process_without_distributed() -> None:
    x = torch.tensor([1.0, 2.0, 6.0, math.nan])
    assert float(global_mean_loss(x, 3)) == pytest.approx(3.0)
    assert global_loss_value(global_mean_loss(x, 3)) == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(2, 2), 1), r"per_sample_loss shape \(2, 2\)"),
        ((torch.zeros(3), 4), r"num_real=4, expected an int in \[0, 3\]"),
        ((torch.zeros(3), -1), r"num_real=-1"),
        ((torch.zeros(3), True), r"num_real=True"),
    ],
)
def test_invalid_arguments(args: tuple[torch.Tensor, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        global_mean_loss(*args)


def test_invalid_reduction_and_weights() -> None:
    with pytest.raises(ValueError, match=r"grad_reduction='avg'"):
        global_mean_loss(torch.zeros(3), 3, grad_reduction="avg")
    with pytest.raises(ValueError, match=r"weights shape \(2,\)"):
        global_weighted_mean_loss(torch.zeros(3), torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_losses_over_many_items_keep_the_mean(dtype: torch.dtype) -> None:
    # The weight sum (and the loss sum) once stayed in the losses' dtype: fp16
    # overflows at 65504, and 70,000 tokens gave a loss of 0.
    n = 70_000
    losses = torch.full((n,), 0.5, dtype=dtype, requires_grad=True)
    weights = torch.ones(n)
    weights[:100] = 0  # masked tokens count for nothing
    out = global_weighted_mean_loss(losses, weights)
    assert out.dtype == torch.float32 and out.item() == 0.5
    out.backward()
    assert losses.grad is not None and losses.grad.dtype == dtype
    assert losses.grad[:100].abs().sum().item() == 0
    assert math.isclose(losses.grad[100:].float().sum().item(), 1.0, rel_tol=1e-2)
    per_sample = torch.full((n,), 1.0, dtype=dtype)
    assert global_mean_loss(per_sample, n).item() == 1.0  # the sum was inf in fp16


def _catch(fn: Any) -> str:
    """``fn()``'s ``ValueError`` message ('' if it raised none)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def _worker_one_bad_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 passes bad input to each function in turn; every rank catches the error and
    goes on, as a loop that skips a bad batch would."""
    x = torch.tensor([1.0, 3.0, 5.0, 7.0])
    bad = rank == 1
    out: dict[str, Any] = {
        "num_real": _catch(lambda: global_mean_loss(x, 5 if bad else 4)),
        "shape": _catch(lambda: global_weighted_mean_loss(x, torch.ones(3 if bad else 4))),
        "reduction": _catch(lambda: global_mean_loss(x, 4, grad_reduction="avg" if bad else "mean")),
        "negative": _catch(lambda: global_weighted_mean_loss(x, torch.tensor([1.0, -2.0, 1.0, 1.0]) if bad
                                                               else torch.ones(4))),
        "nan": _catch(lambda: global_weighted_mean_loss(x, torch.tensor([1.0, math.nan, 1.0, 1.0]) if bad
                                                          else torch.ones(4))),
        "value": _catch(lambda: global_loss_value(x[:1].sum(), grad_reduction="avg" if bad else "mean")),
    }
    # After all those errors the collectives are still paired: a correct step follows.
    loss = global_mean_loss(x * (rank + 1), 2 if rank == 0 else 1)  # global real: 1, 3 | 2
    out["after"] = global_loss_value(loss)
    return out


def test_bad_input_on_one_rank_raises_on_every_rank_and_the_next_step_is_right() -> None:
    # Once only the bad rank raised: the others blocked in the all-reduce (until
    # the bad process died), or a loop skipping the bad batch paired its next
    # all-reduce with the others' current one and returned wrong losses.
    outs = run_workers(_worker_one_bad_rank, 2, timeout=120)
    own = {"num_real": r"num_real=5, expected an int in \[0, 4\] \(rank 1\)",
           "shape": r"weights shape \(3,\), expected both \[N\] \(rank 1\)",
           "reduction": r"grad_reduction='avg'.*\(rank 1\)",
           "negative": r"weights hold 1 negative and 0 NaN or infinite values \(first -2\.0\), expected "
                       r"finite weights >= 0 \(rank 1\)",
           "nan": r"weights hold 0 negative and 1 NaN or infinite values \(first nan\).*\(rank 1\)",
           "value": r"grad_reduction='avg'.*\(rank 1\)"}
    for key, pattern in own.items():
        assert re.search(pattern, outs[1][key]), (key, outs[1][key])
        assert re.search(r"rank 1 of 2 rejected its input to global_\w+ \(see its error\); rank 0 stops too",
                         outs[0][key]), (key, outs[0][key])
    assert outs[0]["after"] == outs[1]["after"] == pytest.approx(2.0)


def test_counts_from_numpy_are_ints_and_tensors_are_refused() -> None:
    x = torch.tensor([1.0, 2.0, 6.0, math.nan])
    assert float(global_mean_loss(x, np.int64(3))) == pytest.approx(3.0)
    with pytest.raises(ValueError, match=r"num_real=tensor\(3\), expected an int in \[0, 4\] \(a Python or numpy "
                                         r"integer: a tensor would be read on the host\) \(rank 0\)"):
        global_mean_loss(x, torch.tensor(3))  # type: ignore[arg-type]


@pytest.mark.parametrize("weights", [[1.0, -1.0, 0.0], [1.0, math.inf, 1.0], [-1.0, -1.0, -1.0]])
def test_bad_weights_are_refused_on_one_process(weights: list[float]) -> None:
    # Once: [1, -1, 0] gave -1.0 and [-1, -1, -1] a 'mean' over a weight sum of 1.
    with pytest.raises(ValueError, match=r"expected finite weights >= 0 \(rank 0\)"):
        global_weighted_mean_loss(torch.tensor([1.0, 2.0, 3.0]), torch.tensor(weights))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bad_weights_on_a_device_make_the_loss_nan_without_a_host_sync() -> None:
    # On a device the weights' values are not read on the host (that would stall
    # it every step): a bad weight turns the loss into NaN instead.
    dev = torch.device("cuda")
    losses = torch.tensor([1.0, 2.0, 3.0], device=dev, requires_grad=True)
    ones, weights = torch.ones(3, device=dev), torch.tensor([1.0, -1.0, 0.0], device=dev)  # copies: before the mode
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        good = global_weighted_mean_loss(losses, ones)
        bad = global_weighted_mean_loss(losses, weights)
        mean = global_mean_loss(losses, 2)
        bad.backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert good.item() == pytest.approx(2.0) and math.isnan(bad.item()) and mean.item() == pytest.approx(1.5)
    # The weighted items' gradients are NaN; the weight-0 item's is exactly 0, as
    # on CPU it contributes nothing (torch.where passes it no gradient).
    assert losses.grad is not None
    grad = losses.grad.tolist()
    assert math.isnan(grad[0]) and math.isnan(grad[1]) and grad[2] == 0.0


def _worker_device_semantics(rank: int, world: int) -> dict[str, Any]:
    """The device path on CPU tensors (verdicts not read on the host), as on a GPU."""
    import balancer.loss as L

    L._host_readable = lambda t: False  # what a CUDA tensor gets
    x = torch.tensor([1.0, 3.0, 5.0, 7.0], requires_grad=True)
    out: dict[str, Any] = {}
    try:  # rank 1: num_real past B, known on its host
        loss = global_mean_loss(x, 5 if rank == 1 else 4)
        loss.backward()
        assert x.grad is not None
        out["num_real"] = (float(loss), bool(x.grad.isnan().all()))
    except ValueError as e:
        out["num_real"] = str(e)
    x.grad = None
    loss = global_weighted_mean_loss(x, torch.tensor([1.0, -1.0, 1.0, 1.0]) if rank == 1 else torch.ones(4))
    loss.backward()
    assert x.grad is not None
    out["weights"] = (float(loss), bool(x.grad.isnan().all()))
    out["after"] = global_loss_value(global_mean_loss(x, 4))  # paired: the right value
    return out


def test_on_a_device_bad_input_makes_the_other_ranks_loss_and_gradients_nan() -> None:
    # A CPU proxy of the GPU path: the verdicts travel, unread; a NaN loss with zero
    # gradients (the first version) would have let an optimizer step on.
    r0, r1 = run_workers(_worker_device_semantics, 2, timeout=120)
    assert r1["num_real"].startswith("num_real=5, expected an int in [0, 4]"), r1
    loss0, nan_grads0 = r0["num_real"]
    assert math.isnan(loss0) and nan_grads0
    for loss, nan_grads in (r0["weights"], r1["weights"]):
        assert math.isnan(loss) and nan_grads
    assert r0["after"] == r1["after"] == pytest.approx(4.0)


class _LossHead(torch.nn.Module):
    """Calls the loss functions by the names this module imported them by (not
    ``balancer.loss.<name>``), as a user's model file does."""

    def forward(self, x: torch.Tensor, num_real: int) -> tuple[torch.Tensor, torch.Tensor]:
        return global_mean_loss(x * 2, num_real), global_weighted_mean_loss(x, x.abs())


def test_a_traced_forward_keeps_the_losses_as_opaque_calls() -> None:
    # TorchRec's pipeline fx-traces the forward; imported by name, the functions
    # were traced into and failed on their input checks with TraceError.
    gm = torch.fx.symbolic_trace(_LossHead())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert global_mean_loss in targets and global_weighted_mean_loss in targets
    x = torch.tensor([1.0, 2.0, 3.0])
    got, want = gm(x, 2), _LossHead()(x, 2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and float(got[0]) == 3.0
