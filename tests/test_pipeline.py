"""The balanced pipeline trains the same model as plain TorchRec and a plain loop.

Two gloo ranks train the example HSTU model (row-wise sharded item table,
table-wise action table, fused SGD; dense SGD under DDP) for 12 steps, the
last batch padded, in several modes from the same seed and data:

* ``torchrec``: TorchRec's ``TrainPipelineSparseDist``.
* ``off``: the balanced pipeline with an ``IdentityBatchShuffler``.
* ``on``: the balanced pipeline with a ``BatchShuffler``.
* ``loop_off`` / ``loop_on``: forward/backward/step per batch, no pipeline,
  without / with ``shuffler.shuffle(batch)`` first.
* ``prefetch_on``: the balanced prefetch pipeline (its prefetch stage
  emulated on CPU, where TorchRec skips it).
* ``on_allgather``: ``on`` with ``comm="allgather"``.

``off`` must equal ``torchrec`` bit for bit; a pipeline must equal its loop
bit for bit (same batches, same kernels). Balancing moves samples between
ranks, which changes float32 summation order -- in the attention's padded
matmuls, the per-rank loss sums, DDP's all-reduce and the embedding
gradients' accumulation -- so ``on`` vs ``off`` is compared with a tolerance:

* each step's loss is a sum of ~32 per-sample terms; reordering it changes the
  result by at most ~32 ulp, i.e. relative 32 * 6e-8 = 2e-6 < ``RTOL = 1e-5``;
* a parameter moves by ``lr * grad`` per step; the gradient differences are of
  that same relative size, so after 12 steps with lr 0.05 and |grad| < 1 the
  parameters differ by < 12 * 0.05 * 2e-6 ~ 1e-6 absolute at worst
  (``ATOL = 1e-6``), far less in practice.

The test asserts the bound and that the measured deviation is below a tenth
of it, so a real divergence (a sample lost or counted twice changes the loss
by ~1/64 relative) cannot hide inside the tolerance.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torchrec
from torchrec.distributed.train_pipeline import (
    PrefetchTrainPipelineSparseDist,
    TrainPipelineSparseDist,
)

import balancer.pipeline
from balancer.batch import padding_like
from balancer.config import BalancerConfig
from balancer.loss import global_loss_value
from balancer.partition import balanced_partition, karmarkar_karp
from balancer.pipeline import (
    BalancedPrefetchTrainPipelineSparseDist,
    BalancedTrainPipelineSparseDist,
    _prefetch_runs_on_contexts,
    create_train_pipeline,
)
from balancer.shuffler import BatchShuffler, IdentityBatchShuffler
from balancer.testing import run_workers
from balancer.workloads import TokenCount
from tests.tbe import skip_without_tbe

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from synthetic_data import ITEM_FEATURE, SyntheticHSTUData  # noqa: E402
from train_hstu import build_model, parse_args  # noqa: E402

RTOL = 1e-5
ATOL = 1e-6
STEPS = 12
# mode -> (how to train, shuffler comm or None for no balancing)
MODES = {
    "torchrec": ("torchrec", None),
    "off": ("pipeline", None),
    "on": ("pipeline", "all2all"),
    "on_allgather": ("pipeline", "allgather"),
    "prefetch_on": ("prefetch", "all2all"),
    "loop_off": ("loop", None),
    "loop_on": ("loop", "all2all"),
    "on_calibrated": ("pipeline", "calibrated"),
}
ARGS = ["--batch-size", "16", "--max-seqlen", "48", "--dim", "16", "--num-layers", "1", "--lr", "0.05"]


class _CPUPrefetch(BalancedPrefetchTrainPipelineSparseDist):
    """Emulates TorchRec's prefetch stage without streams (it returns early on CPU)."""

    def _prefetch(self, arg: Any) -> None:
        # TorchRec 1.8 passes the batch's context; 1.6 passes the batch (None:
        # nothing to prefetch) and keeps the context on the pipeline.
        if arg is None:
            return
        context = arg if hasattr(arg, "module_input_post_prefetch") else self._context
        context.module_input_post_prefetch.clear()
        context.module_contexts_post_prefetch.clear()
        for module in self._pipelined_modules:
            name = module.forward._name
            dist_input = context.input_dist_tensors_requests.pop(name).wait()
            module_ctx = context.module_contexts.pop(name)
            module.prefetch(ctx=module_ctx, dist_input=dist_input, forward_stream=None)
            context.module_input_post_prefetch[name] = dist_input
            context.module_contexts_post_prefetch[name] = module_ctx


