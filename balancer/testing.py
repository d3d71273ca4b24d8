"""A small multi-process harness for code that issues real gloo collectives.

Used by balancer's tests and benchmarks, and usable in users' own tests.

Workers start from a ``forkserver``: one server process imports torch, torchrec
(where it is installed) and balancer once (~4 s, on the first launch), then forks a clean worker per
rank (~0.1 s for a launch of 4). Plain ``fork`` is not an option: a process that
has initialised CUDA (or autograd's thread pool) cannot fork children that use
them ("Cannot re-initialize CUDA in forked subprocess"), and ``spawn`` re-imports
torch and torchrec in every worker (5-9 s each). So a test launches once and
loops over its sub-cases inside the worker.

The worker function must be importable by name (defined at module level of an
importable module or of the ``__main__`` script, whose launching code then sits
under ``if __name__ == "__main__":`` -- the server re-imports the script) and
takes ``(rank, world_size, *args)``; arguments and the result must be picklable
(plain Python / numpy).

``run_workers`` raises if any rank failed, with every rank's traceback;
``run_workers_outcomes`` returns each rank's result or :class:`WorkerError`, for
tests asserting that *every* rank raised.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import multiprocessing as mp
import multiprocessing.context
import os
import pickle
import queue
import random
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class WorkerError:
    """What a rank raised: exception type name, message and traceback text."""

    rank: int
    type_name: str
    message: str
    traceback: str


__all__ = ["WorkerError", "free_port", "run_workers", "run_workers_outcomes"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, below the kernel's ephemeral range.

    A rendezvous port is bound seconds after it is chosen (rank 0 imports torch
    first). A port from the ephemeral range, where the kernel picks the local
    port of every outgoing connection (gloo's pairs, store clients), could be
    handed to another process's connection meanwhile; one below that range is
    only ever taken by an explicit bind. Where the range is unknown (no
    ``/proc``), the kernel picks one.
    """
    low = _ephemeral_low()
    if low is not None and low > _FIRST_PORT:
        pick = random.Random()  # seeded from os.urandom: not the global RNG, which tests seed
        for _ in range(64):
            port = pick.randrange(_FIRST_PORT, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_FIRST_PORT = 20000  # free_port draws from [_FIRST_PORT, the ephemeral range's start)


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), or ``None``."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


_context: multiprocessing.context.ForkServerContext | None = None


def _preload() -> list[str]:
    """What the server imports once for every worker: torch, balancer, and TorchRec
    where it loads here. The server survives only an ImportError while preloading,
    so a TorchRec that fails otherwise (fbgemm-gpu built for another torch raises
    an ``OSError``) is tried here first and left out; the token path needs none."""
    try:
        import torchrec  # noqa: F401 - loaded here so that the server's import cannot fail
    except (ImportError, OSError):
        return ["torch", "balancer"]
    return ["torch", "torchrec", "balancer"]


