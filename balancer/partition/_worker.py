"""Run the partition in a child process, so it never competes for the GIL.

Why: numpy releases the GIL inside sorts, searches and large element-wise
calls. When the shuffler's partition thread does that while the main thread is
busy in Python, the partition waits up to ``sys.getswitchinterval()`` (5 ms)
to get the GIL back -- once per such call, so a 2 ms partition takes 40+ ms
(see ``docs/benchmarks_partition.md``). Doing the numpy work with the GIL held
instead stalls the main thread for its whole duration.

A :class:`PartitionWorker` owns one child interpreter (``python -c``, started
once, imports only numpy and ``balancer.partition``: no torch, ~0.2 s).
A call writes the raw workloads to the child's stdin and blocks on its stdout:
the calling thread sleeps in ``read`` without the GIL, the main thread runs
undisturbed, and the calling thread needs the GIL once, to decode the answer.
Validation happens in the child; its ``ValueError`` is re-raised here.

The shuffler asks for more than a partition: a *call* request (dtype code 2)
carries a pickled function and its keyword arguments, and the reply is the
pickled result. The shuffler sends :func:`balancer._step.plan_step` with the
gathered phase-1 messages, the layout and the rank, and gets back the
:class:`balancer._step.Step`: partition, plan, phase 2 to the byte and the
statistics, all computed without the training process's GIL. The function
travels by reference (module and name), so this module imports nothing above
the partition package; the child imports the function's module on first use,
which must therefore import no torch either.

Protocol (little-endian): request ``<qqqq`` = (n, num_parts, dtype code,
flags) then ``n`` workloads [, ``n`` int64 homes, ``n`` float64 sizes] (flag
1: homes and sizes follow; flag 2: partition :func:`balancer._quantize.quantize`
of the workloads, the shuffler's scale-free integers, while the bound stays in
workload units), or for code 2, ``n`` bytes of a pickled ``(function,
keyword arguments)``; reply ``<qqqd`` = (status, length, compute nanoseconds,
lower bound) then either ``n`` int64 (rows, part-major), ``n`` bytes of the
pickled result, or
a UTF-8 error message (status 1: bad input, re-raised as ``ValueError``;
status 2: anything else, re-raised as ``RuntimeError``). The child also
computes ``lower_bound`` (statistics only), so the caller's thread need not.
"""

from __future__ import annotations

import collections
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from balancer.partition._balanced import solve_rows
from balancer.partition._validate import as_workloads, check_home

__all__ = ["PartitionHandle", "PartitionWorker"]

_REQ = struct.Struct("<qqqq")
_REP = struct.Struct("<qqqd")
_DTYPES = {0: np.dtype("<i8"), 1: np.dtype("<f8")}
_CALL = 2  # dtype code of a function-call request
# The child imports balancer.partition (numpy only) but not balancer/__init__,
# which imports torch: the package is stubbed with its path, so its submodules
# import as usual without running its __init__.
_BOOT = (
    "import sys, types\n"
    "pkg = types.ModuleType('balancer'); pkg.__path__ = [sys.argv[1]]\n"
    "sys.modules['balancer'] = pkg  # skip balancer/__init__ (torch): numpy only\n"
    "from balancer.partition._worker import _serve\n"
    "_serve(0, 1)\n"
)


def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("partition worker closed its pipe")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view) :]


def _watch_parent(parent: int, every: float = 1.0) -> None:
    """Exit once the parent is gone (the child is re-parented): stdin does not close
    when a forked process (a DataLoader worker) still holds a copy of the pipe."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(0)


def _serve(fd_in: int, fd_out: int) -> None:
    """Child loop: answer requests until stdin closes or the parent dies."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    while True:
        try:
            head = _read_exact(fd_in, _REQ.size)
        except EOFError:
            return
        n, w, code, flags = _REQ.unpack(head)
        if code == _CALL:
            _serve_call(_read_exact(fd_in, n), fd_out)
            continue
        x = np.frombuffer(_read_exact(fd_in, 8 * n), _DTYPES[code])
        home = sizes = None
        if flags & 1:
            home = np.frombuffer(_read_exact(fd_in, 8 * n), np.int64)
            sizes = np.frombuffer(_read_exact(fd_in, 8 * n), np.float64)
        t0 = time.perf_counter_ns()
        try:
            rows, seconds, bound = solve_rows(x, w, home, sizes, bool(flags & 2))
            _write_all(fd_out, _REP.pack(0, rows.nbytes, int(seconds * 1e9), bound) + rows.tobytes())
        except (ValueError, TypeError) as e:
            msg = str(e).encode()
            _write_all(fd_out, _REP.pack(1, len(msg), time.perf_counter_ns() - t0, 0.0) + msg)