def _snapshot(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Dense parameters and this rank's embedding shards, as numpy."""
    out = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "local_shards"):  # a table-wise table may have no shard here
            value = torch.cat([torch.zeros(0)] + [s.tensor.flatten() for s in value.local_shards()])
        out[name] = value.detach().cpu().numpy().copy()
    return out


def _train(
    rank: int, mode: str, events: list[str] | None = None, late_enqueue: bool = False, uneven: bool = False,
    short: int = 0, pad: bool = True,
) -> dict[str, Any]:
    """Train STEPS batches; rank 1's loader holds ``short`` batches fewer (``uneven``: 1),
    in their place batches of no real sample where ``pad``."""
    args = parse_args(ARGS)
    pg = dist.group.WORLD
    device = torch.device("cpu")
    model, optimizer = build_model(args, device, pg)
    data: Any = SyntheticHSTUData(rank=rank, batch_size=16, num_batches=STEPS, max_seqlen=48, seed=3)
    short = short or int(uneven)
    if short and rank == 1:  # the last steps take part with no real sample (or the loader stops early)
        drawn = list(data)[:-short]
        data = [*drawn, *[padding_like(drawn[-1]) for _ in range(short if pad else 0)]]
    runner, comm = MODES[mode]
    shuffler = None
    if comm == "calibrated":  # online calibration from the forward + backward times the pipeline measures
        shuffler = BatchShuffler(TokenCount([ITEM_FEATURE]), calibrate=True, calibration_keys=[ITEM_FEATURE])
    elif comm:
        shuffler = BatchShuffler(TokenCount([ITEM_FEATURE]), comm=comm)
    losses: list[float] = []
    imbalance: list[tuple[float, float, float]] = []  # (before, after, moved fraction)
    calibrated: list[bool] = []
    model.train()
    if runner == "loop":
        for batch in data:
            if shuffler is not None:
                batch = shuffler.shuffle(batch, pg=pg)
            optimizer.zero_grad()
            loss, _ = model(batch)
            loss.backward()
            optimizer.step()
            losses.append(global_loss_value(loss, pg=pg))
    else:
        if runner == "torchrec":
            pipe: Any = TrainPipelineSparseDist(model, optimizer, device)
        else:
            cls = _CPUPrefetch if runner == "prefetch" else BalancedTrainPipelineSparseDist
            shuf = shuffler if shuffler is not None else IdentityBatchShuffler()
            kwargs: dict[str, Any] = {"enqueue_batch_after_forward": True} if late_enqueue else {}
            if events is not None:
                shuf = _Recorder(shuf, events)

                def fwd(batch: Any) -> Any:
                    events.append(f"forward {_batch_id(batch)}")
                    return model(batch)

                kwargs["custom_model_fwd"] = fwd
            pipe = cls(model, optimizer, device, shuf, pg=pg, **kwargs)
        it = iter(data)
        while True:
            try:
                out = pipe.progress(it)
            except StopIteration:
                break
            losses.append(global_loss_value(out[0], pg=pg))
            stats = getattr(pipe, "last_step_stats", None)
            if shuffler is not None:
                imbalance.append((stats.imbalance_before, stats.imbalance_after, stats.moved_fraction))
                calibrated.append(stats.calibration is not None)
        if hasattr(pipe, "close"):
            pipe.close()
    if shuffler is not None:
        shuffler.close()
    observations = sum(len(f._times) for f in shuffler._calibration._fits.values()) if shuffler is not None else 0
    return {"losses": losses, "params": _snapshot(model), "imbalance": imbalance, "calibrated": calibrated,
            "observations": observations}


def _batch_id(batch: Any) -> int:
    # Total of the item ids identifies a batch across a shuffle (sum over ranks).
    return int(batch.features.values().sum())


def _worker_modes(rank: int, world: int, modes: list[str]) -> dict[str, Any]:
    return {mode: _train(rank, mode) for mode in modes}