def _mp_context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, with torch, balancer and (where it loads) TorchRec
    preloaded in the server."""
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        # Only takes effect before the server starts (the first launch); the
        # server is shared by every later launch of this process.
        ctx.set_forkserver_preload(_preload())
        _start_forkserver()
        _context = ctx
    return _context


def _start_forkserver() -> None:
    """Start the server with CUDA's availability answered by NVML, not the driver.

    ``import fbgemm_gpu`` (preloaded) calls ``torch.cuda.is_available()``.
    Answered by the CUDA runtime (``cudaGetDeviceCount``), that initialises the
    driver in the server, and every worker forked from it then fails its first
    CUDA call: "Cannot re-initialize CUDA in forked subprocess", or
    ``cudaErrorInitializationError`` from ``pin_memory`` (seen on an H200).
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` makes torch ask NVML instead, which
    leaves the driver alone. The server takes the environment as it starts, so
    the variable is set only around the start: the caller's own process is left
    as it was, and the workers inherit the server's.
    """
    key = "PYTORCH_NVML_BASED_CUDA_CHECK"
    saved = os.environ.get(key)
    os.environ[key] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


_STACKS_FILE: Any = None  # a worker's open file for its stack dump (kept open for faulthandler)


def _entry(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...], q: Any,
    backend: str = "gloo", stacks_dir: str | None = None,
) -> None:
    global _STACKS_FILE
    if stacks_dir is not None:
        # On a timeout the parent asks for every thread's stack (SIGUSR1), so a
        # hang names where each rank waits instead of only that it did.
        _STACKS_FILE = open(os.path.join(stacks_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 - lives with the process
        faulthandler.register(signal.SIGUSR1, file=_STACKS_FILE, all_threads=True)
    # Ctrl-C raises KeyboardInterrupt in a rank, as in any Python process: a forkserver
    # started while its parent ignored SIGINT hands that on to every rank it forks.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # One intra-op thread per rank: ranks share the machine's cores.
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        kwargs: dict[str, Any] = {}
        if backend == "nccl":  # one GPU per rank (NCCL refuses two ranks on one GPU)
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, **kwargs
        )
        out: Any = fn(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out = WorkerError(rank, type(e).__name__, str(e), traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    try:
        # A queue drops what it cannot pickle in its feeder thread, silently;
        # pickle here so the parent gets an error instead of a timeout. Sent as
        # bytes: the queue's own pickler shares a tensor's storage through a
        # file descriptor that is gone once this process exits.
        data = pickle.dumps(out)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        data = pickle.dumps(WorkerError(rank, type(e).__name__, f"result is not picklable: {e}",
                                        traceback.format_exc()))
    q.put((rank, data))


def run_workers_outcomes(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (forkserver workers).

    ``backend``: ``"gloo"`` (default; ranks may also hold CUDA tensors, all on
    one GPU) or ``"nccl"`` (rank r on GPU r; needs ``world_size`` GPUs).

    Returns:
        Per rank, its return value or a :class:`WorkerError`.

    A launch whose rank 0 finds the rendezvous port taken (another process
    bound it after :func:`free_port` chose it; no rank has run ``fn``) is
    killed and launched again on a new port, up to ``_PORT_TRIES`` times; the
    other ranks used to wait in the rendezvous until ``timeout``.

    Raises:
        TimeoutError: if some rank has not finished after ``timeout`` seconds
            (all ranks are then killed) -- a hang is a failure, never a wait.
        RuntimeError: the port was taken at every launch.
    """
    for attempt in range(1, _PORT_TRIES + 1):
        try:
            return _launch(fn, world_size, args, timeout, backend)
        except _PortTaken as e:  # between free_port() and rank 0's bind, another process took it
            if attempt == _PORT_TRIES:
                raise RuntimeError(f"rank 0 found its rendezvous port taken (EADDRINUSE) in {attempt} "
                                   "launches in a row") from e
    raise AssertionError("unreachable")


_PORT_TRIES = 3  # launches tried where rank 0 finds its rendezvous port taken (EADDRINUSE)


class _PortTaken(Exception):
    """Rank 0 could not bind the rendezvous port: no rank ran ``fn``; launch again."""


def _launch(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float,
            backend: str) -> list[Any]:
    """One launch of :func:`run_workers_outcomes` on a fresh port."""
    ctx = _mp_context()
    q = ctx.Queue()
    port = free_port()
    stacks_dir = tempfile.mkdtemp(prefix="balancer_workers_")
    # Not daemonic: a rank may start processes of its own (a DataLoader's workers); every
    # rank is joined or killed below whatever happens.
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, args, q, backend, stacks_dir), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    timed_out = False
    try:
        _collect(q, procs, results, timeout, stacks_dir)
    except _PortTaken:
        timed_out = True  # the other ranks wait in the rendezvous: kill them at once
        raise
    except queue.Empty as e:
        timed_out = True
        missing = sorted(set(range(world_size)) - set(results))
        raise TimeoutError(
            f"ranks {missing} did not finish within {timeout}s; finished: {results}"
            + _stacks(procs, missing, stacks_dir)
        ) from e
    finally:
        for p in procs:
            if not timed_out:
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(stacks_dir, ignore_errors=True)
    return [results[r] for r in range(world_size)]


_DEAD_GRACE_S = 10.0  # how long the other ranks may take to fail once one rank has died


def _collect(q: Any, procs: list[Any], results: dict[int, Any], timeout: float, stacks_dir: str) -> None:
    """Fill ``results`` from the queue until every rank has reported.

    A rank that exits without a result (it died unpickling its function, was
    killed, ...) is a :class:`WorkerError` at once, not a wait for the
    timeout; the ranks still running then get ``_DEAD_GRACE_S`` to fail on
    their own (a collective with a dead peer), after which they are reported
    with their stacks.

    Raises:
        queue.Empty: when ``timeout`` passes with ranks neither finished nor dead.
    """
    deadline = time.monotonic() + timeout
    grace_end: float | None = None
    while len(results) < len(procs):
        now = time.monotonic()
        limit = deadline if grace_end is None else min(deadline, grace_end)
        if now >= limit:
            if grace_end is None or deadline <= grace_end:
                raise queue.Empty
            alive = [r for r in range(len(procs)) if r not in results]
            text = _stacks(procs, alive, stacks_dir)
            for r in alive:
                results[r] = WorkerError(r, "WorkerAbandoned", f"still running {_DEAD_GRACE_S:.0f}s after "
                                         "another rank died without a result", text)
            return
        try:
            rank, data = q.get(timeout=min(0.5, limit - now))
            results[rank] = out = pickle.loads(data)
            if isinstance(out, WorkerError) and out.type_name == "DistNetworkError" and "EADDRINUSE" in out.message:
                raise _PortTaken
            continue
        except queue.Empty:
            pass
        exited = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
        if not exited:
            continue
        try:  # a rank that reported just before exiting: its result is in the pipe
            while True:
                rank, data = q.get(timeout=1.0)
                results[rank] = pickle.loads(data)
        except queue.Empty:
            pass
        for r in exited:
            if r not in results:
                results[r] = WorkerError(
                    r, "WorkerDied", f"rank {r} exited with code {procs[r].exitcode} without a result "
                    "(it died starting up, e.g. unpickling its function, or was killed; its stderr "
                    "has the reason)", "")
                if grace_end is None:
                    grace_end = time.monotonic() + _DEAD_GRACE_S


def _stacks(procs: list[Any], ranks: list[int], stacks_dir: str) -> str:
    """Every thread's stack of each unfinished rank, dumped on request (SIGUSR1)."""
    signalled = [r for r in ranks if procs[r].is_alive()]
    for r in signalled:
        os.kill(procs[r].pid, signal.SIGUSR1)
    if signalled:
        time.sleep(1.0)  # faulthandler writes from the signal handler, at once
    out = []
    for r in ranks:
        try:
            with open(os.path.join(stacks_dir, f"rank{r}.txt")) as f:
                text = f.read()
        except OSError:
            text = ""
        out.append(f"\n--- rank {r} stacks:\n{text[-6000:] or '(none written)'}")
    return "".join(out)


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, backend: str = "gloo"
) -> list[Any]:
    """Like :func:`run_workers_outcomes` but raises if any rank raised."""
    outs = run_workers_outcomes(fn, world_size, *args, timeout=timeout, backend=backend)
    errors = [o for o in outs if isinstance(o, WorkerError)]
    if errors:
        text = "\n".join(f"--- rank {e.rank}: {e.type_name}: {e.message}\n{e.traceback}" for e in errors)
        raise AssertionError(f"{len(errors)} rank(s) failed:\n{text}")
    return outs


# ------------------------------------------------------------ host reads
_READS = {
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__complex__",
    "__array__", "__repr__", "__format__", "__str__", "nonzero", "argwhere", "masked_select", "unique",
    "unique_consecutive", "equal", "allclose", "is_nonzero",
}


def _names_cpu(value: Any) -> bool:
    return (isinstance(value, torch.device) and value.type == "cpu") or value == "cpu"


class HostReadRecorder(torch.overrides.TorchFunctionMode):
    """Records every torch call on this thread that reads tensor values on the host.

    On CUDA each of these blocks the host until the device has drained the
    queue (a synchronisation); on the CPU they are cheap, so a CPU test cannot
    time them, but it can see them. Torch function modes are thread-local:
    other threads (the shuffler's background thread) are not recorded.

    Recorded: ``item``, ``tolist``, ``numpy``, ``cpu`` and ``to``/``copy_`` to
    the CPU without ``non_blocking`` (from any source: on the CPU a host source
    cannot be told from a device one), ``bool``/``int``/``float`` of a tensor,
    printing one, ``nonzero``/``argwhere``/``masked_select``/``unique``,
    ``equal``/``allclose``, indexing with a boolean tensor, and
    ``repeat_interleave`` with tensor repeats (or a tensor alone, whose values
    are the repeats) but no ``output_size``.

    Example::

        with HostReadRecorder() as reads:
            out = shuffler.shuffle(batch)
        assert not reads.calls, reads.calls
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if self._reads(name, args, kwargs):
            self.calls.append(name)
        return func(*args, **kwargs)

    @staticmethod
    def _reads(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
        if name in _READS:
            return True
        if name in ("to", "copy_"):
            if kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True and name == "copy_"):
                return False
            targets = [kwargs.get("device"), *args[1:2]]
            if name == "copy_":
                # Into the host, whatever the source (like ``to("cpu")``): a
                # CPU run cannot tell a host source from a device one.
                dst = args[0] if args else None
                return isinstance(dst, torch.Tensor) and dst.device.type == "cpu"
            return any(_names_cpu(t) for t in targets if t is not None)
        if name == "repeat_interleave":
            # One argument: the tensor's own values are the repeats.
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else args[0] if args else None)
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
            index = args[1] if len(args) > 1 else None
            items = index if isinstance(index, (tuple, list)) else (index,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
        return False


__all__ += ["HostReadRecorder"]
