"""Model, packing, timing and process launch for the single-GPU benchmark (bench_gpu.py).

The model is a small pre-norm transformer stack over one rank's samples packed
end to end (``T`` tokens of ``B`` samples, no padding). Attention is per
sample and causal, by one of two backends:

* ``"varlen"`` (CUDA): ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention
  on packed sequences with cumulative lengths): one launch per layer, cost
  ~ sum of L^2, no padding and no host sync.
* ``"loop"`` (CPU, or a CUDA fallback): ``scaled_dot_product_attention`` per
  sample. One launch per sample per layer, so on a GPU short samples pay the
  launch floor; on CPU it is the fused float32 kernel bench_e2e uses.

Nested (jagged) tensors are not offered: their SDPA refuses ``is_causal=True``
(torch 2.13). A block-diagonal mask over all ``T`` tokens would cost ~T^2, not
the sum of L^2 that real packed attention costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import inspect
import os
import platform
import subprocess
import threading
import warnings
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 4096


@dataclasses.dataclass(frozen=True)
class Dims:
    """Model size: hidden width, heads, layers, MLP width over hidden."""

    hidden: int
    heads: int
    layers: int
    mlp_ratio: float = 4.0


@dataclasses.dataclass
class Packed:
    """One rank's samples packed end to end, on the compute device."""

    ids: torch.Tensor  # [T] int64 token ids
    seg: torch.Tensor  # [T] int64 sample index of every token
    inv_len: torch.Tensor  # [B] float32, 1 / max(L, 1) (mean pooling)
    cu: torch.Tensor  # [B + 1] int32 cumulative lengths (varlen attention)
    labels: torch.Tensor  # [B] float32
    max_len: int  # >= every L; host int, varlen attention sizes its grid by it
    bounds: list[tuple[int, int]] | None  # host (start, end) per sample; loop backend only


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def pack(lengths: np.ndarray, ids: np.ndarray, labels: np.ndarray, device: torch.device,
         bounds: bool) -> Packed:
    """Pack ``B`` samples with host-known ``lengths`` [B] and ``ids`` [sum(lengths)]."""
    lengths = np.asarray(lengths, np.int64)
    cu = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=cu[1:])
    return Packed(
        ids=_to(torch.from_numpy(np.ascontiguousarray(ids, np.int64)), device),
        seg=_to(torch.from_numpy(np.repeat(np.arange(lengths.size), lengths)), device),
        inv_len=_to(torch.from_numpy((1.0 / np.maximum(lengths, 1)).astype(np.float32)), device),
        cu=_to(torch.from_numpy(cu.astype(np.int32)), device),
        labels=_to(torch.from_numpy(np.asarray(labels, np.float32)), device),
        max_len=int(lengths.max(initial=0)),
        bounds=list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)) if bounds else None,
    )