def _max_dev(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """Max |loss_a - loss_b| / |loss_b| and max |param_a - param_b|."""
    la, lb = np.array(a["losses"]), np.array(b["losses"])
    loss_rel = float(np.max(np.abs(la - lb) / np.abs(lb)))
    param_abs = max(float(np.max(np.abs(a["params"][k] - b["params"][k]), initial=0.0)) for k in b["params"])
    return loss_rel, param_abs


def _assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    assert a["params"].keys() == b["params"].keys()
    for k in b["params"]:
        np.testing.assert_array_equal(a["params"][k], b["params"][k], err_msg=k)


def _assert_close(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    assert len(a["losses"]) == len(b["losses"]) == STEPS
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=RTOL)
    for k in b["params"]:
        np.testing.assert_allclose(a["params"][k], b["params"][k], rtol=RTOL, atol=ATOL, err_msg=k)
    loss_rel, param_abs = _max_dev(a, b)
    assert loss_rel < RTOL / 10 and param_abs < ATOL / 10, (loss_rel, param_abs)
    return loss_rel, param_abs


# TorchRec 1.6's prefetch pipeline runs its own loop: the balanced one refuses it.
PREFETCH = _prefetch_runs_on_contexts()
TORCHREC_VERSION = tuple(int(x) for x in torchrec.__version__.split(".")[:2])
needs_context_prefetch = pytest.mark.skipif(
    not PREFETCH, reason="this TorchRec's prefetch pipeline has no per-batch contexts (TorchRec 1.6)")


def test_balanced_pipeline_matches_torchrec_loop_and_unbalanced() -> None:
    skip_without_tbe("the example's sharded model")
    outs = run_workers(_worker_modes, 2, [m for m in MODES if PREFETCH or MODES[m][0] != "prefetch"], timeout=300)
    for rank, res in enumerate(outs):
        # Identity shuffler: bit-identical to plain TorchRec and to the loop.
        _assert_equal(res["off"], res["torchrec"])
        _assert_equal(res["off"], res["loop_off"])
        # Balanced: the pipelines train exactly like the balanced loop ...
        _assert_equal(res["on"], res["loop_on"])
        if PREFETCH:
            _assert_equal(res["prefetch_on"], res["loop_on"])
        _assert_equal(res["on_allgather"], res["loop_on"])
        # ... and like no balancing up to float32 summation order.
        loss_rel, param_abs = _assert_close(res["on"], res["off"])
        # With online calibration the pipeline times each batch's forward and
        # backward, every rank's times reach the fit (2 ranks; a time travels
        # with a later shuffle), and training is unchanged whichever model the
        # fit ends on. (Whether this tiny model's times carry a per-sample
        # signal is noise; tests/test_calibrate.py checks convergence.)
        _assert_close(res["on_calibrated"], res["off"])
        assert res["on_calibrated"]["observations"] >= 2 * (STEPS - 4), res["on_calibrated"]["observations"]
        assert not res["on_calibrated"]["calibrated"][0]
        # Balancing happened: every step has stats, samples moved, balance improved.
        before, after, moved = np.array(res["on"]["imbalance"]).T
        assert len(before) == STEPS and moved.sum() > 0, res["on"]["imbalance"]
        assert np.all(after <= before) and after.mean() < before.mean()
        print(
            f"rank {rank}: on vs off max loss rel dev {loss_rel:.2e}, max param abs dev "
            f"{param_abs:.2e}; imbalance {before.mean():.3f} -> {after.mean():.3f}, "
            f"moved {moved.mean():.2f}"
        )
    # The global loss is the same number on every rank.
    assert outs[0]["on"]["losses"] == outs[1]["on"]["losses"]


class _Recorder:
    """Wraps a shuffler and records phase 1 / phase 2 by batch id."""

    def __init__(self, inner: Any, events: list[str]) -> None:
        self.inner, self.events = inner, events

    def start_shuffle_async(self, batch: Any, pg: Any = None, exhausted: bool = False) -> Any:
        self.events.append(f"phase1 {_batch_id(batch)}")
        return self.inner.start_shuffle_async(batch, pg=pg, exhausted=exhausted)

    def finish_shuffle(self, batch: Any, handle: Any, pg: Any = None) -> Any:
        out = self.inner.finish_shuffle(batch, handle, pg=pg)
        self.events.append(f"phase2 {_batch_id(batch)}")
        return out

    def close(self) -> None:
        self.inner.close()


def _worker_order(rank: int, world: int) -> list[str]:
    events: list[str] = []
    _train(rank, "on", events)
    return events


def test_hook_order() -> None:
    """Phase 1 of batch i+2 before the forward of batch i, phase 2 right after it."""
    skip_without_tbe("the example's sharded model")
    events = run_workers(_worker_order, 2, timeout=300)[0]
    phase1 = [e for e in events if e.startswith("phase1")]
    # ... and once every loader is exhausted, one shuffle of no real sample that
    # tells every rank so (uneven loaders stop together); it is not trained.
    assert len(phase1) == STEPS + 1 and phase1[-1] == "phase1 0", phase1[-3:]
    fwd_pos = [i for i, e in enumerate(events) if e.startswith("forward")]
    assert len(fwd_pos) == STEPS
    for step in range(STEPS - 2):
        f = fwd_pos[step]
        # batch step+2 is started after the previous forward and before this one
        # and finished right after this forward.
        assert events[f - 1].startswith("phase1"), events[f - 2 : f + 2]
        assert events[f + 1].startswith("phase2"), events[f - 2 : f + 2]
        assert events[f - 1].split()[1] == events[f + 1].split()[1], "same batch"


def _worker_late_enqueue(rank: int, world: int) -> list[dict[str, Any]]:
    return [_train(rank, "on", late_enqueue=True), _train(rank, "loop_on")]


def test_enqueue_after_forward_still_shuffles_before_input_dist() -> None:
    """With ``enqueue_batch_after_forward`` phase 1 runs after the forward; the
    shuffle is then finished by ``start_sparse_data_dist``: same training."""
    skip_without_tbe("the example's sharded model")
    for late, loop in run_workers(_worker_late_enqueue, 2, timeout=300):
        _assert_equal(late, loop)


# ----------------------------------------------------------- single process
def test_factory_builds_the_configured_pipeline(caplog: pytest.LogCaptureFixture) -> None:
    model, opt, cpu = torch.nn.Linear(2, 2), None, torch.device("cpu")
    off = create_train_pipeline(model, opt, cpu, BalancerConfig())  # type: ignore[arg-type]
    assert type(off) is BalancedTrainPipelineSparseDist
    assert isinstance(off.shuffler, IdentityBatchShuffler)
    with caplog.at_level(logging.INFO, logger="balancer.pipeline"):
        on = create_train_pipeline(
            model, opt, cpu, BalancerConfig(enable_balanced_shuffler=True, comm="allgather")  # type: ignore[arg-type]
        )
    assert isinstance(on.shuffler, BatchShuffler) and on.shuffler.comm == "allgather"
    assert [r.message for r in caplog.records if "TokenCount over all features" in r.message]
    # Every setting reaches the shuffler as named (a silent fallback to the
    # default partitioner would otherwise pass unnoticed).
    kk = create_train_pipeline(model, opt, cpu, BalancerConfig(  # type: ignore[arg-type]
        enable_balanced_shuffler=True, partition="karmarkar_karp", locality=False, shuffle_timeout_s=12.5))
    assert isinstance(kk.shuffler, BatchShuffler)
    assert kk.shuffler.partition is karmarkar_karp and kk.shuffler.executor == "thread"
    assert kk.shuffler.locality is False and kk.shuffler.timeout == 12.5
    bal = create_train_pipeline(model, opt, cpu, BalancerConfig(enable_balanced_shuffler=True, capacity=40))  # type: ignore[arg-type]
    assert bal.shuffler.capacity == 40  # type: ignore[union-attr]
    assert bal.shuffler.partition is balanced_partition and bal.shuffler.executor == "process"  # type: ignore[union-attr]
    grouped = create_train_pipeline(model, opt, cpu, BalancerConfig(enable_balanced_shuffler=True, group_size=8))  # type: ignore[arg-type]
    assert grouped.shuffler.group_size == 8  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"pipeline='prefetch' needs a CUDA device, got device=cpu"):
        create_train_pipeline(model, opt, cpu, BalancerConfig(pipeline="prefetch"))  # type: ignore[arg-type]


