"""The CUDA tier: ``pytest -m cuda`` (and ``-m nccl`` with two or more GPUs).

The same properties as the CPU suite, with CUDA tensors: every sample once,
bit-identical to the CPU shuffle of the same batches, and no host
synchronisation -- checked with ``torch.cuda.set_sync_debug_mode("error")``,
which raises on any synchronising call (``.item()``, ``.cpu()``, a blocking
copy, ``nonzero``, ...).

* gloo ranks that hold CUDA tensors share one GPU (NCCL refuses two ranks on
  one GPU). Gloo moves CUDA tensors through host memory, which synchronises by
  design, so its transport call alone runs outside the debug mode; everything
  the library does around it runs inside.
* NCCL (two or more GPUs): the whole shuffle runs inside the debug mode.
* LLM token batches (``TokenBatch``, padded and packed) take the same path as
  KJT batches and are checked the same way on gloo ranks.

Every test skips, with the reason, when there is no CUDA device or fbgemm-gpu
has no CUDA kernels (the CPU wheel ``fbgemm-gpu-cpu`` has none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from balancer import _gather
from balancer._gather import host_tensors, take_runs, upload
from balancer._runs import IndexBlob, plan_runs
from balancer.batch import padding_like
from balancer.shuffler import BatchShuffler
from balancer.testing import run_workers
from tests.test_exchange import expected, simulate
from tests.test_host_syncs import _downstream
from tests.test_shuffler import assert_identical, make_batch, rows, token_count
from tests.test_tokens import token_batch, token_rows

pytestmark = pytest.mark.cuda


def _fbgemm_cuda() -> bool:
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::permute_1D_sparse_data", "CUDA"))
    except RuntimeError:
        return False


needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and _fbgemm_cuda()),
    reason="needs a CUDA device and fbgemm-gpu's CUDA kernels (permute_1D_sparse_data; the CPU wheel has none)")
needs_nccl = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not _fbgemm_cuda(),
    reason="NCCL needs two or more CUDA devices (it refuses two ranks on one GPU) and fbgemm-gpu's CUDA kernels")


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Raise on any synchronising CUDA call inside the block."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def gloo_transport_exempt() -> Iterator[None]:
    """Gloo's own host staging of CUDA tensors is allowed to synchronise.

    Only on the calling thread: the debug mode is process-wide, and phase 1's
    all-gather (host metadata) runs on the shuffler's background thread. An
    exemption there saved "error" as the mode to restore and put it back after
    this thread had left :func:`no_sync`, so the next forward raised (seen on
    an H200).
    """
    saved = {n: getattr(dist, n) for n in ("all_to_all_single", "all_gather_single", "all_gather_into_tensor")
             if hasattr(dist, n)}
    caller = threading.get_ident()

    def exempt(real: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if threading.get_ident() != caller:
                return real(*a, **k)
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return real(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        return call

    for name, real in saved.items():
        setattr(dist, name, exempt(real))
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


# ------------------------------------------------------------- single GPU
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float16, torch.uint8])
@pytest.mark.parametrize("use_fbgemm", [True, False])
def test_take_runs_on_cuda(dtype: torch.dtype, use_fbgemm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gather, "_PERMUTE", use_fbgemm and _gather._PERMUTE)
    rng = np.random.default_rng(0)
    buf = torch.from_numpy(rng.integers(0, 256, 4096).astype(np.uint8)).view(dtype)
    dev = torch.device("cuda")
    for _ in range(10):
        cuts = np.sort(rng.choice(buf.numel(), size=2 * int(rng.integers(1, 30)), replace=False))
        starts, ends = cuts[0::2], cuts[1::2]
        order = rng.permutation(starts.size)
        blob = IndexBlob()
        g = plan_runs(blob, buf.numel(), starts[order], (ends - starts)[order])
        device_blob = upload(host_tensors(blob.freeze(), pin=True), dev)
        src = buf.to(dev)
        with no_sync():
            got = take_runs(src, g, device_blob)
        want = torch.cat([buf[a:b] for a, b in zip(starts[order], ends[order], strict=True)])
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_carry_field_goes_to_the_device_with_its_batch() -> None:
    # tests/test_batch.py checks the same on the meta device.
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

    from tests.test_batch import CarryBatch

    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a"], values=torch.arange(3), lengths=torch.ones(3, dtype=torch.int64))
    jt = JaggedTensor(values=torch.arange(4.0), lengths=torch.tensor([1, 3]))
    b = CarryBatch(features=kjt, batch_size=3, feature_to_max_seqlen={}, table={"mean": torch.ones(1), "jt": jt})
    g = b.pin_memory().to(torch.device("cuda"), non_blocking=True)
    assert g.table["mean"].is_cuda and g.table["jt"].values().is_cuda and g.features.values().is_cuda
    g.record_stream(torch.cuda.current_stream())
    assert torch.equal(g.table["jt"].values().cpu(), jt.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_padding_of_a_pinned_batch_is_pinned() -> None:
    # An exhausted rank's padding batch goes to the device by TorchRec's non_blocking copy
    # like a real one; from pageable memory the driver may stage it and wait for the
    # stream. (Pinned memory needs a CUDA build: the CPU checks are in test_batch.py.)
    from balancer import TokenBatch, pad_batch, padding_like
    from tests.test_batch import make_batch

    torch.cuda.init()  # as a training process has (balancer._pinned asks only where CUDA is in use)
    batch = make_batch(torch.Generator().manual_seed(0), b=4, real=3).pin_memory()
    empty = padding_like(batch)
    held = [empty.features.lengths(), empty.labels, empty.dense]
    assert all(t.is_pinned() for t in held) and not any(t.any() for t in held)
    assert empty.dense.stride() == batch.dense.stride()
    tokens = TokenBatch(batch_size=2, seq_lens=torch.tensor([3, 1]), tokens={"ids": torch.ones(2, 3, dtype=torch.int64)},
                        samples={"r": torch.ones(2)}, pad_values={"ids": -1}).pin_memory()
    t = padding_like(tokens)
    assert t.seq_lens.is_pinned() and t.tokens["ids"].is_pinned() and t.samples["r"].is_pinned()
    assert (t.tokens["ids"] == -1).all() and not t.seq_lens.any()
    assert not padding_like(make_batch(torch.Generator().manual_seed(0), b=4)).dense.is_pinned()
    # Padding added to a pinned batch (pad_batch, TokenBatch.pad) is pinned too.
    padded = pad_batch(batch, 6)
    assert all(x.is_pinned() for x in (padded.features.lengths(), padded.labels, padded.dense))
    assert torch.equal(padded.dense[:4], batch.dense) and not padded.dense[4:].any()
    grown = tokens.pad(4)
    assert grown.seq_lens.is_pinned() and grown.tokens["ids"].is_pinned() and grown.samples["r"].is_pinned()
    assert grown.seq_lens.tolist() == [3, 1, 0, 0] and (grown.tokens["ids"][2:] == -1).all()


@needs_cuda
@pytest.mark.parametrize("comm", ["all2all", "allgather"])
def test_simulated_exchange_on_cuda(comm: str) -> None:
    rng = np.random.default_rng(3)
    for case in range(6):
        w, b = 3, int(rng.choice([2, 5]))
        batches = [make_batch(r, b, int(rng.integers(0, b + 1)), seed=case, labels=["kjt", "dense", None][case % 3])
                   for r in range(w)]
        dest = rng.permutation(np.repeat(np.arange(w), b))
        for r, (out, want) in enumerate(zip(simulate(batches, dest, comm, "cuda"), expected(batches, dest),
                                            strict=True)):
            assert rows(out)[: len(want)] == want, (case, r)


def check_conserved(per_rank: list[list[tuple[Any, ...]]]) -> None:
    """Each case's ``(samples before, samples after)`` per rank: every real
    sample exactly once over all ranks, its contents intact."""
    for case in range(len(per_rank[0])):
        assert Counter(x for r in per_rank for x in r[case][0]) == Counter(x for r in per_rank for x in r[case][1])


def _guards(dev: torch.device) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """:func:`no_sync` and :func:`gloo_transport_exempt` for ``dev`` = CUDA; no-ops for the CPU
    runs of these workers."""
    if dev.type == "cuda":
        return no_sync, gloo_transport_exempt
    return contextlib.nullcontext, contextlib.nullcontext


def _shuffle_checked(shuffler: BatchShuffler, batch: Any, dev: torch.device,
                     downstream: Callable[[Any], Any]) -> Any:
    """Both phases on gloo ranks under the debug mode (gloo's own transport exempt in
    phase 2), then ``downstream`` of the result under it too."""
    guard, exempt = _guards(dev)
    with guard():
        h = shuffler.start_shuffle_async(batch)
    with guard(), exempt():
        got = shuffler.finish_shuffle(batch, h)
        downstream(got)
    return got


def _gloo_cuda_worker(rank: int, w: int, device: str = "cuda") -> list[tuple[Any, ...]]:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    out = []
    for comm in ("all2all", "allgather"):
        on_gpu, on_cpu = BatchShuffler(token_count, comm=comm), BatchShuffler(token_count, comm=comm)
        for case in range(5):
            cpu = make_batch(rank, 7, [7, 4, 0, 7, 5][case] if rank == 1 else 7, seed=30 + case,
                             labels=["kjt", "dense", None, "kjt", "dense"][case])
            got = _shuffle_checked(on_gpu, cpu.to(dev), dev, _downstream)
            ref = on_cpu.shuffle(cpu)
            assert_identical(got.to(torch.device("cpu")), ref)  # bit for bit the CPU result
            out.append((rows(cpu)[: cpu.actual_batch_size], rows(ref)[: ref.actual_batch_size]))
        on_gpu.close()
        on_cpu.close()
    return out


@needs_cuda
@pytest.mark.parametrize("w", [2, 4])
def test_shuffle_cuda_tensors_on_gloo_ranks_without_host_sync(w: int) -> None:
    check_conserved(run_workers(_gloo_cuda_worker, w, timeout=300))


def _token_cuda_worker(rank: int, w: int, device: str = "cuda") -> list[tuple[Any, ...]]:
    """LLM token batches (padded and packed) with ``device`` tensors on gloo ranks:
    bit for bit the CPU shuffle of the same batches, phase 1 and phase 2 under
    the debug mode on CUDA (on CPU, where ``tests/test_tokens.py`` runs this
    worker too, the guards are no-ops)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    cost = lambda b: b.seq_lens.double() ** 2 * 1e-6  # noqa: E731 - device ops only

    def downstream(got: Any) -> None:
        got.cu_seqlens()  # what a varlen kernel takes, on the device
        if not got.packed:
            got.attention_mask()

    out = []
    pads = {"input_ids": -100, "pos3": 7}  # the third variant: padding positions hold these
    for packed, padded_with in ((False, {}), (True, {}), (False, pads)):
        for comm in ("all2all", "allgather"):
            on_dev, on_cpu = BatchShuffler(cost, comm=comm), BatchShuffler(cost, comm=comm)
            for case in range(4):
                cpu = token_batch(rank, 6, [6, 4, 0, 6][case] if rank == 1 else 6, seed=40 + case,
                                  packed=packed, max_len=7 + 2 * rank, pad_multiple=8)
                cpu = dataclasses.replace(cpu, pad_values=dict(padded_with))
                got = _shuffle_checked(on_dev, cpu.to(dev), dev, downstream)
                ref = on_cpu.shuffle(cpu)
                host = got.to(torch.device("cpu"))
                assert (host.batch_size, host.actual_batch_size, host.packed) == (
                    ref.batch_size, ref.actual_batch_size, ref.packed)
                assert torch.equal(host.seq_lens, ref.seq_lens)
                for name in ref.tokens:
                    assert host.tokens[name].dtype == ref.tokens[name].dtype
                    assert torch.equal(host.tokens[name], ref.tokens[name]), (packed, comm, case, name)
                for name in ref.samples:
                    assert torch.equal(host.samples[name], ref.samples[name]), (packed, comm, case, name)
                if padded_with:  # the reference's padding holds them; zeroed for token_rows
                    mask = ref.attention_mask()
                    tokens = {}
                    for name, t in ref.tokens.items():
                        pad = ~mask.view(*mask.shape, *([1] * (t.dim() - 2))).expand_as(t)
                        assert t[pad].eq(padded_with[name]).all(), (comm, case, name)
                        tokens[name] = t.masked_fill(pad, 0)
                    ref = dataclasses.replace(ref, tokens=tokens)
                out.append((token_rows(cpu), token_rows(ref)))
            on_dev.close()
            on_cpu.close()
    return out


