"""Train a small HSTU ranking model with TorchRec, with and without balancing, and compare.

    torchrun --nproc_per_node=2 examples/train_hstu.py --enable-balanced-shuffler  # TorchRec pipeline
    torchrun --nproc_per_node=2 examples/train_hstu.py --balanced-loader           # plain training loop
    torchrun --nproc_per_node=2 examples/train_hstu.py                             # plain TorchRec only

* ``--enable-balanced-shuffler``: TorchRec's ``TrainPipelineSparseDist`` with
  balancer's shuffler inside (:func:`balancer.create_train_pipeline`), against
  the same pipeline without it.
* ``--balanced-loader``: a plain loop (``next(batches)``, ``.to(device)``,
  forward, backward, step -- no TorchRec pipeline) over
  :class:`balancer.BalancedLoader`, against the same loop over the raw batches.

Each balanced mode runs side by side with its unbalanced baseline: two copies
of the model from the same initial weights train on the same batches, step by
step, in alternating order (so noise on a shared machine hits both alike;
``--no-baseline`` skips the baseline). Rank 0 prints a line every
``--log-every`` steps of each mode, one ``summary:`` line per mode and, last,
the step-time speedup with the imbalance before/after. The imbalance is
max/mean of the per-rank cost (``--workload``) of the batches as drawn and as
trained; "measured compute" is max/mean of each rank's compute (CPU time of its
training thread, which leaves out the waits inside collectives). Where ranks share cores with each other or
with other work, the step time measures that contention as much as the
straggler; the slowest rank's compute is what one device per rank would see.
The defaults (Zipf history lengths up to 2048) make attention dominate the
step, as in production HSTU. ``--uneven-batches K --no-baseline`` gives rank r
K * r batches fewer: the balanced modes still run every rank for ``--steps``
steps (an exhausted rank takes part with batches of no real sample).

CPU + gloo by default; NCCL on ``cuda:LOCAL_RANK`` when CUDA is available (and
``--cpu`` is not given). Embedding tables (``--embedding-kernel``): ``fused``
(default; TorchRec's fused FBGEMM TBE kernels, items row-wise, actions
table-wise, SGD inside the backward); ``dense`` (TorchRec's dense, non-fused
kernel, data-parallel tables trained by the same SGD as the dense parameters;
CUDA only: FBGEMM's CPU dense lookup cannot return sequence embeddings);
``torch`` (tables not sharded: plain ``torch.nn.Embedding`` under DDP, no FBGEMM
kernel at all; with ``--balanced-loader``). ``dense`` and ``torch`` run on one
GPU without the fused TBE kernels. The library reads no environment variable:
flags map onto :class:`balancer.BalancerConfig` and the
:class:`balancer.BalancedLoader` arguments.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from hstu_model import HSTURanker  # noqa: E402
from synthetic_data import DISTRIBUTIONS, ITEM_FEATURE, HSTUBatch, SyntheticHSTUData  # noqa: E402
from torchrec.distributed import DistributedModelParallel  # noqa: E402
from torchrec.distributed.embedding import EmbeddingCollectionSharder  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints  # noqa: E402
from torchrec.distributed.types import ShardingEnv  # noqa: E402
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper  # noqa: E402

from balancer import (  # noqa: E402
    BalancedLoader,
    BalancerConfig,
    balanced_partition,
    create_train_pipeline,
    karmarkar_karp,
)
from balancer.loss import global_loss_value  # noqa: E402
from balancer.workloads import HSTUAttentionCost, TokenCount, WorkloadFn  # noqa: E402

MODES = {"pipeline": "TorchRec pipeline", "shuffler": "TorchRec pipeline + shuffler",
         "loop": "plain loop", "loader": "plain loop + BalancedLoader"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--enable-balanced-shuffler", action="store_true",
                   help="balance inside TorchRec's pipeline (compared with the plain pipeline)")
    p.add_argument("--balanced-loader", action="store_true",
                   help="balance in the data loader, plain training loop (compared with the plain loop)")
    p.add_argument("--no-baseline", action="store_true", help="run the balanced mode only")
    p.add_argument("--ahead", type=int, default=2, help="BalancedLoader: batches kept ready")
    p.add_argument("--comm", choices=["all2all", "allgather"], default="all2all")
    p.add_argument("--partition", choices=["balanced", "karmarkar_karp"], default="balanced")
    p.add_argument("--no-locality", action="store_true", help="do not prefer keeping samples in place")
    p.add_argument("--group-size", type=int, default=None,
                   help="balance within groups of this many ranks, re-formed every step (large jobs)")
    p.add_argument("--pipeline", choices=["sparse_dist", "prefetch"], default="sparse_dist")
    p.add_argument("--embedding-kernel", choices=["fused", "dense", "torch"], default="fused",
                   help="embedding tables: fused (TorchRec's fused kernel: FBGEMM TBE with SGD in the backward; "
                        "row/table-wise), dense (TorchRec's dense kernel, data-parallel, no fused TBE), torch "
                        "(not sharded: plain torch.nn.Embedding under DDP, no FBGEMM kernel)")
    p.add_argument("--workload", choices=["hstu", "tokens"], default="hstu",
                   help="per-sample cost: HSTU attention FLOPs or token count")
    p.add_argument("--steps", type=int, default=20, help="batches per rank (the last one is padded)")
    p.add_argument("--uneven-batches", type=int, default=0, metavar="K",
                   help="rank r draws K * r batches fewer (uneven shards; needs --no-baseline): the balanced "
                        "modes run every rank for the longest loader's --steps")
    # Long, heavy-tailed histories: attention dominates the step, as in production
    # HSTU, so the cost model's imbalance is the compute's (on CPU, short
    # histories are dominated by per-sample overhead, which balancing cannot change).
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="zipf", help="history length distribution")
    p.add_argument("--max-seqlen", type=int, default=2048)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5, help="print every N-th step of each mode")
    p.add_argument("--balancer-log-interval", type=int, default=0, help="BalancerConfig.log_interval")
    p.add_argument("--cpu", action="store_true", help="use CPU + gloo even if CUDA is available")
    args = p.parse_args(argv)
    if args.log_every < 1:
        p.error(f"--log-every {args.log_every}, expected an int >= 1")
    if args.uneven_batches < 0:
        p.error(f"--uneven-batches {args.uneven_batches}, expected an int >= 0")
    if args.uneven_batches and not (args.no_baseline and (args.enable_balanced_shuffler or args.balanced_loader)):
        p.error("--uneven-batches needs a balanced mode and --no-baseline: the baselines (TorchRec's pipeline, "
                "a plain loop) stop each rank at its own count and leave the longer ranks waiting")
    if args.enable_balanced_shuffler and args.balanced_loader:
        p.error("--enable-balanced-shuffler and --balanced-loader are two ways of balancing: pick one")
    if args.embedding_kernel == "dense" and (args.cpu or not torch.cuda.is_available()):
        # FBGEMM 1.8's CPU dense lookup pools sequence embeddings (PoolingMode.NONE
        # returns one row per sample), so an EmbeddingCollection cannot use it.
        p.error("--embedding-kernel dense needs CUDA (FBGEMM's CPU dense lookup cannot return sequence "
                "embeddings); on CPU use fused, or torch with --balanced-loader")
    if args.embedding_kernel == "torch" and not args.balanced_loader:
        p.error("--embedding-kernel torch shards nothing, so TorchRec's pipeline has nothing to pipeline: "
                "use it with --balanced-loader")
    return args


def modes_from_args(args: argparse.Namespace) -> list[str]:
    """Baseline first, then the balanced mode."""
    if args.balanced_loader:
        return ["loader"] if args.no_baseline else ["loop", "loader"]
    if args.enable_balanced_shuffler:
        return ["shuffler"] if args.no_baseline else ["pipeline", "shuffler"]
    return ["pipeline"]


def quiet_known_warnings() -> None:
    """Silence library messages that are known and harmless in this example (only here).

    * DMP passes DDP's ``broadcast_buffers``, deprecated in torch 2.13; the model has no buffers.
    * TorchRec's planner asks for ``TopologyFactory`` and warns about its storage
      estimate; the example's tables are tiny and fit anywhere.
    * fx prints an ``is_fx_tracing`` notice on every rank when the pipeline traces the model.
    * TorchRec 1.6's ``ShardingEnv`` calls torch's private ``_get_pg_default_device``, which
      torch 2.11 marks for deprecation and, on a gloo group of a CUDA build of torch (cpu and
      cuda registered), warns that it picks cpu (TorchRec 1.8 calls ``_get_object_coll_device``).
    """
    for text in ("`broadcast_buffers` is deprecated", "HeuristicalStorageReservation is known"):
        warnings.filterwarnings("ignore", message=text, category=FutureWarning)
    for text in ("`_get_pg_default_device` will be deprecated", "Multiple backends are registered"):
        warnings.filterwarnings("ignore", message=text, category=UserWarning, module="torchrec.distributed.types")
    for name, text in (("torchrec.distributed.planner.types", "The topology was constructed directly"),
                       ("torchrec.distributed.planner.storage_reservations", "There is a known issue"),
                       ("torch.fx._symbolic_trace", "is_fx_tracing will return true")):
        logging.getLogger(name).addFilter(lambda r, t=text: not r.getMessage().startswith(t))


def build_model(
    args: argparse.Namespace, device: torch.device, pg: dist.ProcessGroup
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """The DMP-sharded model and its optimizer: SGD for everything, fused into the
    embedding kernels' backward with ``--embedding-kernel fused``."""
    torch.manual_seed(args.seed)  # every mode starts from the same weights
    model = HSTURanker(
        num_items=10_000, num_actions=8, dim=args.dim, num_heads=args.num_heads,
        head_dim=16, linear_dim=16, num_layers=args.num_layers, max_seqlen=args.max_seqlen,
        device=torch.device("meta"),
    )
    kernel = args.embedding_kernel
    sharders: list[Any] = []
    plan = None
    if kernel != "torch":
        if kernel == "fused":  # items row-wise, actions table-wise; SGD inside the kernels' backward
            types, fused_params = {"item_table": "row_wise", "action_table": "table_wise"}, {
                "optimizer": EmbOptimType.EXACT_SGD, "learning_rate": args.lr}
        else:  # TorchRec 1.8 offers its dense kernel with data-parallel sharding only
            types, fused_params = {"item_table": "data_parallel", "action_table": "data_parallel"}, None
        constraints = {t: ParameterConstraints(sharding_types=[s], compute_kernels=[kernel]) for t, s in types.items()}
        sharders = [EmbeddingCollectionSharder(fused_params=fused_params)]
        world = dist.get_world_size(pg)
        topology = Topology(world_size=world, compute_device=device.type, local_world_size=world)
        plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
            model, sharders, pg
        )
    # "torch": no sharder, so the tables stay plain torch.nn.Embedding modules
    # under DDP with everything else (no FBGEMM kernel at all).
    dmp = DistributedModelParallel(
        module=model, env=ShardingEnv.from_process_group(pg), device=device, plan=plan, sharders=sharders
    )
    fused = set(dmp.fused_optimizer.params.keys())
    rest = {k: v for k, v in dmp.named_parameters() if k not in fused}
    dense_opt = KeyedOptimizerWrapper(rest, lambda ps: torch.optim.SGD(ps, lr=args.lr))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt])