def _worker_uneven(rank: int, world: int) -> dict[str, Any]:
    return {mode: _train(rank, mode, uneven=True) for mode in ("on", "loop_on")}


def test_a_rank_out_of_data_takes_part_with_a_padding_like_batch() -> None:
    # Ranks must draw the same number of batches; the docs once said to pad the
    # last one with pad_batch, which adds samples, not batches, and no public
    # way built a batch with no real sample.
    skip_without_tbe("the example's sharded model")
    for res in run_workers(_worker_uneven, 2, timeout=300):
        _assert_equal(res["on"], res["loop_on"])
        assert len(res["on"]["losses"]) == STEPS and np.isfinite(res["on"]["losses"]).all()
        before, after, moved = np.array(res["on"]["imbalance"]).T
        assert moved[-1] > 0, res["on"]["imbalance"]  # the last step still balanced rank 0's batch


def _worker_short(rank: int, world: int, short: int, late: bool) -> dict[str, Any]:
    return {"pipeline": _train(rank, "on", late_enqueue=late, short=short, pad=False),
            "loop": _train(rank, "loop_on", short=short)}


@pytest.mark.parametrize("short, late", [(1, False), (3, False), (3, True)])
def test_a_rank_whose_loader_stops_early_keeps_in_step_by_itself(short: int, late: bool) -> None:
    # Rank 1's plain loader holds `short` batches fewer. The pipeline took part
    # with nothing once it was exhausted: rank 0 waited in phase 1 for the
    # shuffler's timeout (300 s), then failed; rank 1 got gloo's error in its
    # backward. Now rank 1 takes part with batches of no real sample while rank 0
    # has data, and both train exactly what a loop whose rank 1 appends
    # padding_like batches trains (every sample once), STEPS steps each.
    skip_without_tbe("the example's sharded model")
    for res in run_workers(_worker_short, 2, short, late, timeout=300):
        _assert_equal(res["pipeline"], res["loop"])
        assert len(res["pipeline"]["losses"]) == STEPS
        before, after, moved = np.array(res["pipeline"]["imbalance"]).T
        assert moved[-1] > 0, res["pipeline"]["imbalance"]  # the last step spread rank 0's samples


