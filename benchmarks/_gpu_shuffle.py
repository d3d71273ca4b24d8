"""The shuffle-cost section of bench_gpu.py: a real 2-rank gloo group on one device.

Both ranks hold their batches on the compute device (on a GPU: CUDA tensors
over gloo, which stages them through host memory; NCCL refuses two ranks on one
GPU) and train the benchmark's transformer on balanced batches. Three modes,
interleaved over repetitions so machine noise hits all alike:

* ``none``: forward + backward only, on batches balanced beforehand;
* ``fenced``: what ``BalancedTrainPipelineSparseDist`` does on CUDA:
  ``start_shuffle_async`` of the next batch before the forward and
  ``finish_shuffle`` after it, each inside ``torch.cuda.stream(side)`` (the
  pipeline's memcpy stream) and fenced: the side stream first waits for the
  default stream, the default stream then waits for the side stream;
* ``side``: the same calls on the side stream without fences; the default
  stream waits for the side stream only before the next forward reads the batch.

Step time = wall time of ``steps`` steps between two device syncs, over
``steps`` (the host may run ahead within the loop, as in training; no gradient
all-reduce: with gloo on CUDA tensors it would swamp what is measured).
Host-blocked time = wall time inside the two shuffle calls per step. On CUDA
an untimed pass counts the synchronising calls the two calls make on the
calling thread (``torch.cuda.set_sync_debug_mode("warn")``), and apart from
them those other Python threads make meanwhile (the partition thread's wait
for the workloads' copy; it blocks that thread only); syncs inside gloo's own
C++ threads are not seen. On CPU the side stream is a no-op context.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from time import perf_counter
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _e2e_common import sample_lengths
from _gpu_common import VOCAB, Dims, Transformer, count_syncs, dtype_for, pack_batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from balancer import BaseBatch, BatchShuffler, PolynomialCost

MODES = ("none", "fenced", "side")


def _batch(cfg: dict[str, Any], step: int, rank: int, world: int, device: torch.device) -> BaseBatch:
    """Rank ``rank``'s contiguous slice of step ``step``'s Zipf global batch."""
    rng = np.random.default_rng([cfg["seed"], step])
    b = cfg["batch_size"]
    lengths = sample_lengths("zipf", world * b, cfg["max_len"], rng, cfg["alpha"])[rank * b : (rank + 1) * b]
    kjt = KeyedJaggedTensor(keys=["seq"], values=torch.from_numpy(rng.integers(0, VOCAB, int(lengths.sum()))),
                            lengths=torch.from_numpy(lengths.astype(np.int64)))
    labels = torch.from_numpy(rng.integers(0, 2, b).astype(np.float32))
    batch = BaseBatch(features=kjt, batch_size=b, feature_to_max_seqlen={"seq": cfg["max_len"]}, labels=labels)
    return batch.to(device)


class _Runner:
    """The training loop of one rank, in each of the three modes."""

    def __init__(self, model: Transformer, backend: str, shuffler: BatchShuffler,
                 raw: list[BaseBatch], balanced: list[BaseBatch], device: torch.device) -> None:
        self.model, self.backend, self.shuffler = model, backend, shuffler
        self.raw, self.balanced = raw, balanced
        self.main = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stats: list[tuple[float, float, int]] = []

    def _phase(self, mode: str, fn: Callable[..., Any], args: tuple[Any, ...],
               syncs: list[int], other: list[int], i: int, count: bool) -> tuple[Any, float]:
        fenced = mode == "fenced" and self.side is not None
        if fenced:
            self.side.wait_stream(self.main)  # type: ignore[union-attr, arg-type]
        ctx = torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()
        t0 = perf_counter()
        with ctx, count_syncs(syncs, i, count, other):
            out = fn(*args)
        dt = perf_counter() - t0
        if fenced:
            self.main.wait_stream(self.side)  # type: ignore[union-attr, arg-type]
        return out, dt

    def run(self, mode: str, steps: int, count: bool = False,
            check: bool = False) -> tuple[list[float], list[int], list[int], bool]:
        """``steps`` steps; (host-blocked seconds per step, syncs [phase 1, phase 2]
        of the calling thread, of other threads meanwhile, whether every pipelined
        shuffle gave the batch balanced beforehand)."""
        cur, blocked, syncs, other, same = self.balanced[0], [], [0, 0], [0, 0], True
        for s in range(steps):
            nxt, t_blk = self.balanced[s + 1], 0.0
            if mode != "none":
                h, dt = self._phase(mode, self.shuffler.start_shuffle_async, (self.raw[s + 1],), syncs, other, 0, count)
                t_blk += dt
            loss = self.model(pack_batch(cur, self.backend), self.backend)
            if mode != "none":
                nxt, dt = self._phase(mode, self.shuffler.finish_shuffle, (self.raw[s + 1], h), syncs, other, 1, count)
                t_blk += dt
                st = h.stats
                self.stats.append((st.imbalance_before, st.imbalance_after, st.bytes_sent))
                if self.main is not None:
                    # Allocated on the side stream, read on the default stream.
                    nxt.record_stream(self.main)
            loss.backward()
            self.model.zero_grad(set_to_none=True)
            if mode == "side" and self.side is not None:
                self.main.wait_stream(self.side)  # type: ignore[union-attr, arg-type]
            if check and mode != "none":
                want = self.balanced[s + 1].features
                same &= torch.equal(nxt.features.lengths(), want.lengths()) and torch.equal(
                    nxt.features.values(), want.values())
            blocked.append(t_blk)
            cur = nxt
        return blocked, syncs, other, same


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the shuffle section (started by ``_gpu_common.launch``)."""
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = Transformer(Dims(**cfg["dims"])).to(device, dtype_for(device))
    shuffler = BatchShuffler(PolynomialCost(["seq"], *cfg["cost"]))
    steps = cfg["steps"]
    out: dict[str, Any] = {"step_s": {m: [] for m in MODES}, "blocked_s": {m: [] for m in MODES},
                           "syncs": {}, "syncs_elsewhere": {}, "matches": True}
    try:
        raw = [_batch(cfg, s, rank, world, device) for s in range(steps + 1)]
        runner = _Runner(model, cfg["backend"], shuffler, raw, [shuffler.shuffle(b) for b in raw], device)
        # The process's first pinned allocation synchronises once (the host
        # allocator's start-up; measured on an H200): a step of each mode first,
        # so that the count below is the steady state's.
        for m in MODES[1:]:
            runner.run(m, 1)
        for m in MODES:  # untimed: sync count, and the pipelined result checked
            _, syncs, other, same = runner.run(m, min(2, steps), count=device.type == "cuda", check=True)
            out["syncs"][m] = syncs if device.type == "cuda" else None
            out["syncs_elsewhere"][m] = other if device.type == "cuda" else None
            out["matches"] &= same
        runner.stats.clear()
        for rep in range(cfg["reps"]):
            for m in MODES[rep % len(MODES):] + MODES[: rep % len(MODES)]:
                dist.barrier()
                _sync(device)
                t0 = perf_counter()
                blocked, _, _, _ = runner.run(m, steps)
                _sync(device)
                out["step_s"][m].append((perf_counter() - t0) / steps)
                out["blocked_s"][m].append(statistics.median(blocked))
        out["imbalance_before"] = statistics.median(s[0] for s in runner.stats)
        out["imbalance_after"] = statistics.median(s[1] for s in runner.stats)
        out["bytes_sent"] = statistics.median(s[2] for s in runner.stats)
    finally:
        shuffler.close()
    return out