def _serve_call(payload: bytes, fd_out: int) -> None:
    t0 = time.perf_counter_ns()
    status = 0
    try:
        fn, kwargs = pickle.loads(payload)
        body = pickle.dumps(fn(**kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except (ValueError, TypeError) as e:
        status, body = 1, str(e).encode()
    except Exception as e:  # noqa: BLE001 - reported to the parent; the child keeps serving
        status, body = 2, f"{type(e).__name__}: {e}".encode()
    _write_all(fd_out, _REP.pack(status, len(body), time.perf_counter_ns() - t0, 0.0) + body)


class PartitionHandle:
    """A submitted partition; :meth:`wait` returns its parts (once ready)."""

    def __init__(self, worker: PartitionWorker, num_parts: int, n: int) -> None:
        self._worker = worker
        self.num_parts = num_parts
        self.n = n
        self._reply: tuple[int, bytes] | None = None
        self.seconds = 0.0
        """Time the child spent partitioning (set once the reply was read)."""
        self.lower_bound = 0.0
        """``lower_bound(workloads, num_parts)``, computed by the child."""

    def done(self) -> bool:
        """Whether the reply was already read (never blocks)."""
        return self._reply is not None

    def ready(self) -> bool:
        """Whether :meth:`wait` would return without blocking (never blocks)."""
        return self._reply is not None or self._worker._readable()

    def wait(self) -> list[list[int]]:
        """Block until the child answered; same result and errors as ``balanced_partition``."""
        out: list[list[int]] = self.wait_rows().tolist()
        return out

    def wait_rows(self) -> np.ndarray:
        """:meth:`wait` as a read-only int64 array ``[num_parts, n / num_parts]``,
        without building Python lists (the shuffler's phase 2 reads it)."""
        self._worker._collect(self)
        assert self._reply is not None, "collect fills the reply"
        status, body = self._reply
        if status:
            raise ValueError(body.decode())
        return np.frombuffer(body, "<i8").reshape(self.num_parts, self.n // self.num_parts)

    def wait_call(self) -> Any:
        """The result of a :meth:`PartitionWorker.submit_call` request; its
        ``ValueError``/``TypeError`` re-raised as ``ValueError``, anything else
        as ``RuntimeError``."""
        self._worker._collect(self)
        assert self._reply is not None, "collect fills the reply"
        status, body = self._reply
        if status == 1:
            raise ValueError(body.decode())
        if status:
            raise RuntimeError(f"the planner process failed: {body.decode()}")
        return pickle.loads(body)


class PartitionWorker:
    """``balanced_partition`` (optionally with ``localize``) in a child process.

    Two ways to use it::

        worker = PartitionWorker()
        parts = worker(workloads, num_parts)        # blocking, from any thread
        handle = worker.submit(workloads, num_parts, home, sizes)  # main thread...
        ...                                         # ... launches GPU work meanwhile
        parts = handle.wait()                       # no thread, no GIL hand-off
        worker.close()

    With ``home`` the child also runs ``localize``. Requests are answered in
    order by one child; it is killed when the worker is closed or
    garbage-collected, and exits within a second of its parent's death.
    """

    def __init__(self) -> None:
        # the directory of the balancer package, which the child stubs
        pkg_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, pkg_dir],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None, "pipes requested"
        self._fd_out = self._proc.stdin.fileno()
        self._fd_in = self._proc.stdout.fileno()
        # Non-blocking writes: a large request must not block while the child
        # is itself blocked writing an earlier reply nobody reads (_send).
        os.set_blocking(self._fd_out, False)
        self._lock = threading.Lock()
        self._pending: collections.deque[PartitionHandle] = collections.deque()
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._lock)

    def __call__(self, workloads: Any, num_parts: int, home: Any = None,
                 sizes: Any = None) -> list[list[int]]:
        """Partition in the child and wait; same arguments as ``balanced_partition``."""
        return self.submit(workloads, num_parts, home, sizes).wait()

    def submit(self, workloads: Any, num_parts: int, home: Any = None,
               sizes: Any = None, *, quantized: bool = False) -> PartitionHandle:
        """Send a request and return at once; :meth:`PartitionHandle.wait` collects it.

        ``quantized``: partition the scale-free integers of
        :func:`balancer._quantize.quantize` (as :func:`solve_rows`).

        Raises:
            TypeError, ValueError: as ``balanced_partition`` for the same
                input, here, before anything is sent.
            RuntimeError: the worker is closed.
        """
        # The same checks as in-process, before the request: a request the
        # child cannot parse (a home of the wrong length) would hang the pipe.
        arr = as_workloads(workloads, num_parts)
        code, arr = (0, arr.astype("<i8", copy=False)) if arr.dtype.kind == "i" else (1, arr.astype("<f8", copy=False))
        n, w = arr.size, int(num_parts)
        chunks = [_REQ.pack(n, w, code, int(home is not None) | (2 if quantized else 0)), arr.tobytes()]
        if home is not None:
            h, sz = check_home(home, sizes, n, w)
            chunks += [h.astype("<i8", copy=False).tobytes(), sz.astype("<f8", copy=False).tobytes()]
        handle = PartitionHandle(self, w, n)
        with self._lock:
            self._send(b"".join(chunks), handle)
        return handle

    def submit_call(self, fn: Callable[..., Any], /, **kwargs: Any) -> PartitionHandle:
        """Ask the child for ``fn(**kwargs)``; collect with :meth:`PartitionHandle.wait_call`.

        ``fn`` is pickled by reference: a module-level function of a module
        that imports no torch (e.g. :func:`balancer._step.plan_step`).
        """
        payload = pickle.dumps((fn, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        handle = PartitionHandle(self, 1, 0)
        with self._lock:
            self._send(_REQ.pack(len(payload), 0, _CALL, 0) + payload, handle)
        return handle

    def _send(self, data: bytes, handle: PartitionHandle) -> None:
        """Write a request (lock held), reading replies to earlier ones meanwhile.

        With requests pending, the child may be writing a reply larger than the
        pipe holds, waiting for us to read it; a blocking write of a large
        request would then wait for the child forever. So the write is
        non-blocking, and while the pipe is full, replies are read as they come.
        """
        if self._closed:
            raise RuntimeError("PartitionWorker is closed")
        view = memoryview(data)
        while view.nbytes:
            try:
                view = view[os.write(self._fd_out, view) :]
                continue
            except BlockingIOError:
                pass
            readable, _, _ = select.select([self._fd_in] if self._pending else [], [self._fd_out], [])
            if readable:
                self._read_reply()
        self._pending.append(handle)

    def _read_reply(self) -> None:
        """Read the next reply into the oldest pending handle (lock held)."""
        status, length, ns, bound = _REP.unpack(_read_exact(self._fd_in, _REP.size))
        done = self._pending.popleft()
        done.seconds, done.lower_bound = ns * 1e-9, bound
        done._reply = (status, _read_exact(self._fd_in, length))

    def _readable(self) -> bool:
        return bool(select.select([self._fd_in], [], [], 0)[0])

    def _collect(self, handle: PartitionHandle) -> None:
        with self._lock:
            while not handle.done():
                if self._closed:
                    raise RuntimeError("PartitionWorker is closed: its pending requests were dropped")
                try:
                    self._read_reply()
                except EOFError:
                    if self._closed:  # killed by close() while this thread read
                        raise RuntimeError("PartitionWorker is closed: its pending requests were dropped") from None
                    raise

    def alive(self) -> bool:
        """Whether the child process is still running."""
        return self._proc.poll() is None

    def close(self) -> None:
        """Stop the child process (idempotent); later calls raise ``RuntimeError``.

        Never waits for the lock: a thread blocked reading a reply (a wedged
        child) gets end-of-file once the child is killed, and raises."""
        self._closed = True
        self._finalizer()


def _stop(proc: subprocess.Popen[bytes], lock: threading.Lock) -> None:
    # Killed, not asked: closing its stdin is no signal while a forked process
    # (a DataLoader worker) holds a copy of the pipe, and a request it is
    # working on is no longer wanted. A pure-compute child loses nothing.
    proc.kill()
    proc.wait()
    # The pipes are closed here unless a thread is reading (it holds the lock and
    # gets end-of-file now): closed under it, the descriptor could be reused by
    # another file before that thread's next read. Otherwise the Popen object's
    # files close when it is collected.
    if lock.acquire(blocking=False):
        try:
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        finally:
            lock.release()