class _Rearmed:
    """One iterator object over a new source each epoch, as a DataLoader with
    persistent workers gives from every ``iter()``."""

    items: Iterator[Any] = iter(())

    def __iter__(self) -> _Rearmed:
        return self

    def __next__(self) -> Any:
        return next(self.items)


def _worker_passes(rank: int, world: int) -> list[Any]:
    """Five passes of one pipeline: uneven (rank 1 two batches short), empty on
    every rank, even, then two short ones from one iterator object with reset()
    between: the steps each pass trained and what it drew."""
    args = parse_args(ARGS)
    model, optimizer = build_model(args, torch.device("cpu"), dist.group.WORLD)
    shuffler = BatchShuffler(TokenCount([ITEM_FEATURE]), timeout=60.0)
    pipe = BalancedTrainPipelineSparseDist(model, optimizer, torch.device("cpu"), shuffler)
    full = list(SyntheticHSTUData(rank=rank, batch_size=16, num_batches=5, max_seqlen=48, seed=3))
    passes = [full[:3] if rank == 1 else full, [], full, full[:2], full[:2]]
    out: list[Any] = []
    same = _Rearmed()  # the last two passes: one iterator object, reset() between them
    for i, data in enumerate(passes):
        drawn = [0]
        real = 0

        def source(data: list[Any] = data, drawn: list[int] = drawn) -> Iterator[Any]:
            for b in data:
                drawn[0] += 1
                drawn.append(b.actual_batch_size)
                yield b

        it: Iterator[Any] = source()
        if i >= 3:
            pipe.reset()
            same.items = it
            it = same
        steps = 0
        while True:
            try:
                pipe.progress(it)
            except StopIteration:
                break
            steps += 1
            real += sum(pipe.last_step_stats.real_after) if rank == 0 else 0  # type: ignore[union-attr]
        out.append((steps, drawn[0], real, sum(drawn[1:])))
    pipe.close()
    return out