@needs_cuda
@pytest.mark.parametrize("w", [2, 3])
def test_token_batches_on_cuda_shuffle_without_host_sync(w: int) -> None:
    check_conserved(run_workers(_token_cuda_worker, w, timeout=300))


def _nccl_worker(rank: int, w: int) -> list[tuple[Any, ...]]:
    dev = torch.device("cuda", rank)
    out = []
    for comm in ("all2all", "allgather"):
        on_gpu, on_cpu = BatchShuffler(token_count, comm=comm), BatchShuffler(token_count, comm=comm)
        for case in range(4):
            cpu = make_batch(rank, 9, [9, 6, 0, 9][case] if rank % 2 else 9, seed=50 + case)
            gpu = cpu.to(dev)
            with no_sync():
                h = on_gpu.start_shuffle_async(gpu)
                got = on_gpu.finish_shuffle(gpu, h)
                _downstream(got)
            ref = on_cpu.shuffle(cpu)
            assert_identical(got.to(torch.device("cpu")), ref)
            out.append((rows(cpu)[: cpu.actual_batch_size], rows(ref)[: ref.actual_batch_size]))
    return out


@pytest.mark.nccl
@needs_nccl
def test_shuffle_on_nccl_without_host_sync() -> None:
    w = min(torch.cuda.device_count(), 4)
    check_conserved(run_workers(_nccl_worker, w, timeout=300, backend="nccl"))


