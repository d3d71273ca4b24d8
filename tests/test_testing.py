"""balancer.testing, the gloo harness: results come back per rank, failures and hangs surface."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from balancer.testing import WorkerError, run_workers, run_workers_outcomes


def _sum_ranks(rank: int, world_size: int) -> int:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def _fail_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("bad input on rank 1")
    return rank


def _hang_on_rank0(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(60)  # keeps its connections open, so rank 0 truly hangs


def test_results_per_rank() -> None:
    assert run_workers(_sum_ranks, 3) == [6, 6, 6]


def test_failures_are_reported_per_rank() -> None:
    outs = run_workers_outcomes(_fail_on_rank1, 2)
    assert outs[0] == 0
    assert isinstance(outs[1], WorkerError) and outs[1].message == "bad input on rank 1"
    with pytest.raises(AssertionError, match="1 rank\\(s\\) failed"):
        run_workers(_fail_on_rank1, 2)


def _unpicklable(rank: int, world_size: int) -> object:
    return lambda: rank


def test_unpicklable_result_is_an_error() -> None:
    outs = run_workers_outcomes(_unpicklable, 2, timeout=60)
    assert all(isinstance(o, WorkerError) and "not picklable" in o.message for o in outs), outs


def test_hang_becomes_timeout() -> None:
    # (6 s: on a box loaded with 4 busy processes per core a rank was still starting after 3 s,
    # before it could dump its stack)
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 6s") as e:
        run_workers_outcomes(_hang_on_rank0, 2, timeout=6)
    # Where each rank waits: its stack, dumped on the timeout.
    msg = str(e.value)
    rank0, rank1 = msg.split("--- rank 0 stacks:")[1].split("--- rank 1 stacks:")
    assert "_hang_on_rank0" in rank0 and "barrier" in rank0, msg
    assert "_hang_on_rank0" in rank1 and "barrier" not in rank1, msg


def _exit_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)  # dies without a result, as a worker that fails to unpickle its function
    dist.barrier()  # rank 0 waits for the dead peer
    return rank


def test_a_dead_rank_is_reported_at_once_not_at_the_timeout() -> None:
    t0 = time.monotonic()
    outs = run_workers_outcomes(_exit_on_rank1, 2, timeout=120)
    assert time.monotonic() - t0 < 60  # the dead rank is seen, not waited for until the timeout
    assert isinstance(outs[1], WorkerError) and outs[1].type_name == "WorkerDied", outs
    assert "exited with code 3 without a result" in outs[1].message, outs
    # Rank 0 fails on its own (its peer closed the connection) or is given up on with its stack.
    assert isinstance(outs[0], WorkerError), outs
    if outs[0].type_name == "WorkerAbandoned":
        assert "_exit_on_rank1" in outs[0].traceback, outs


def test_free_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    # From the ephemeral range (bind to port 0), a chosen rendezvous port could become the
    # local port of another process's outgoing connection before rank 0 bound it: with
    # two test processes (pytest -n 2) every gloo pair of the other one draws from there.
    import random
    import socket

    from balancer.testing import _FIRST_PORT, _ephemeral_low, free_port

    low = _ephemeral_low()
    if low is None or low <= _FIRST_PORT:
        pytest.skip(f"no ephemeral range below which to choose (its start: {low})")
    random.seed(0)  # a seeded global RNG (as tests do) must not make processes agree
    ports = [free_port() for _ in range(50)]
    assert all(_FIRST_PORT <= p < low for p in ports), ports
    assert len(set(ports)) > 40, ports  # drawn at random, not one port again and again
    random.seed(0)
    assert [free_port() for _ in range(5)] != ports[:5]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when returned


def test_a_taken_rendezvous_port_is_launched_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process took the port between free_port() and rank 0's bind (seen
    # beside a parallel run): rank 0 failed with EADDRINUSE and the other ranks
    # waited in the rendezvous until the timeout.
    import socket

    import balancer.testing as testing

    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports = [held.getsockname()[1]]
    real = testing.free_port
    monkeypatch.setattr(testing, "free_port", lambda: ports.pop() if ports else real())
    try:
        t0 = time.perf_counter()
        assert run_workers(_sum_ranks, 3, timeout=60) == [6, 6, 6]
        assert time.perf_counter() - t0 < 30 and not ports  # the taken port was tried first
        ports.append(held.getsockname()[1])
        monkeypatch.setattr(testing, "_PORT_TRIES", 1)
        with pytest.raises(RuntimeError, match=r"rendezvous port taken \(EADDRINUSE\) in 1 launches"):
            run_workers(_sum_ranks, 2, timeout=60)
    finally:
        held.close()


def _tensor_result(rank: int, w: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(4) + rank, "y": torch.full((2, 2), float(rank))}


def test_a_worker_may_return_tensors() -> None:
    # The queue's pickler shared their storage through a file descriptor that was
    # gone once the worker exited: ConnectionResetError or FileNotFoundError.
    outs = run_workers(_tensor_result, 2, timeout=60)
    for r, o in enumerate(outs):
        assert torch.equal(o["x"], torch.arange(4) + r) and torch.equal(o["y"], torch.full((2, 2), float(r)))


def _loader_with_workers(rank: int, w: int) -> list[int]:
    data = torch.utils.data.DataLoader(list(range(8)), batch_size=4, num_workers=1)
    return [int(b.sum()) for b in data]


def test_a_worker_may_start_processes_of_its_own() -> None:
    # Daemonic workers could not: "daemonic processes are not allowed to have children".
    assert run_workers(_loader_with_workers, 2, timeout=120) == [[6, 22]] * 2