def test_uneven_empty_and_even_passes_end_together() -> None:
    # The pass state follows the loader iterator: after an uneven pass, a pass
    # every rank starts exhausted ends at once on both (nothing drawn, no step,
    # no hang), and the next pass trains all its batches again. reset() starts a
    # new pass on the same iterator object (it kept the ended pass: 0 steps). Every
    # real sample drawn is trained once.
    skip_without_tbe("the example's sharded model")
    r0, r1 = run_workers(_worker_passes, 2, timeout=300)
    assert [p[:2] for p in r0] == [(5, 5), (0, 0), (5, 5), (2, 2), (2, 2)]
    assert [p[:2] for p in r1] == [(5, 3), (0, 0), (5, 5), (2, 2), (2, 2)]
    assert [p[2] for p in r0] == [a[3] + b[3] for a, b in zip(r0, r1, strict=True)]
    assert r1[0][3] > 0 and r0[0][3] > r1[0][3]


def _worker_no_first_batch(rank: int, world: int) -> tuple[str, str, float]:
    args = parse_args(ARGS)
    model, optimizer = build_model(args, torch.device("cpu"), dist.group.WORLD)
    data = [] if rank == 0 else list(SyntheticHSTUData(rank=rank, batch_size=16, num_batches=3, max_seqlen=48, seed=3))
    pipe = BalancedTrainPipelineSparseDist(model, optimizer, torch.device("cpu"),
                                           BatchShuffler(TokenCount([ITEM_FEATURE]), timeout=60.0))
    t0 = time.perf_counter()
    try:
        pipe.progress(iter(data))
        return ("trained", "", 0.0)
    except Exception as e:  # noqa: BLE001 - the kind is part of the result
        return (type(e).__name__, str(e), time.perf_counter() - t0)
    finally:
        pipe.close()


def test_a_rank_without_a_first_batch_fails_every_rank_at_once() -> None:
    # Rank 0 has no batch to take a layout from: it ended its pass alone, and rank 1
    # waited in phase 1 for the timeout (its next pass would have paired with rank
    # 0's next one, mixing epochs).
    skip_without_tbe("the example's sharded model")
    why = ("the loader yielded no batch before this rank's first shuffle, so it has no layout to take part "
           "with; every rank's loader must yield a batch in the first pass (rank 0)")
    (k0, m0, t0), (k1, m1, t1) = run_workers(_worker_no_first_batch, 2, timeout=120)
    assert k0 == k1 == "ValueError" and m0 == m1, (m0, m1)
    assert m1 == f"BatchShuffler: shuffle #0: invalid shuffle input on rank(s) [0]: {why}", m1
    assert t1 < 30, t1  # at once, not after the shuffler's 60 s


def _worker_not_a_batch(rank: int, world: int) -> tuple[str, str]:
    args = parse_args(ARGS)
    model, optimizer = build_model(args, torch.device("cpu"), dist.group.WORLD)
    data: list[Any] = list(SyntheticHSTUData(rank=rank, batch_size=16, num_batches=4, max_seqlen=48, seed=3))
    if rank == 1:
        data[2] = {"not": "a batch"}
    shuffler = BatchShuffler(TokenCount([ITEM_FEATURE]), timeout=60.0)
    pipe = BalancedTrainPipelineSparseDist(model, optimizer, torch.device("cpu"), shuffler)
    it = iter(data)
    try:
        while True:
            pipe.progress(it)
    except StopIteration:
        return ("StopIteration", "")
    except Exception as e:  # noqa: BLE001 - the kind is part of the result
        return (type(e).__name__, str(e))


def test_a_non_batch_on_one_rank_fails_every_rank() -> None:
    # It raised TypeError on its rank only; the peer waited in TorchRec's
    # all-to-all for good (the shuffler's timeout does not cover it).
    skip_without_tbe("the example's sharded model")
    outs = run_workers(_worker_not_a_batch, 2, timeout=120)
    for kind, msg in outs:
        assert kind == "ValueError" and "invalid shuffle input on rank(s) [1]: batch is a dict, expected a " \
            "BaseBatch or a TokenBatch (rank 1)" in msg, outs


def _failing_loader(data: list[Any], at: int, error: BaseException) -> Iterator[Any]:
    """Yields ``data`` until its ``at``-th batch, where it raises ``error``."""
    for i, batch in enumerate(data):
        if i == at:
            raise error
        yield batch


