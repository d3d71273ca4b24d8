"""Lifecycle under faults: exit, ``close()``, interrupts, the partition child.

A long job crashes, is preempted and restarts: a process must exit at once
after an error even while a shuffle waits for a stalled peer, ``close()`` must
return promptly and always stop the background thread and the child, an
interrupted ``finish_shuffle`` must be retryable, and the partition child must
not outlive its parent. Every test here failed before the fix it names.
"""

from __future__ import annotations

import collections
import copy
import datetime
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from balancer.errors import ShuffleAbortedError
from balancer.partition._worker import PartitionWorker
from balancer.shuffler import BatchShuffler
from balancer.testing import free_port, run_workers
from tests.test_shuffler import make_batch, rows, token_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two ranks started as plain processes: rank 0 starts a shuffle and raises at once;
# rank 1 is in the group but never reaches that shuffle (stalled elsewhere).
_STALLED_PEER = textwrap.dedent("""
    import sys, time
    import torch.distributed as dist
    sys.path.insert(0, {root!r})
    from balancer.shuffler import BatchShuffler
    from tests.test_shuffler import make_batch, token_count
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    s = BatchShuffler(token_count, timeout=60.0)
    s.shuffle(make_batch(rank, 8, 8, seed=2))
    if rank == 1:
        time.sleep(40)
        raise SystemExit(0)
    s.start_shuffle_async(make_batch(rank, 8, 8, seed=3))
    print("raising", flush=True)
    raise RuntimeError("loss is NaN")
""")


def test_an_error_exits_the_process_while_a_shuffle_waits_for_a_stalled_peer() -> None:
    # The background thread was a ThreadPoolExecutor's, joined at interpreter exit:
    # the process lingered until the shuffler's timeout (here 60 s, 300 s by
    # default) after its traceback, past a preemption's grace period.
    code = _STALLED_PEER.format(root=ROOT, port=free_port())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        assert procs[0].stdout is not None
        line = procs[0].stdout.readline()  # blocks until rank 0 is about to raise
        assert line == "raising\n", (line, procs[0].stderr.read() if procs[0].stderr else "")
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=120)
        exited = time.monotonic() - t0
        assert procs[1].poll() is None, "the stalled peer is still in the group"
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert rc == 1 and exited < 30, (rc, exited)  # ~3 s (the job's grace); was 60 s + 5 s of grace


def _close_worker(rank: int, w: int) -> tuple[float, str, float]:
    s = BatchShuffler(token_count, timeout=60.0)
    s.shuffle(make_batch(rank, 8, 8, seed=2))
    if rank == 1:  # stalled: never starts the second shuffle
        time.sleep(6)
        s.close()
        return 0.0, "", 0.0
    batch = make_batch(rank, 8, 8, seed=3)
    h = s.start_shuffle_async(batch)
    waiter: dict[str, Any] = {}

    def finish() -> None:  # another thread waits in finish_shuffle (a loader's producer, a watchdog's victim)
        try:
            s.finish_shuffle(batch, h)
            waiter["error"] = "returned"
        except BaseException as e:  # noqa: BLE001 - reported to the test
            waiter["error"] = f"{type(e).__name__}: {e}"
        waiter["at"] = time.perf_counter()

    thread = threading.Thread(target=finish)
    thread.start()
    time.sleep(0.5)  # the job now waits in phase 1 for rank 1, and the thread for the job
    t0 = time.perf_counter()
    s.close()
    took = time.perf_counter() - t0
    thread.join(30)
    return took, waiter.get("error", "still waiting"), waiter.get("at", float("inf")) - t0


def test_close_returns_promptly_while_a_shuffle_waits_for_a_stalled_peer() -> None:
    # close() joined the background thread, which waited in the collective until
    # the peer went away or the timeout ran out (42 s in the report). A finish_shuffle
    # waiting on another thread then waited for the job: until the peer left (here
    # 6 s, then a ShuffleAbortedError) or the shuffler's timeout.
    took, error, woke = run_workers(_close_worker, 2, timeout=120)[0]
    assert took < 4.0, took  # the grace for a running job is 2 s; the peer stalls for 6 s
    assert error == ("RuntimeError: shuffle handle #1: the shuffler was closed while finish_shuffle waited "
                     "for its background work"), error
    assert woke < 1.0, woke  # woken by close() itself, before its grace for the job


