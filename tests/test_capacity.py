"""Token-budget mode: ranks receive different numbers of samples (``capacity``).

Every real sample still arrives exactly once; every output has ``batch_size ==
capacity``; balance is at least as good as with equal counts; and a loss
normalised by the global token count gives the same gradient whatever the
placement -- the same as one process computing the global mean.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from balancer import global_weighted_mean_loss
from balancer.shuffler import BatchShuffler
from balancer.testing import run_workers
from tests.test_shuffler import make_batch, rows, token_count
from tests.test_tokens import token_batch, token_rows


def _skewed(batch: Any) -> torch.Tensor:
    """Cost that lets a few samples dominate: squared token count."""
    return token_count(batch).double() ** 2


def _capacity_worker(rank: int, w: int) -> list[tuple[Any, ...]]:
    out = []
    for comm in ("all2all", "allgather"):
        equal, free = BatchShuffler(_skewed, comm=comm), BatchShuffler(_skewed, comm=comm, capacity=12)
        for case in range(5):
            batch = make_batch(rank, 8, [8, 5, 0, 8, 3][case] if rank == 1 else 8, seed=90 + case)
            h_eq, h_free = equal.start_shuffle_async(batch), free.start_shuffle_async(batch)
            got_eq, got = equal.finish_shuffle(batch, h_eq), free.finish_shuffle(batch, h_free)
            out.append(("kjt", comm, rows(batch)[: batch.actual_batch_size], rows(got)[: got.actual_batch_size],
                        got.batch_size, got.actual_batch_size, h_free.stats.max_after, h_eq.stats.max_after,
                        h_free.stats.lower_bound, h_free.stats.load_after[rank],
                        float(_skewed(got)[: got.actual_batch_size].sum())))
            assert rows(got)[got.actual_batch_size :] == rows(got_eq.__class__(**{  # padding only after the real ones
                **{f: getattr(got, f) for f in got.__dataclass_fields__}}))[got.actual_batch_size :]
        equal.close()
        free.close()
    s = BatchShuffler(lambda b: b.seq_lens.double() ** 2, capacity=10)
    for packed in (False, True):
        tb = token_batch(rank, 6, 6 - rank, seed=3, packed=packed)
        got = s.shuffle(tb)
        out.append(("tokens", packed, token_rows(tb), token_rows(got), got.batch_size, got.actual_batch_size))
    return out


def test_unequal_counts_conserve_samples_and_balance_better() -> None:
    w = 3
    per_rank = run_workers(_capacity_worker, w, timeout=300)
    uneven = False
    for i in range(len(per_rank[0])):
        kind = per_rank[0][i][0]
        before = Counter(x for r in per_rank for x in r[i][2])
        after = Counter(x for r in per_rank for x in r[i][3])
        assert before == after, (kind, i)
        sizes = [r[i][4] for r in per_rank]
        counts = [r[i][5] for r in per_rank]
        assert sizes == [12] * w if kind == "kjt" else sizes == [10] * w
        assert max(counts) <= sizes[0]
        uneven |= len(set(counts)) > 1
        if kind == "kjt":
            _, _, _, _, _, _, max_free, max_equal, bound, load_me, load_check = per_rank[0][i]
            assert max_free <= max_equal + 1e-9 and max_free >= bound - 1e-6 * max(bound, 1.0), per_rank[0][i]
            for r in per_rank:  # the stats' loads are those of the output batches
                assert r[i][9] == pytest.approx(r[i][10])
    assert uneven  # counts really differ between ranks


def test_capacity_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"capacity=0, expected None or an int >= batch_size"):
        BatchShuffler(token_count, capacity=0)
    with pytest.raises(ValueError, match=r"capacity=9 partitions with free_partition; partition='greedy'"):
        from tests.reference import greedy

        BatchShuffler(token_count, capacity=9, partition=greedy)
    # One process said "pad: batch_size=4, expected an int >= the batch's 6", from
    # inside TokenBatch.pad; with peers the shuffle names capacity.
    small = BatchShuffler(lambda b: b.seq_lens + 1, capacity=4)
    batch = token_batch(0, 6, 6, seed=1, packed=False)
    handle = small.start_shuffle_async(batch)
    with pytest.raises(ValueError, match=r"capacity=4, expected >= batch_size=6 \(every rank's real samples"):
        small.finish_shuffle(batch, handle)
    small.close()


# ---------------------------------------------------------------- loss exactness
def _token_loss(emb: torch.nn.Embedding, batch: Any) -> torch.Tensor:
    """Global token-mean squared error of a per-token scalar prediction."""
    ids = batch.tokens["input_ids"]
    valid = batch.attention_mask() if not batch.packed else torch.ones(ids.shape, dtype=torch.bool)
    pred = emb(ids % 64).squeeze(-1)
    per_token = (pred - (ids % 7).to(pred.dtype)) ** 2
    return global_weighted_mean_loss(per_token[valid], torch.ones_like(per_token[valid]))


def _loss_worker(rank: int, w: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    shufflers = {"none": None, "equal": BatchShuffler(lambda b: b.seq_lens.double() ** 2),
                 "capacity": BatchShuffler(lambda b: b.seq_lens.double() ** 2, capacity=9)}
    batch = token_batch(rank, 6, 6 - 2 * rank, seed=11, packed=False, max_len=12)
    for name, s in shufflers.items():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(64, 1)
        mine = batch if s is None else s.shuffle(batch)
        _token_loss(emb, mine).backward()
        grad = emb.weight.grad.clone()
        dist.all_reduce(grad)  # DDP's average over ranks
        out[name] = (grad / w).numpy()
        out[name + "_count"] = int(mine.actual_batch_size)
    # The reference: one process, every rank's batch, the plain global mean.
    torch.manual_seed(0)
    emb = torch.nn.Embedding(64, 1)
    total, count = torch.zeros(()), 0
    for r in range(w):
        b = token_batch(r, 6, 6 - 2 * r, seed=11, packed=False, max_len=12)
        ids = b.tokens["input_ids"][b.attention_mask()]
        total = total + ((emb(ids % 64).squeeze(-1) - (ids % 7).float()) ** 2).sum()
        count += ids.numel()
    (total / count).backward()
    out["reference"] = emb.weight.grad.numpy()
    return out


def test_global_token_mean_gradient_does_not_depend_on_placement() -> None:
    for out in run_workers(_loss_worker, 2, timeout=120):
        for name in ("none", "equal", "capacity"):
            np.testing.assert_allclose(out[name], out["reference"], rtol=1e-5, atol=1e-7, err_msg=name)
        assert out["capacity_count"] != out["equal_count"] or out["none_count"] != out["capacity_count"]