def _worker_loader_raises(rank: int, world: int, at: int, interrupt: bool) -> tuple[str, str, str, float, int]:
    args = parse_args(ARGS)
    model, optimizer = build_model(args, torch.device("cpu"), dist.group.WORLD)
    data = list(SyntheticHSTUData(rank=rank, batch_size=16, num_batches=5, max_seqlen=48, seed=3))
    error = KeyboardInterrupt("ctrl-c") if interrupt else OSError("corrupt shard file")
    it = iter(data) if rank == 0 else _failing_loader(data, at, error)
    pipe = BalancedTrainPipelineSparseDist(model, optimizer, torch.device("cpu"),
                                           BatchShuffler(TokenCount([ITEM_FEATURE]), timeout=60.0))
    t0 = time.perf_counter()
    try:
        while True:
            pipe.progress(it)
    except StopIteration:
        return ("StopIteration", "", "", 0.0, 0)
    except BaseException as e:  # noqa: BLE001 - the kind is part of the result
        waited = time.perf_counter() - t0
        time.sleep(1.0 if rank == 1 else 0.0)  # the failing rank lingers: its peer must not need it gone
        return (type(e).__name__, str(e), type(e.__cause__).__name__, waited, len(pipe._pending))
    finally:
        pipe.close()


@pytest.mark.parametrize(("at", "interrupt"), [(0, False), (2, False), (2, True)])
def test_a_loader_raising_on_one_rank_fails_every_rank_in_the_same_step(at: int, interrupt: bool) -> None:
    # The exception left progress() on its rank only; the peer waited in TorchRec's
    # input-dist all-to-all (no shuffler timeout covers it) until that process exited.
    # A KeyboardInterrupt is raised as itself on its rank (and left that rank's
    # used-up shuffle pending, so the next finish raised "already finished").
    skip_without_tbe("the example's sharded model")
    outs = run_workers(_worker_loader_raises, 2, at, interrupt, timeout=180)
    why = ("the data loader raised KeyboardInterrupt: ctrl-c (rank 1)" if interrupt
           else "the data loader raised OSError: corrupt shard file (rank 1)")
    for rank, (kind, msg, cause, waited, pending) in enumerate(outs):
        if rank == 1 and interrupt:
            assert kind == "KeyboardInterrupt" and msg == "ctrl-c", outs
        else:
            assert kind == "ValueError" and f"invalid shuffle input on rank(s) [1]: {why}" in msg, outs
            assert cause == ("OSError" if rank == 1 else "NoneType"), outs  # the failing rank's is chained
        assert waited < 30, outs  # at once, not after a timeout
        assert pending == 0, outs


def _worker_flag_on_one_rank(rank: int, world: int, prefetch_on_rank0: bool = False) -> str:
    config = BalancerConfig(enable_balanced_shuffler=rank == 0)
    if prefetch_on_rank0:
        config = BalancerConfig(pipeline="prefetch" if rank == 0 else "sparse_dist")
    try:
        pipe = create_train_pipeline(torch.nn.Linear(2, 2), None, torch.device("cpu"), config)  # type: ignore[arg-type]
        pipe.close()
        return "built"
    except ValueError as e:
        return str(e)


def test_balancing_on_some_ranks_only_fails_every_rank_at_construction() -> None:
    # Rank 0 balanced and timed out in its first shuffle; rank 1 waited in
    # TorchRec's collectives for good.
    outs = run_workers(_worker_flag_on_one_rank, 2, timeout=120)
    for r, msg in enumerate(outs):
        assert msg == ("create_train_pipeline: the ranks asked for different pipelines (pipeline and "
                       "enable_balanced_shuffler must be the same on every rank; this rank: pipeline='sparse_dist', "
                       f"enable_balanced_shuffler={r == 0}) (rank {r})"), outs
    # A rank's own error (prefetch on the CPU) goes through the same all-reduce: rank 0
    # raised before it and rank 1 waited there until rank 0's process ended.
    outs = run_workers(_worker_flag_on_one_rank, 2, True, timeout=120)
    assert outs == ["BalancerConfig.pipeline='prefetch' needs a CUDA device, got device=cpu; use "
                    "pipeline='sparse_dist'",
                    "create_train_pipeline failed on rank 0 (see its error) (rank 1)"], outs