def workload_fn_from_args(args: argparse.Namespace) -> WorkloadFn:
    if args.workload == "tokens":
        return TokenCount([ITEM_FEATURE])
    return HSTUAttentionCost(
        [ITEM_FEATURE], hidden_dim=args.dim, num_heads=args.num_heads, head_dim=16, linear_dim=16,
        num_layers=args.num_layers, include_contextual=False,
    )


class _LoadTracker:
    """This rank's cost of each batch as drawn (the unbalanced modes' imbalance)."""

    def __init__(self, data: SyntheticHSTUData, workload_fn: WorkloadFn) -> None:
        self._data, self._fn = data, workload_fn
        self.loads: list[float] = []

    def __iter__(self) -> Iterator[HSTUBatch]:
        for batch in self._data:
            self.loads.append(float(self._fn(batch).sum()))
            yield batch


class Runner:
    """One mode: its own model copy, optimizer, batches and log; :meth:`step` trains one batch."""

    def __init__(self, mode: str, args: argparse.Namespace, device: torch.device, pg: dist.ProcessGroup) -> None:
        self.mode, self.args, self.device, self.pg = mode, args, device, pg
        self.dmp, self.opt = build_model(args, device, pg)
        self.dmp.train()
        workload_fn = workload_fn_from_args(args)
        rank = dist.get_rank(pg)
        num_batches = args.steps - args.uneven_batches * rank
        if num_batches < 1:
            raise ValueError(f"--steps {args.steps} with --uneven-batches {args.uneven_batches} leaves rank {rank} "
                             f"{num_batches} batches, expected >= 1")
        data = SyntheticHSTUData(rank=rank, batch_size=args.batch_size, num_batches=num_batches,
                                 dist=args.dist, max_seqlen=args.max_seqlen, seed=args.seed)
        self.tracker = _LoadTracker(data, workload_fn)
        self.pipeline: Any = None
        self.loader: BalancedLoader[HSTUBatch] | None = None
        locality = not args.no_locality
        if mode in ("pipeline", "shuffler"):
            config = BalancerConfig(enable_balanced_shuffler=mode == "shuffler", comm=args.comm,
                                    partition=args.partition, locality=locality,
                                    log_interval=args.balancer_log_interval, pipeline=args.pipeline,
                                    group_size=args.group_size)
            self.pipeline = create_train_pipeline(self.dmp, self.opt, device, config, workload_fn=workload_fn,
                                                  pg=pg)
        if mode == "loader":
            partition = {"balanced": balanced_partition, "karmarkar_karp": karmarkar_karp}[args.partition]
            self.loader = BalancedLoader(data, workload_fn, group=pg, ahead=args.ahead,
                                         pin_memory=device.type == "cuda", comm=args.comm, partition=partition,
                                         locality=locality, log_interval=args.balancer_log_interval,
                                         group_size=args.group_size)
            self.batches: Iterator[HSTUBatch] = iter(self.loader)
        else:
            self.batches = iter(self.tracker)
        self.log: dict[str, list[float]] = {
            k: [] for k in ("loss", "step_s", "wait_s", "slowest_s", "measured", "before", "after")}

    def step(self) -> bool:
        """Train one batch; ``False`` (on every rank) when the batches ran out."""
        dist.barrier(self.pg)  # start together: step times measure this step only
        t0, c0 = time.perf_counter(), time.thread_time()
        wait = 0.0
        if self.pipeline is not None:
            try:
                loss = self.pipeline.progress(self.batches)[0]
            except StopIteration:
                return False
        else:
            try:
                batch = next(self.batches)
            except StopIteration:
                return False
            wait = time.perf_counter() - t0
            batch = batch.to(self.device, non_blocking=True)
            self.opt.zero_grad()
            loss, _ = self.dmp(batch)
            loss.backward()
            self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_s, compute_s = time.perf_counter() - t0, time.thread_time() - c0
        self._record(loss, step_s, wait, compute_s)
        return True

    def _record(self, loss: torch.Tensor, step_s: float, wait_s: float, compute_s: float) -> None:
        """Global values of the step just timed (collectives, outside the timed region)."""
        log, world = self.log, dist.get_world_size(self.pg)
        stats = self.loader.stats if self.loader is not None else (
            self.pipeline.last_step_stats if self.mode == "shuffler" else None)
        rank = dist.get_rank(self.pg)
        if stats is not None and not stats.group:
            before, after = stats.imbalance_before, stats.imbalance_after
        else:
            # Nothing moved (the batches as drawn), or --group-size (the stats
            # cover this rank's group): every rank's load, gathered here.
            if stats is None:
                mine = [self.tracker.loads[len(log["loss"])]] * 2
            else:
                i = stats.group.index(rank)
                mine = [stats.load_before[i], stats.load_after[i]]
            loads = torch.zeros(2, world, dtype=torch.float64, device=self.device)
            loads[:, rank] = torch.tensor(mine, dtype=torch.float64)
            dist.all_reduce(loads, group=self.pg)
            before, after = (float(x.max() / x.mean()) if float(x.mean()) > 0 else 1.0 for x in loads)
        # Per rank: compute (CPU time of the training thread, which leaves out
        # the waits inside collectives) and the wait for the batch.
        per_rank = torch.zeros(2, world, dtype=torch.float64, device=self.device)
        per_rank[:, rank] = torch.tensor([compute_s, wait_s], dtype=torch.float64)
        dist.all_reduce(per_rank, group=self.pg)
        compute, waits = per_rank.tolist()
        log["loss"].append(global_loss_value(loss, pg=self.pg))
        log["step_s"].append(step_s)
        log["wait_s"].append(max(waits))
        log["slowest_s"].append(max(compute))
        log["measured"].append(max(compute) / statistics.fmean(compute))
        log["before"].append(before)
        log["after"].append(after)

    def line(self) -> str:
        log, n = self.log, len(self.log["loss"])
        return (f"[{self.mode:8s}] step {n:4d}/{self.args.steps} loss {log['loss'][-1]:.4f} "
                f"step_ms {1e3 * log['step_s'][-1]:7.1f} slowest_rank_compute_ms {1e3 * log['slowest_s'][-1]:7.1f} "
                f"max/mean workload {log['before'][-1]:.3f} -> {log['after'][-1]:.3f} "
                f"(measured compute {log['measured'][-1]:.3f})")

    def summary(self) -> str:
        log = self.log
        timed = slice(1, None) if len(log["step_s"]) > 1 else slice(None)  # step 1 warms up
        step_ms = 1e3 * statistics.fmean(log["step_s"][timed])
        wait_ms = 1e3 * statistics.fmean(log["wait_s"][timed])
        # The pipeline draws its batches inside progress(): no separate loader wait.
        wait = "" if self.pipeline is not None else \
            f"loader_wait_ms={wait_ms:.2f} ({100 * wait_ms / step_ms:.2f} % of step) "
        return (f"summary: mode={self.mode} ({MODES[self.mode]}) steps={len(log['loss'])} "
                f"mean_step_ms={step_ms:.1f} "
                f"slowest_rank_compute_ms={1e3 * statistics.fmean(log['slowest_s'][timed]):.1f} {wait}"
                f"imbalance_before={statistics.fmean(log['before']):.3f} "
                f"imbalance_after={statistics.fmean(log['after']):.3f} final_loss={log['loss'][-1]:.4f}")

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        if self.loader is not None:
            self.loader.close()