# ------------------------------------------------------------------ pipeline
def _pool(pooled: torch.Tensor, batch: Any) -> torch.Tensor:
    """[K * B, D] per-(key, sample) bags -> [B, D]: sum over keys."""
    return pooled.view(len(batch.features.keys()), batch.batch_size, -1).sum(0)


def _loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    from balancer import loss as L

    target = (batch.dense[:, 0] % 2).to(logits.dtype)
    per_sample = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
    return L.global_mean_loss(per_sample, int(batch.actual_batch_size))


# TorchRec's pipeline fx-traces the forward; batch-size logic stays opaque.
torch.fx.wrap("_pool")
torch.fx.wrap("_loss")


class _TinyModel(torch.nn.Module):
    """Sum-pooled plain ``EmbeddingBag`` per key (no TBE kernels), a linear head,
    the global-mean loss: trains on a ``TaggedBatch``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(1024, 8, mode="sum", include_last_offset=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        f = batch.features
        logits = self.head(_pool(self.emb(f.values() % 1024, f.offsets()), batch)).squeeze(1)
        loss = _loss(logits, batch)
        return loss, (loss.detach(), logits.detach())  # the pipeline returns the second item


def _pipeline_worker(rank: int, w: int, balanced: bool, device: str = "cuda",
                     calibrate: bool = False, short: int = 0) -> dict[str, Any]:
    """Train 8 batches. ``short``: rank 1's loader holds that many fewer, and the
    unbalanced run takes part with padding batches in their place (what the balanced
    pipeline does by itself)."""
    from torchrec.distributed import DistributedModelParallel

    from balancer.loss import global_loss_value
    from balancer.pipeline import BalancedTrainPipelineSparseDist
    from balancer.shuffler import IdentityBatchShuffler

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = DistributedModelParallel(_TinyModel(), device=dev, sharders=[])  # dense only: DDP inside
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # calibrate: the pipeline times forward + backward with CUDA events, and
    # phase 1 reads them once complete (query, elapsed_time), inside the hooks.
    shuffler = BatchShuffler(token_count, calibrate=calibrate) if balanced else IdentityBatchShuffler()
    pipe = BalancedTrainPipelineSparseDist(model, opt, dev, shuffler)
    guard, exempt = _guards(dev)
    for hook in ("_start_shuffle", "_ran_out", "_finish_shuffles"):  # the balancing hooks, under the debug mode
        real = getattr(pipe, hook)

        def checked(*a: Any, _real: Any = real, **k: Any) -> Any:
            with guard(), exempt():
                return _real(*a, **k)

        setattr(pipe, hook, checked)
    data = [make_batch(rank, 8, 8 if step < 7 else 5, seed=70 + step, labels="dense") for step in range(8)]
    if short and rank == 1:
        data = data[:-short] + ([] if balanced else [padding_like(data[-short - 1])] * short)
    it = iter([d.pin_memory() for d in data])
    losses = []
    while True:
        try:
            loss, _ = pipe.progress(it)  # the model's (loss, logits)
        except StopIteration:
            break
        losses.append(global_loss_value(loss))  # the user's own sync, outside the hooks
    pipe.close()
    params = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    fits = shuffler._calibration._fits.values() if isinstance(shuffler, BatchShuffler) else ()
    return {"losses": losses, "params": params, "observations": sum(len(f._times) for f in fits)}


def check_pipeline_runs(device: str, short: int = 0) -> None:
    """Balanced, balanced with online calibration, and unbalanced: the same training. With
    ``short`` (uneven loaders: rank 1 runs out first) balanced only, against unbalanced
    with explicit padding batches."""
    off = run_workers(_pipeline_worker, 2, False, device, False, short, timeout=300)
    for calibrate in (False, True) if not short else (False,):
        on = run_workers(_pipeline_worker, 2, True, device, calibrate, short, timeout=300)
        for a, b in zip(on, off, strict=True):
            assert len(a["losses"]) == len(b["losses"]) == 8
            np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5)
            for k in b["params"]:
                np.testing.assert_allclose(a["params"][k], b["params"][k], rtol=1e-5, atol=1e-6, err_msg=k)
            # Timed batches reached the fit (2 ranks: a time travels with a later shuffle).
            assert (a["observations"] > 0) == calibrate, a["observations"]


@needs_cuda
def test_balanced_pipeline_on_cuda_matches_unbalanced() -> None:
    check_pipeline_runs("cuda")


@needs_cuda
def test_balanced_pipeline_on_cuda_with_uneven_loaders_matches_padded() -> None:
    # A rank out of data takes part with padding batches (pipeline._ran_out), and the
    # pass ends on every rank at the first all-padding shuffle; not yet run on a GPU.
    check_pipeline_runs("cuda", short=2)
