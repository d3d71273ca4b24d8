"""Phase 2 planned on the host and executed without a process group, for every rank in one process.

The collective is simulated from the planned splits: what rank r sends to d
lands where d planned to receive it. Each output is compared with an
independent reference built sample by sample from the inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from balancer._comm import assemble, pack, receive_buffer
from balancer._exchange import plan_exchange
from balancer._gather import host_tensors, upload
from balancer._layout import wire_layout
from balancer._plan import Gathered, plan_rank
from balancer._protocol import lengths_matrix
from balancer.batch import replace_unchecked
from tests.test_shuffler import _check_padding, make_batch, rows


def simulate(batches: list, dest: np.ndarray, comm: str, device: str = "cpu") -> list:
    """Every rank's phase 2 for destinations ``dest``, collective simulated."""
    w = len(batches)
    layout = wire_layout(batches[0])
    b = layout.batch_size
    lengths = np.stack([lengths_matrix(x, layout).numpy() for x in batches])
    real = np.array([x.actual_batch_size for x in batches])
    pad_len = np.array([x.max_len if getattr(x, "packed", True) is False else 0 for x in batches])
    g = Gathered(np.zeros(w * b), lengths, real, pad_len)
    plans = [plan_exchange(comm, layout.plan_layout(), g, plan_rank(dest, b, real, r)) for r in range(w)]
    dev = torch.device(device)
    blobs = [upload(host_tensors(p.blob, pin=dev.type == "cuda"), dev) for p in plans]
    layouts = [wire_layout(x) for x in batches]  # a padded token batch's L may differ by rank
    sends = [pack(x.to(dev), lay, p, bl) for x, lay, p, bl in zip(batches, layouts, plans, blobs, strict=True)]
    outs = []
    for r in range(w):
        buf = receive_buffer(plans[r], dev)
        if comm == "all2all":
            assert sends[r].numel() == sum(plans[r].send_splits)
            pos = 0
            for src in range(w):
                off = sum(plans[src].send_splits[:r])
                n = plans[src].send_splits[r]
                assert n == plans[r].recv_splits[src], (src, r)
                buf[pos : pos + n] = sends[src][off : off + n]
                pos += n
        else:
            width = plans[r].send_splits[0]
            for src in range(w):
                assert sends[src].numel() == width, (src, sends[src].numel(), width)
                buf[src * width : (src + 1) * width] = sends[src]
        outs.append(assemble(batches[r].to(dev), layouts[r], plans[r], blobs[r], buf, replace_unchecked).to(
            torch.device("cpu")))
    return outs


def expected(batches: list, dest: np.ndarray) -> list:
    b = batches[0].batch_size
    return [[rows(batches[g // b])[g % b] for g in np.flatnonzero(dest == r)
             if g % b < batches[g // b].actual_batch_size] for r in range(len(batches))]


@pytest.mark.parametrize("comm", ["all2all", "allgather"])
@pytest.mark.parametrize("w", [1, 2, 3])
def test_simulated_exchange_matches_reference(comm: str, w: int) -> None:
    rng = np.random.default_rng(7)
    for case in range(12):
        b = int(rng.choice([1, 3, 6]))
        reals = rng.integers(0, b + 1, size=w)
        if case % 4 == 0:
            reals[:] = b
        batches = [make_batch(r, b, int(reals[r]), seed=case, labels=["kjt", "dense", None][case % 3])
                   for r in range(w)]
        dest = rng.permutation(np.repeat(np.arange(w), b))
        outs = simulate(batches, dest, comm)
        for r, (out, want) in enumerate(zip(outs, expected(batches, dest), strict=True)):
            assert out.batch_size == b and out.actual_batch_size == len(want), (case, r)
            got = rows(out)
            assert got[: len(want)] == want, (case, r)
            _check_padding(got[len(want):])
            # Sizes travelled with the plan: length_per_key is known without a read.
            for kjt in out.kjt_fields().values():
                assert kjt.length_per_key() == kjt.lengths().view(len(kjt.keys()), b).sum(1).tolist()
