"""The CPU proxy for "no host syncs": the calling thread never reads a tensor value.

On CUDA every value read on the host (``.item()``, ``.tolist()``, ``bool(t)``,
a blocking ``.cpu()``, ``nonzero``, ...) waits until the device has drained its
queue. :class:`balancer.testing.HostReadRecorder` (a torch function mode, which
is thread-local) records such calls on the calling thread only, so the
shuffler's background thread may use numpy freely. Also counted: collectives
per shuffle and where they run (the real gloo collectives, wrapped).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from balancer.shuffler import BatchShuffler
from balancer.testing import HostReadRecorder, run_workers
from tests.tbe import skip_without_tbe
from tests.test_shuffler import make_batch, token_count

_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_to_all_single", "all_gather",
                "all_gather_object", "all_reduce", "broadcast", "barrier", "reduce_scatter_tensor")


class _Counter:
    """Wraps torch.distributed's collectives; counts calls per thread kind."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Counter:
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                real = self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, real))
        return self

    def _wrap(self, name: str, real: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            where = "background" if threading.current_thread().name.startswith("balancer") else "caller"
            self.calls[f"{where}:{name}"] += 1
            return real(*args, **kwargs)

        return counted

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)

    def take(self) -> dict[str, int]:
        out = dict(self.calls)
        self.calls.clear()
        return out


def _downstream(batch: Any) -> None:
    """What a model or TorchRec's input dist does with the output KJTs first."""
    for kjt in batch.kjt_fields().values():
        kjt.length_per_key()
        kjt.offset_per_key()
        kjt.offsets()
        kjt.to_dict()
        kjt.stride()


def _sync_worker(rank: int, w: int) -> list[dict[str, Any]]:
    out = []
    for comm in ("all2all", "allgather"):
        s = BatchShuffler(token_count, comm=comm)
        s.shuffle(make_batch(rank, 8, 8, seed=0))  # first use: groups, agreement round
        for case in range(5):
            # Cases 0-3 keep the agreed layout (steady state); case 4 switches
            # every rank to dense labels, which costs one header-only round.
            batch = make_batch(rank, 8, [8, 5, 8, 0, 6][case] if rank == 1 else 8, seed=10 + case,
                               labels="dense" if case == 4 else "kjt")
            with _Counter() as counter, HostReadRecorder() as reads:
                h = s.start_shuffle_async(batch)
                shuffled = s.finish_shuffle(batch, h)
                _downstream(shuffled)
            out.append(dict(comm=comm, reads=reads.calls, collectives=counter.take(), moved=h.stats.comm != "none",
                            real=shuffled.actual_batch_size, relayout=case == 4))
        s.close()
    return out


@pytest.mark.parametrize("w", [2, 4])
def test_shuffle_reads_no_tensor_value_on_the_calling_thread(w: int) -> None:
    for rank, cases in enumerate(run_workers(_sync_worker, w)):
        assert sum(c["real"] for c in cases) > 0
        for c in cases:
            assert c["reads"] == [], (rank, c)
            calls = c["collectives"]
            background = sum(n for k, n in calls.items() if k.startswith("background"))
            caller = sum(n for k, n in calls.items() if k.startswith("caller"))
            # <= 2 collectives in all: phase 1's one all-gather in the background,
            # at most one in phase 2 (none when no sample moves anywhere).
            assert background == 1 + c["relayout"] and caller == int(c["moved"]), (rank, c)
            expected = "caller:all_to_all_single" if c["comm"] == "all2all" else "caller:all_gather_single"
            assert not c["moved"] or calls.get(expected) == 1 or calls.get(expected.replace(
                "all_gather_single", "all_gather_into_tensor")) == 1, (rank, c)


def _pipeline_worker(rank: int, w: int) -> dict[str, Any]:
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from synthetic_data import ITEM_FEATURE, SyntheticHSTUData
    from train_hstu import build_model, parse_args

    from balancer.pipeline import BalancedTrainPipelineSparseDist
    from balancer.workloads import TokenCount

    args = parse_args(["--batch-size", "8", "--max-seqlen", "32", "--dim", "16", "--num-layers", "1"])
    model, optimizer = build_model(args, torch.device("cpu"), dist.group.WORLD)
    data = SyntheticHSTUData(rank=rank, batch_size=8, num_batches=6, max_seqlen=32, seed=3)
    pipe = BalancedTrainPipelineSparseDist(model, optimizer, torch.device("cpu"),
                                           BatchShuffler(TokenCount([ITEM_FEATURE])))
    reads: list[str] = []
    steps = {"start": 0, "finish": 0}
    # Record inside the pipeline's balancing hooks: phase 1 on the host batch,
    # phase 2 with its fences and record_stream, and the swap into the queue.
    for hook in ("_start_shuffle", "_finish_shuffles"):
        real = getattr(pipe, hook)

        def recorded(*a: Any, _real: Any = real, _hook: str = hook, **k: Any) -> Any:
            with HostReadRecorder() as rec:
                result = _real(*a, **k)
            reads.extend(rec.calls)
            steps["start" if _hook == "_start_shuffle" else "finish"] += 1
            return result

        setattr(pipe, hook, recorded)
    it = iter(data)
    n = 0
    while True:
        try:
            pipe.progress(it)
        except StopIteration:
            break
        n += 1
    pipe.close()
    return dict(reads=reads, steps=n, hooks=steps, stats=pipe.last_step_stats is not None)


def test_balanced_pipeline_hooks_read_no_tensor_value() -> None:
    skip_without_tbe("the example's sharded model")
    for out in run_workers(_pipeline_worker, 2, timeout=300):
        assert out["steps"] == 6 and out["hooks"]["start"] == 6 and out["stats"], out
        assert out["reads"] == [], out["reads"]


def test_recorder_sees_reads_on_its_thread_only() -> None:
    t = torch.arange(6)
    with HostReadRecorder() as rec:
        bool(t[0] > 1)
        t.tolist()
        torch.repeat_interleave(t, t)
        torch.repeat_interleave(t, t, output_size=15)  # sized: no read
        t[t > 2]
        t.to(torch.float64)  # no read
        t.to("cpu")
        torch.repeat_interleave(t)  # its own values are the repeats
        torch.empty(6, dtype=t.dtype).copy_(t)  # into the host: a blocking D2H copy on a GPU
        torch.empty(6, dtype=t.dtype).copy_(t, non_blocking=True)  # no read
        other = threading.Thread(target=lambda: t.numpy())
        other.start()
        other.join()
    assert rec.calls == ["__bool__", "tolist", "repeat_interleave", "__getitem__", "to", "repeat_interleave",
                         "copy_"]
    assert np.array_equal(t.numpy(), np.arange(6))
