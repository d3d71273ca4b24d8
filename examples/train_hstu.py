"""Train a small HSTU ranking model with TorchRec and the balanced pipeline.

    torchrun --nproc_per_node=2 examples/train_hstu.py --enable-balanced-shuffler
    torchrun --nproc_per_node=2 examples/train_hstu.py            # plain TorchRec

CPU + gloo by default; NCCL on ``cuda:LOCAL_RANK`` when CUDA is available (and
``--cpu`` is not given). Flags map onto :class:`balancer.BalancerConfig`; the
library itself reads no environment variable. Rank 0 prints one line every
``--log-every`` steps (global loss, step time, max/mean per-rank workload before
and after balancing) and a final ``summary:`` line.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from hstu_model import HSTURanker
from synthetic_data import DISTRIBUTIONS, ITEM_FEATURE, HSTUBatch, SyntheticHSTUData
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from balancer.config import BalancerConfig
from balancer.loss import global_loss_value
from balancer.pipeline import create_train_pipeline
from balancer.workloads import HSTUAttentionCost, TokenCount, WorkloadFn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--enable-balanced-shuffler", action="store_true", help="balance workloads across ranks")
    p.add_argument("--comm", choices=["all2all", "allgather"], default="all2all")
    p.add_argument("--partition", choices=["balanced", "karmarkar_karp"], default="balanced")
    p.add_argument("--no-locality", action="store_true", help="do not prefer keeping samples in place")
    p.add_argument("--pipeline", choices=["sparse_dist", "prefetch"], default="sparse_dist")
    p.add_argument("--workload", choices=["hstu", "tokens"], default="hstu",
                   help="per-sample cost: HSTU attention FLOPs or token count")
    p.add_argument("--steps", type=int, default=20, help="batches per rank (the last one is padded)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="lognormal", help="history length distribution")
    p.add_argument("--max-seqlen", type=int, default=256)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--balancer-log-interval", type=int, default=0, help="BalancerConfig.log_interval")
    p.add_argument("--cpu", action="store_true", help="use CPU + gloo even if CUDA is available")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> BalancerConfig:
    return BalancerConfig(
        enable_balanced_shuffler=args.enable_balanced_shuffler,
        comm=args.comm,
        partition=args.partition,
        locality=not args.no_locality,
        log_interval=args.balancer_log_interval,
        pipeline=args.pipeline,
    )


def build_model(
    args: argparse.Namespace, device: torch.device, pg: dist.ProcessGroup
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """The DMP-sharded model and its optimizer (fused SGD for tables, SGD for dense)."""
    torch.manual_seed(args.seed)
    model = HSTURanker(
        num_items=10_000, num_actions=8, dim=args.dim, num_heads=args.num_heads,
        head_dim=16, linear_dim=16, num_layers=args.num_layers, max_seqlen=args.max_seqlen,
        device=torch.device("meta"),
    )
    # Fused kernels (the optimizer runs inside backward): on CPU TorchRec 1.8
    # shards an EmbeddingCollection table_wise, column_wise or row_wise.
    constraints = {
        "item_table": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"]),
        "action_table": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]),
    }
    sharder = EmbeddingCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": args.lr}
    )
    world = dist.get_world_size(pg)
    topology = Topology(world_size=world, compute_device=device.type, local_world_size=world)
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
        model, [sharder], pg
    )
    dmp = DistributedModelParallel(
        module=model, env=ShardingEnv.from_process_group(pg), device=device, plan=plan, sharders=[sharder]
    )
    fused = set(dmp.fused_optimizer.params.keys())
    dense = {k: v for k, v in dmp.named_parameters() if k not in fused}
    dense_opt = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=args.lr))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt])


def workload_fn_from_args(args: argparse.Namespace) -> WorkloadFn:
    if args.workload == "tokens":
        return TokenCount([ITEM_FEATURE])
    return HSTUAttentionCost(
        [ITEM_FEATURE], hidden_dim=args.dim, num_heads=args.num_heads, head_dim=16, linear_dim=16,
        num_layers=args.num_layers, include_contextual=False,
    )


class _LoadTracker:
    """Per-rank workload of each batch as drawn, to report imbalance when the
    pipeline does not balance (its identity shuffler measures nothing)."""

    def __init__(self, data: SyntheticHSTUData, workload_fn: WorkloadFn) -> None:
        self._data, self._fn = data, workload_fn
        self.loads: list[int] = []

    def __iter__(self) -> Iterator[HSTUBatch]:
        for batch in self._data:
            self.loads.append(int(self._fn(batch).sum()))
            yield batch


def _max_over_mean(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    # The library installs no log handler: show balancer's INFO lines (the
    # workload_fn note, --balancer-log-interval stats) and others' warnings.
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(name)s: %(message)s", force=True)
    logging.getLogger("balancer").setLevel(logging.INFO)
    pg = dist.group.WORLD
    assert pg is not None, "initialised above"
    config = config_from_args(args)

    dmp, optimizer = build_model(args, device, pg)
    workload_fn = workload_fn_from_args(args)
    pipeline = create_train_pipeline(dmp, optimizer, device, config, workload_fn=workload_fn, pg=pg)
    data = SyntheticHSTUData(
        rank=rank, batch_size=args.batch_size, num_batches=args.steps, dist=args.dist,
        max_seqlen=args.max_seqlen, seed=args.seed,
    )
    tracker = _LoadTracker(data, workload_fn)
    it = iter(tracker)
    if rank == 0:
        print(f"world={world} device={device} {config}", flush=True)

    dmp.train()
    step_times, before, after, losses = [], [], [], []
    step = 0
    while True:
        t0 = time.perf_counter()
        try:
            output = pipeline.progress(it)
        except StopIteration:
            break
        if use_cuda:
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - t0)
        loss = global_loss_value(output[0], pg=pg)
        stats = pipeline.last_step_stats
        if config.enable_balanced_shuffler and stats is not None:
            b, a = stats.imbalance_before, stats.imbalance_after
        else:  # nothing moved: measure the imbalance of the batches as drawn
            local = torch.tensor([float(tracker.loads[step])], dtype=torch.float64, device=device)
            loads = torch.empty(world, dtype=torch.float64, device=device)
            dist.all_gather_into_tensor(loads, local, group=pg)
            b = a = _max_over_mean(loads.tolist())
        before.append(b)
        after.append(a)
        losses.append(loss)
        step += 1
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(
                f"step {step:4d}/{args.steps} loss {loss:.4f} step_ms {1e3 * step_times[-1]:7.1f} "
                f"max/mean workload {b:.3f} -> {a:.3f}",
                flush=True,
            )
    pipeline.close()
    # Skip the first step (fills the pipeline, traces the model) in the timing.
    timed = step_times[1:] or step_times
    if rank == 0:
        print(
            f"summary: steps={step} balanced={config.enable_balanced_shuffler} "
            f"mean_step_ms={1e3 * statistics.fmean(timed):.1f} "
            f"imbalance_before={statistics.fmean(before):.3f} "
            f"imbalance_after={statistics.fmean(after):.3f} "
            f"final_loss={losses[-1]:.4f}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