def train(args: argparse.Namespace, modes: list[str], device: torch.device) -> dict[str, dict[str, list[float]]]:
    """Run ``modes`` side by side on the initialised default group; their logs by mode."""
    pg = dist.group.WORLD
    assert pg is not None, "init_process_group first"
    rank = dist.get_rank(pg)
    runners = [Runner(mode, args, device, pg) for mode in modes]
    if rank == 0:
        print(f"world={dist.get_world_size(pg)} device={device} embedding_kernel={args.embedding_kernel} "
              f"modes={', '.join(f'{m} ({MODES[m]})' for m in modes)}", flush=True)
    live = list(runners)
    step = 0
    while live:
        # Alternate which mode goes first, so machine noise hits both alike.
        for r in list(live[:: 1 if step % 2 == 0 else -1]):
            if not r.step():
                live.remove(r)
            elif rank == 0 and (len(r.log["loss"]) % args.log_every == 0):
                print(r.line(), flush=True)
        step += 1
    for r in runners:
        r.close()
    if rank == 0:
        for r in runners:
            print(r.summary(), flush=True)
    if rank == 0 and len(runners) == 2:
        base, bal = runners[0].log, runners[1].log
        timed = slice(1, None) if len(base["step_s"]) > 1 else slice(None)
        diff = max(abs(a - b) for a, b in zip(base["loss"], bal["loss"], strict=True))
        speed = statistics.fmean(base["step_s"][timed]) / statistics.fmean(bal["step_s"][timed])
        crit = statistics.fmean(base["slowest_s"][timed]) / statistics.fmean(bal["slowest_s"][timed])
        print(f"loss_max_abs_diff: {diff:.2e} (same batches, same initial weights)", flush=True)
        print(f"speedup: {speed:.3f}x step time, {crit:.3f}x slowest-rank compute ({modes[0]} / {modes[1]}); "
              f"imbalance {statistics.fmean(bal['before']):.3f} -> {statistics.fmean(bal['after']):.3f}",
              flush=True)
    return {r.mode: r.log for r in runners}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_known_warnings()
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # Above the shuffler's timeout (shuffle_timeout_s, 300 s) and its grace: a rank missing in
    # phase 1 is named by the shuffler before NCCL's watchdog ends the job (docs/gpu.md).
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    # The library installs no log handler: show balancer's INFO lines (the
    # --balancer-log-interval stats) and others' warnings.
    logging.basicConfig(level=logging.WARNING, format=f"[rank {dist.get_rank()}] %(name)s: %(message)s",
                        force=True)
    logging.getLogger("balancer").setLevel(logging.INFO)
    try:
        train(args, modes_from_args(args), device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
