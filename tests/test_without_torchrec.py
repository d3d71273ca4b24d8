"""The token path runs where TorchRec is not installed, and never loads it.

LLM/RL training loops hold token tensors, not KJTs; TorchRec (and its
fbgemm-gpu wheel, pinned to one torch release) is no dependency of theirs.
The script below runs in fresh processes where ``torchrec`` and
``fbgemm_gpu`` are absent (``sitecustomize`` blocks them, as if not
installed): on 2 gloo ranks, a token shuffle, bad input on one rank, an
exhausted rank, a ``BalancedLoader`` pass with uneven loaders and one whose
loader fails before its first batch (reported with a token carrier), the
global loss, dispatch and micro-batches, every sample accounted for; then
``from balancer import *`` leaves the TorchRec names out and
``balancer.BaseBatch`` fails with the install hint.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    W = 2

    def token_batch(rank, step, n=6):
        from balancer import TokenBatch
        g = torch.Generator().manual_seed(100 * rank + step)
        lens = torch.randint(1, 9, (n,), generator=g)
        if rank == 0:
            lens = lens + 24  # rank 0 draws the long sequences: the straggler to remove
        ids = torch.zeros(n, int(lens.max()), dtype=torch.int64)
        for i, k in enumerate(lens.tolist()):
            ids[i, :k] = 1000 * (100 * rank + step) + 10 * i + torch.arange(1, k + 1)
        return TokenBatch(batch_size=n, seq_lens=lens, tokens={"input_ids": ids},
                          samples={"uid": torch.arange(n) + 1000 * (100 * rank + step)})

    def rows(batch):  # every real sample as (uid, its tokens)
        out = []
        for i in range(batch.actual_batch_size):
            k = int(batch.seq_lens[i])
            out.append((int(batch.samples["uid"][i]), tuple(batch.tokens["input_ids"][i, :k].tolist())))
        return out

    def gathered(local):
        everyone = [None] * W
        dist.all_gather_object(everyone, local)
        return sorted(r for part in everyone for r in part)

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W)
        import balancer
        from balancer import BalancedLoader, BatchShuffler, TransformerCost, plan_dispatch, plan_micro_batches
        cost = TransformerCost(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4)

        with BatchShuffler(cost) as shuffler:  # phase 1 and phase 2 on token batches
            batch = token_batch(rank, 0)
            handle = shuffler.start_shuffle_async(batch)
            out = shuffler.finish_shuffle(batch, handle)
            assert gathered(rows(out)) == gathered(rows(batch)), "the shuffle lost or changed samples"
            stats = handle.stats
            assert stats.imbalance_after < stats.imbalance_before, (stats.imbalance_before, stats.imbalance_after)

        steps = 3 if rank == 0 else 2  # uneven loaders: rank 1 runs out first
        source = [token_batch(rank, s) for s in range(1, 1 + steps)]
        with BalancedLoader(source, cost) as loader:
            seen = [r for b in loader for r in rows(b)]
        assert gathered(seen) == gathered([r for b in source for r in rows(b)]), "the loader lost samples"

        def broken():  # rank 1's loader fails before its first batch: no layout to report with
            raise OSError("shard file not found")
            yield
        source = [token_batch(rank, 5)] if rank == 0 else broken()
        try:
            with BalancedLoader(source, cost) as loader:
                list(loader)
        except ValueError as e:  # every rank raises the failure, none hangs
            assert "the wrapped loader raised OSError at step 0: shard file not found" in str(e), e
        else:
            raise AssertionError("a rank's failing loader did not raise")

        with BatchShuffler(cost) as shuffler:  # bad input on one rank: the same error on every rank
            bad = token_batch(rank, 6) if rank == 0 else {"input_ids": None}
            try:
                shuffler.finish_shuffle(bad, shuffler.start_shuffle_async(bad))
            except ValueError as e:
                assert "batch is a dict, expected a BaseBatch or a TokenBatch (rank 1)" in str(e), e
            else:
                raise AssertionError("bad input did not raise")
        with BatchShuffler(cost) as shuffler:  # an exhausted rank takes part with padding
            live = token_batch(rank, 7)
            batch = live if rank == 0 else balancer.padding_like(live)
            handle = shuffler.start_shuffle_async(batch, exhausted=rank == 1)
            out = shuffler.finish_shuffle(batch, handle)
            assert gathered(rows(out)) == gathered(rows(batch)), "the exhausted rank's shuffle lost samples"
        ident = balancer.IdentityBatchShuffler(cost)
        batch = token_batch(rank, 8)
        assert ident.finish_shuffle(batch, ident.start_shuffle_async(batch)) is batch
        ident.close()
        loss = balancer.global_mean_loss(torch.ones(4), 4 - rank)  # 7 real samples of loss 1 in all
        assert abs(float(loss) - W * (4 - rank) / 7) < 1e-6, float(loss)  # DDP's mean of these is 1

        lens = [int(x) for x in token_batch(rank, 9).seq_lens]
        plan = plan_micro_batches(lens, max_tokens=64, cost=cost)
        assert sorted(i for mb in plan.micro_batches for i in mb) == list(range(len(lens)))
        dplan = plan_dispatch([4, 30, 2, 28, 5, 6], W, cost=cost)
        assert sorted(i for r in dplan.ranks for i in r) == list(range(6))

        namespace = {}
        exec("from balancer import *", namespace)  # the TorchRec names are left out, not raised
        assert "TokenBatch" in namespace and "BaseBatch" not in namespace
        loaded = [m for m, v in sys.modules.items() if v is not None]  # None: blocked, see SITECUSTOMIZE
        assert not [m for m in loaded if m.startswith(("torchrec", "fbgemm_gpu", "balancer.batch"))]
        try:
            balancer.BaseBatch
        except ImportError as e:
            assert "balancer.BaseBatch needs torchrec" in str(e) and "torchrec extra" in str(e), e
        else:
            raise AssertionError("BaseBatch imported without TorchRec")
        dist.destroy_process_group()
        print(f"rank {rank} ok", flush=True)

    if __name__ == "__main__":
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(worker, args=(port,), nprocs=W, start_method="spawn")
''')

# Loaded by every interpreter that starts with tmp_path on PYTHONPATH (the spawned
# ranks too). A None entry in sys.modules is what an absent package looks like to
# both ``import`` (ModuleNotFoundError) and ``importlib.util.find_spec`` (None).
SITECUSTOMIZE = 'import sys\nsys.modules.update(torchrec=None, fbgemm_gpu=None)\n'


def test_token_path_runs_without_torchrec(tmp_path: pathlib.Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = tmp_path / "token_path.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.split("\n")[:-1]) == ["rank 0 ok", "rank 1 ok"], proc.stdout + proc.stderr


def test_torchrec_is_an_extra_not_a_dependency() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith(("torchrec", "fbgemm"))]
    assert [d for d in project["optional-dependencies"]["torchrec"] if d.startswith("torchrec")]


def test_torchrec_names_still_import_from_the_package() -> None:
    pytest.importorskip("torchrec")
    import balancer
    from balancer.batch import BaseBatch, pad_batch, padding_like
    from balancer.pipeline import create_train_pipeline

    assert (balancer.BaseBatch, balancer.pad_batch, balancer.create_train_pipeline) == (
        BaseBatch, pad_batch, create_train_pipeline)
    assert balancer.padding_like is padding_like
    assert balancer.batch.pad_batch is pad_batch and balancer.pipeline.create_train_pipeline is create_train_pipeline
    assert {"BaseBatch", "create_train_pipeline"} <= set(balancer.__all__) <= set(dir(balancer))


def test_public_annotations_resolve_at_run_time() -> None:
    # Config tools (jsonargparse, pydantic) and runtime checkers resolve annotations:
    # none may name a class that is imported for type checkers only.
    import typing

    import balancer

    def user_fn(fn):  # noqa: ANN001 - annotated below, as a module without `from __future__` would
        return fn

    user_fn.__annotations__ = {"fn": balancer.WorkloadFn}
    typing.get_type_hints(user_fn)
    for fn in (balancer.TransformerCost.__call__, balancer.TokenCount.__call__,
               balancer.workloads.sequence_lengths, balancer.BatchShuffler.start_shuffle_async,
               balancer.BalancedLoader.__init__, balancer.padding_like):
        typing.get_type_hints(fn)