def test_non_basebatch_is_rejected() -> None:
    pipe = create_train_pipeline(
        torch.nn.Linear(2, 2), None, torch.device("cpu"), BalancerConfig()  # type: ignore[arg-type]
    )
    with pytest.raises(TypeError, match=r"needs balancer.BaseBatch batches, got Tensor"):
        pipe.progress(iter([torch.zeros(2, 2)]))


def _timed_worker(rank: int, w: int, runner: str) -> list[float]:
    """Seconds the pipeline reports for online calibration, with a backward slowed by 0.2 s
    (``-eval``: four training steps, then four with the model in eval mode)."""
    model, optimizer = build_model(parse_args(ARGS), torch.device("cpu"), dist.group.WORLD)
    shuffler = BatchShuffler(TokenCount([ITEM_FEATURE]), calibrate=True)
    reported: list[float] = []
    record = shuffler.record_compute

    def spy(handle: Any, seconds: float | None = None, *, events: Any = ()) -> None:
        reported.append(float(seconds or 0.0))
        record(handle, seconds, events=events)

    shuffler.record_compute = spy  # type: ignore[method-assign]

    def forward(batch: Any) -> Any:
        loss, out = model(batch)
        loss.register_hook(lambda g: (time.sleep(0.2), g)[1])  # runs inside the backward
        return loss, out

    cls = _CPUPrefetch if runner.startswith("prefetch") else BalancedTrainPipelineSparseDist
    pipe = cls(model, optimizer, torch.device("cpu"), shuffler, custom_model_fwd=forward)
    evaluate = runner.endswith("-eval")
    it = iter(SyntheticHSTUData(rank=rank, batch_size=16, num_batches=8 if evaluate else 4, max_seqlen=48, seed=3))
    steps = 0
    with contextlib.suppress(StopIteration):
        while True:
            if evaluate and steps == 4:
                model.eval()  # TorchRec's progress then runs no backward and no optimizer step
            pipe.progress(it)
            steps += 1
    pipe.close()
    return reported


@pytest.mark.parametrize("runner", ["pipeline", "pipeline-eval", pytest.param("prefetch", marks=needs_context_prefetch)])
def test_calibration_times_include_the_backward(runner: str) -> None:
    skip_without_tbe("the example's sharded model")
    # TorchRec's prefetch step runs the backward itself, not through _backward:
    # the prefetch pipeline once reported the forward alone (~5 ms, not >= 0.2 s).
    # An evaluation pass through the pipeline (model.eval()) reported its forward
    # times too, as if they were training steps, and biased the fit.
    for reported in run_workers(_timed_worker, 2, runner, timeout=300):
        assert len(reported) == 4 and min(reported) >= 0.2, reported


class _LoopPrefetch:
    """TorchRec 1.6's prefetch signature: ``_prefetch(batch)``."""

    def _prefetch(self, batch: Any) -> None: ...


def test_prefetch_pipeline_without_contexts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _prefetch_runs_on_contexts(_LoopPrefetch)
    assert _prefetch_runs_on_contexts(PrefetchTrainPipelineSparseDist) == PREFETCH
    assert (TORCHREC_VERSION >= (1, 8)) == PREFETCH, TORCHREC_VERSION  # the two releases we run: 1.6.1, 1.8.0
    # What TorchRec 1.6 gets, before any TorchRec state is built:
    monkeypatch.setattr(balancer.pipeline, "_prefetch_runs_on_contexts", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs TorchRec's context-based prefetch pipeline .* torchrec \d"):
        BalancedPrefetchTrainPipelineSparseDist(
            torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1), torch.device("cpu"),
            IdentityBatchShuffler())


def test_the_cuda_tiers_pipeline_check_on_cpu() -> None:
    # tests/test_cuda.py's pipeline check (a dense-only model: no TBE kernels),
    # with CPU tensors: the same assertions run on every machine.
    from tests.test_cuda import check_pipeline_runs

    check_pipeline_runs("cpu")


def test_the_cuda_tiers_uneven_pipeline_check_on_cpu() -> None:
    from tests.test_cuda import check_pipeline_runs

    check_pipeline_runs("cpu", short=2)