def _interrupt_worker(rank: int, w: int) -> tuple[str, list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    s = BatchShuffler(token_count, timeout=60.0)
    s.shuffle(make_batch(rank, 8, 8, seed=2))
    batch = make_batch(rank, 8, 8, seed=3)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # late: starts only once rank 0 was interrupted waiting for it
        store.wait(["interrupted"], datetime.timedelta(seconds=60))
    h = s.start_shuffle_async(batch)
    first = "ok"
    if rank == 0:
        threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        try:
            out = s.finish_shuffle(batch, h)
        except KeyboardInterrupt:
            first = "KeyboardInterrupt"
            store.set("interrupted", "1")
            out = s.finish_shuffle(batch, h)  # the same call again finishes it
    else:
        out = s.finish_shuffle(batch, h)
    again = s.shuffle(make_batch(rank, 8, 8, seed=4))  # and the shuffler goes on
    s.close()
    return first, rows(batch)[: batch.actual_batch_size], rows(out)[: out.actual_batch_size] + \
        [("next", r) for r in rows(again)[: again.actual_batch_size]]


def test_an_interrupted_finish_can_be_called_again() -> None:
    # Ctrl-C while finish_shuffle waited used the handle up before phase 2 ran: the
    # retry raised "already finished", and the peer aborted after its timeout.
    outs = run_workers(_interrupt_worker, 2, timeout=120)
    assert outs[0][0] == "KeyboardInterrupt"
    given = sorted(r for o in outs for r in o[1])
    got = sorted(r for o in outs for r in o[2] if r[0] != "next")
    assert got == given, "every real sample exactly once"


def test_close_does_not_wait_for_a_wedged_child() -> None:
    # A thread reading the reply of a stopped (wedged) child held the worker's lock,
    # and close() waited for that lock for good.
    worker = PartitionWorker()
    worker(np.arange(8), 2)  # started and answering
    os.kill(worker._proc.pid, signal.SIGSTOP)  # wedged before it can answer
    handle = worker.submit(np.arange(4096), 8)  # 32 KiB: fits the pipe, the write does not block
    seen: list[BaseException] = []

    def wait() -> None:
        try:
            handle.wait()
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            seen.append(e)

    reader = threading.Thread(target=wait, daemon=True)
    reader.start()
    time.sleep(0.3)
    closer = threading.Thread(target=worker.close, daemon=True)
    t0 = time.perf_counter()
    closer.start()
    closer.join(10)
    reader.join(10)
    try:
        assert not closer.is_alive() and time.perf_counter() - t0 < 5
        assert not reader.is_alive() and len(seen) == 1 and isinstance(seen[0], RuntimeError), seen
        assert "PartitionWorker is closed" in str(seen[0])
        assert worker._proc.poll() is not None, "the child was killed"
    finally:
        if worker._proc.poll() is None:
            worker._proc.kill()


# A parent that starts a child, forks (as a DataLoader with workers does) and
# closes it, then starts another and dies without closing it.
_FORKED_HOLDER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from balancer.partition._worker import PartitionWorker
    w = PartitionWorker()
    w([1, 2, 3, 4], 2)
    holder = os.fork()
    if holder == 0:  # holds a copy of every pipe, as a forked DataLoader worker does
        os.close(1); os.close(2)  # (but not the test's output)
        time.sleep(30)
        os._exit(0)
    t0 = time.perf_counter()
    w.close()
    took = time.perf_counter() - t0
    w2 = PartitionWorker()
    w2([1, 2, 3, 4], 2)
    holder2 = os.fork()
    if holder2 == 0:
        os.close(1); os.close(2)
        time.sleep(30)
        os._exit(0)
    print(took, w2._proc.pid, holder, holder2, flush=True)
    os._exit(0)  # dies without closing w2
""")


def test_the_child_stops_when_closed_or_orphaned_while_a_forked_process_holds_its_pipe() -> None:
    # The child only watched its stdin, which a forked process kept open: close()
    # took 5 s (then killed it), and a dead parent's child lived on.
    out = subprocess.run([sys.executable, "-c", _FORKED_HOLDER.format(root=ROOT)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    took, child, *holders = out.stdout.split()
    try:
        assert float(took) < 1.0, took
        deadline = time.monotonic() + 10
        while _running(int(child)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(int(child)), "the orphaned child exits within a second or so"
    finally:
        for pid in (child, *holders):
            if _running(int(pid)):
                os.kill(int(pid), signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie) on this machine."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def _pipeline_close_worker(rank: int, w: int) -> tuple[str, bool, bool]:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from synthetic_data import ITEM_FEATURE, SyntheticHSTUData
    from train_hstu import build_model, parse_args

    from balancer.pipeline import BalancedTrainPipelineSparseDist
    from balancer.workloads import TokenCount

    args = parse_args(["--batch-size", "8", "--max-seqlen", "24", "--dim", "16", "--num-layers", "1"])
    model, optimizer = build_model(args, torch.device("cpu"), dist.group.WORLD)
    data = iter(SyntheticHSTUData(rank=rank, batch_size=8, num_batches=8, max_seqlen=24, seed=3))
    shuffler = BatchShuffler(TokenCount([ITEM_FEATURE]), timeout=3.0)
    pipe = BalancedTrainPipelineSparseDist(model, optimizer, torch.device("cpu"), shuffler)
    for _ in range(2):
        pipe.progress(data)
    if rank == 1:  # leaves between steps (its process ends), later batches' shuffles pending
        return "left", False, False
    failed = ""
    try:
        for _ in range(4):
            pipe.progress(data)
    except (RuntimeError, ShuffleAbortedError) as e:
        failed = type(e).__name__
    pipe.close()  # raised, and left the shuffler's thread and child running
    return failed, shuffler._closed, shuffler._worker is None


def test_pipeline_close_after_a_peer_left_stops_the_shuffler_without_raising() -> None:
    from tests.tbe import skip_without_tbe
    skip_without_tbe("the example's sharded model")
    outs = run_workers(_pipeline_close_worker, 2, timeout=180)
    failed, closed, no_child = outs[0]
    assert failed and closed and no_child, outs


def _destroyed_worker(rank: int, w: int) -> str:
    s = BatchShuffler(token_count, timeout=3.0)
    s.shuffle(make_batch(rank, 8, 8, seed=2))
    batch = make_batch(rank, 8, 8, seed=3)
    h = s.start_shuffle_async(batch)
    dist.destroy_process_group()
    try:
        s.finish_shuffle(batch, h)
        return "finished"
    except RuntimeError as e:
        return str(e)
    finally:
        s.close()


def test_finishing_after_the_process_group_was_destroyed_says_so() -> None:
    # It said "finish_shuffle: group has W=1, rank 0; handle #1 was started with W=2".
    outs = run_workers(_destroyed_worker, 2, timeout=120)
    assert outs == ["finish_shuffle: the process group was destroyed while shuffle #1 (W=2) was in flight; "
                    "finish or close the shuffler first"] * 2, outs


def test_the_pipeline_keeps_a_shuffle_pending_when_its_finish_is_interrupted() -> None:
    # The pipeline dropped the pending shuffle before finish_shuffle returned: after
    # Ctrl-C there the shuffler kept the handle (nothing of phase 2 ran) but the
    # pipeline never finished it, and close() then logged an out-of-order error.
    from balancer.pipeline import BalancedTrainPipelineSparseDist, _PendingShuffle

    calls: list[Any] = []

    class InterruptedOnce:
        def finish_shuffle(self, batch: Any, handle: Any, pg: Any = None) -> Any:
            calls.append(handle)
            if len(calls) == 1:
                raise KeyboardInterrupt
            if len(calls) == 3:
                raise ValueError("bad input on rank 1")
            if len(calls) == 4:  # the shuffle's own outcome (this rank's loader's Ctrl-C): used up
                handle._state.finished = True
                raise KeyboardInterrupt
            return batch

    batch = make_batch(0, 4, 4, seed=0)
    handle = types.SimpleNamespace(stats="stats", _state=types.SimpleNamespace(finished=False))
    replaced: list[int] = []
    pipe = types.SimpleNamespace(
        _pending=collections.deque([_PendingShuffle(7, batch, handle)]),  # type: ignore[arg-type]
        _shuffler=InterruptedOnce(), _shuffle_pg=None, _memcpy_stream=None, _stats={},
        _fence_before_exchange=lambda: None, _fence_after_exchange=lambda: None, _consumer_streams=list,
        _replace_queued_batch=lambda index, b: replaced.append(index), _drop_if_ended=lambda index, stats: None)
    finish = BalancedTrainPipelineSparseDist._finish_shuffles
    with pytest.raises(KeyboardInterrupt):
        finish(pipe)  # type: ignore[arg-type]
    assert len(pipe._pending) == 1 and not replaced  # still pending: the next call finishes it
    finish(pipe)  # type: ignore[arg-type]
    assert not pipe._pending and replaced == [7] and pipe._stats == {7: "stats"} and calls == [handle] * 2
    pipe._pending.append(_PendingShuffle(8, batch, handle))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad input"):  # an error uses the shuffle up
        finish(pipe)  # type: ignore[arg-type]
    assert not pipe._pending
    pipe._pending.append(_PendingShuffle(9, batch, handle))  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):  # ... and so does an interrupt that was its outcome
        finish(pipe)  # type: ignore[arg-type]
    assert not pipe._pending


# A loop that leaves each epoch early and exits without close(), as a job stopping
# at max_steps or on preemption does; the default executor (the planner process).
_EARLY_EXIT = textwrap.dedent("""
    import sys, time
    import torch.distributed as dist
    sys.path.insert(0, {root!r})
    from balancer import BalancedLoader
    from tests.test_loader import _SlowFrom, cost
    rank = int(sys.argv[1])
    dist.init_process_group("gloo")  # as under torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    # rank 1 reads its later batches slowly: rank 0 exits while its producer waits
    # in a credited shuffle's collective for rank 1's
    loader = BalancedLoader(_SlowFrom(rank, [8], 2 if rank == 1 else 99), cost)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i == 1:
                break
    if rank == 1:
        time.sleep(3)  # rank 0 exits first, its producer waiting for this one's
    print("done", flush=True)
""")


def test_leaving_a_loader_loop_early_and_exiting_without_close_exits_cleanly() -> None:
    # The daemon producer was still inside its credited shuffles' collectives when the
    # interpreter exited: C++ aborted the process ("terminate called without an active
    # exception", SIGABRT), 8 of 8 runs in the report, and the job counted as failed.
    code = _EARLY_EXIT.format(root=ROOT)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port))
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out == "done\n", (p.returncode, out, err[-2000:])
        assert "terminate called" not in err


def test_close_is_idempotent_from_any_thread() -> None:
    # The first close() wakes waiting finishes through a future; a second close() (a
    # pipeline's close, then the shuffler's own) raised "Future in unexpected state".
    from balancer.shuffler import IdentityBatchShuffler
    copy.deepcopy(IdentityBatchShuffler(token_count))  # (an unused one copies, as before 91d52cd)
    for make in (lambda: BatchShuffler(token_count), lambda: IdentityBatchShuffler(token_count)):
        s = make()
        s.close()
        s.close()
        s = make()
        errors: list[BaseException] = []

        def close(s: Any = s, errors: list[BaseException] = errors) -> None:
            try:
                s.close()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=close) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        s.close()
        assert errors == []