def summarize(cfg: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: step ms (median over repetitions of the slower rank), overhead
    over ``none``, host-blocked ms per step, synchronising calls per step."""
    res: dict[str, Any] = {k: v for k, v in cfg.items() if k != "cost"}
    reps = len(per_rank[0]["step_s"]["none"])
    for m in MODES:
        res[f"{m}_step_ms"] = 1e3 * statistics.median(max(r["step_s"][m][i] for r in per_rank) for i in range(reps))
        res[f"{m}_blocked_ms"] = 1e3 * statistics.median(
            max(r["blocked_s"][m][i] for r in per_rank) for i in range(reps))
        for key, name in (("syncs", "syncs_per_step"), ("syncs_elsewhere", "other_thread_syncs_per_step")):
            counts = per_rank[0][key][m]
            res[f"{m}_{name}"] = None if counts is None else [c / min(2, cfg["steps"]) for c in counts]
    for m in MODES[1:]:
        res[f"{m}_overhead"] = res[f"{m}_step_ms"] / res["none_step_ms"] - 1
    res["shuffle_matches"] = all(r["matches"] for r in per_rank)
    for k in ("imbalance_before", "imbalance_after", "bytes_sent"):
        res[k] = statistics.median(r[k] for r in per_rank)
    return res


def format_table(r: dict[str, Any]) -> str:
    lines = [f"shuffle cost: 2 gloo ranks on {r['device']}, B={r['batch_size']}, {r['steps']} steps x "
             f"{r['reps']} reps; est. max/mean {r['imbalance_before']:.3f} -> {r['imbalance_after']:.3f}, "
             f"{r['bytes_sent'] / 1024:.1f} KiB sent/rank/step",
             f"{'mode':>8} | {'step ms':>8} {'overhead':>8} | {'host-blocked ms':>15} | {'syncs/step ph1 ph2':>18} | {'other threads':>13}"]
    for m in MODES:
        over = f"{100 * r[m + '_overhead']:+7.2f}%" if m != "none" else f"{'-':>8}"
        syncs, other = ("n/a (CPU)" if c is None else f"{c[0]:.1f} {c[1]:.1f}"
                        for c in (r[f"{m}_syncs_per_step"], r[f"{m}_other_thread_syncs_per_step"]))
        lines.append(f"{m:>8} | {r[m + '_step_ms']:>8.2f} {over} | {r[m + '_blocked_ms']:>15.2f} | {syncs:>18} | {other:>13}")
    lines.append(f"pipelined shuffle output == batch balanced beforehand: {r['shuffle_matches']}")
    return "\n".join(lines)