def pack_batch(batch: Any, backend: str) -> Packed:
    """Pack a :class:`balancer.BaseBatch` with one feature ``"seq"`` and dense ``labels`` [B].

    Device ops only, sizes from tensor metadata (``T = values.numel()``) and
    ``feature_to_max_seqlen``; only the loop backend reads lengths on the host.
    """
    kjt, b = batch.features, batch.batch_size
    lengths, ids = kjt.lengths(), kjt.values()
    cu = torch.zeros(b + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = lengths.cumsum(0)
    seg = torch.repeat_interleave(torch.arange(b, device=ids.device), lengths, output_size=ids.numel())
    # The loop backend needs host bounds: a sync on CUDA, which is why CUDA uses varlen.
    host = cu.tolist() if backend == "loop" else None
    return Packed(ids=ids, seg=seg, inv_len=1.0 / lengths.clamp(min=1).float(), cu=cu,
                  labels=batch.labels, max_len=int(batch.feature_to_max_seqlen["seq"]),
                  bounds=list(zip(host[:-1], host[1:], strict=True)) if host is not None else None)


def _varlen() -> tuple[Callable[..., torch.Tensor] | None, dict[str, Any]]:
    """``varlen_attn`` and its causal keyword: ``window_size=(-1, 0)`` since
    torch 2.10, ``is_causal=True`` in 2.9; ``(None, {})`` when absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        return varlen_attn, {"window_size": (-1, 0)}
    if "is_causal" in params:
        return varlen_attn, {"is_causal": True}
    return None, {}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Packed, backend: str) -> torch.Tensor:
    """Causal attention within each sample; ``q, k, v`` and the result are [T, H, hd]."""
    if backend == "varlen":
        fn, causal = _varlen()
        assert fn is not None, "select_backend only picks varlen when it imports"
        return fn(q, k, v, p.cu, p.cu, p.max_len, p.max_len, **causal)
    assert p.bounds is not None, "the loop backend needs host bounds"
    outs = []
    for s, e in p.bounds:
        if e > s:
            # Contiguous [1, H, L, hd] inputs let SDPA use its fused CPU kernel
            # (permuted views fall back to the math path, which grows past L^2).
            qi, ki, vi = (t[s:e].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


class Block(nn.Module):
    """Pre-norm transformer layer: causal self-attention, then a GELU MLP."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        d, f = dims.hidden, round(dims.mlp_ratio * dims.hidden)
        self.heads = dims.heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x: torch.Tensor, p: Packed, backend: str) -> torch.Tensor:
        t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, d // self.heads).unbind(1)
        x = x + self.proj(attention(q, k, v, p, backend).reshape(t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    """Embedding -> ``layers`` blocks -> per-sample mean pool -> logit -> BCE loss."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dims.hidden)
        self.blocks = nn.ModuleList(Block(dims) for _ in range(dims.layers))
        self.norm, self.head = nn.LayerNorm(dims.hidden), nn.Linear(dims.hidden, 1)

    def forward(self, p: Packed, backend: str) -> torch.Tensor:
        x = self.emb(p.ids)
        for blk in self.blocks:
            x = blk(x, p, backend)
        pooled = x.new_zeros(p.labels.numel(), x.shape[1]).index_add_(0, p.seg, self.norm(x))
        logits = self.head(pooled * p.inv_len[:, None].to(x.dtype)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits.float(), p.labels)


def build(device: str, attn: str, dims: Dims, error: Callable[[str], Any]
          ) -> tuple[torch.device, str, str, dict[str, Any], Transformer]:
    """``(device, backend, why, environment, model)`` for ``--device``, ``--attn``
    and the model size: the model seeded alike in every benchmark."""
    dev = compute_device(device, error)
    backend, why = select_backend(attn, dev, dims)
    env = environment(dev)
    torch.manual_seed(0)
    return dev, backend, why, env, Transformer(dims).to(dev, dtype_for(dev))


def compute_device(choice: str, error: Callable[[str], Any]) -> torch.device:
    """The device of ``--device`` (``auto``: CUDA if available); ``error`` (the parser's)
    when CUDA is asked for and missing. On CPU one intra-op thread: one core per
    virtual rank's work, as bench_e2e."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        error("--device cuda: torch.cuda.is_available() is False")
    if choice == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(1)
    return torch.device("cpu")


def dtype_for(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def select_backend(requested: str, device: torch.device, dims: Dims) -> tuple[str, str]:
    """``(backend, why)``. ``"auto"``: varlen on CUDA if it imports and matches
    the loop backend's output and gradients on a small input, else loop."""
    if requested == "loop" or (requested == "auto" and device.type != "cuda"):
        return "loop", "per-sample SDPA"
    problem = _check_varlen(device, dims)
    if problem is None:
        return "varlen", "varlen_attn (packed), checked against per-sample SDPA"
    if requested == "varlen":
        raise RuntimeError(f"--attn varlen: {problem}")
    return "loop", f"per-sample SDPA (varlen unavailable: {problem})"


def _check_varlen(device: torch.device, dims: Dims) -> str | None:
    if device.type != "cuda":
        return "needs CUDA"
    if _varlen()[0] is None:
        return f"torch {torch.__version__} has no usable torch.nn.attention.varlen.varlen_attn"
    lengths = np.array([5, 33, 1, 70])
    g = torch.Generator().manual_seed(0)
    hd = dims.hidden // dims.heads
    base = torch.randn(int(lengths.sum()), 3, dims.heads, hd, generator=g)
    p = pack(lengths, np.zeros(lengths.sum()), np.zeros(4), device, bounds=True)
    res = {}
    for name in ("varlen", "loop"):
        x = base.to(device, torch.bfloat16).requires_grad_()
        try:
            out = attention(*x.unbind(1), p, name)
            out.float().square().sum().backward()
        except Exception as e:  # noqa: BLE001 - reported as the reason
            return f"{type(e).__name__}: {str(e)[:200]}"
        assert x.grad is not None, "backward reached the inputs"
        res[name] = (out.float().cpu(), x.grad.float().cpu())
    for i, what in enumerate(("output", "gradient")):
        a, b = res["varlen"][i], res["loop"][i]
        err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))
        if not err < 2e-2:
            return f"{what} differs from per-sample SDPA by {err:.3g} (relative to its max)"
    return None


@contextlib.contextmanager
def count_syncs(counts: list[int], i: int, on: bool, elsewhere: list[int] | None = None) -> Iterator[None]:
    """Add to ``counts[i]`` the synchronising CUDA calls the calling thread makes
    inside; to ``elsewhere[i]`` those other threads make meanwhile.

    The sync debug mode is process-wide: another thread's wait (the shuffler's
    partition thread waits on an event by design) warns too, and only blocks
    that thread. Each warning is attributed to the thread that raised it.
    """
    if not on:
        yield
        return
    me, seen = threading.get_ident(), []

    def record(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" in str(message):
            seen.append(threading.get_ident() == me)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts[i] += sum(seen)
    if elsewhere is not None:
        elsewhere[i] += len(seen) - sum(seen)


class RegionTimer:
    """Times code regions: CUDA events on a GPU, ``perf_counter`` on CPU.

    On a GPU each region starts after a device sync (between measured regions,
    never inside one), so it measures the rank's launches and kernels from an
    idle device, as on a real rank; events are read after one sync at the end.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[Any] = []

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._marks.append((start, end))
        else:
            t0 = perf_counter()
            yield
            self._marks.append(perf_counter() - t0)

    def read(self) -> list[float]:
        """Seconds of every region since the last read, in order."""
        if self.cuda:
            torch.cuda.synchronize()
            out = [s.elapsed_time(e) / 1e3 for s, e in self._marks]
        else:
            out = list(self._marks)
        self._marks.clear()
        return out


def fwd_bwd_times(model: Transformer, packs: list[Packed], backend: str, timer: RegionTimer) -> list[float]:
    """Seconds of forward + backward of each packed rank, measured separately."""
    for p in packs:
        model.zero_grad(set_to_none=True)
        with timer.region(), torch.profiler.record_function("## bench_gpu.fwd_bwd ##"):
            model(p, backend).backward()
    return timer.read()


def environment(device: torch.device) -> dict[str, Any]:
    """Hardware and versions for the JSON lines (GPU name and driver on CUDA)."""
    def version(dist_name: str) -> str | None:
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            return None

    env: dict[str, Any] = {
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "torchrec": version("torchrec"),
        "fbgemm_gpu": version("fbgemm-gpu") or version("fbgemm-gpu-cpu"), "numpy": np.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        env.update(gpu=prop.name, gpu_capability=f"{prop.major}.{prop.minor}",
                   gpu_memory_gib=round(prop.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version())
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, IndexError, subprocess.SubprocessError):
            env["driver"] = None
    return env
