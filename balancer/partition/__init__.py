"""Equal-count partitioning of per-sample workloads across data-parallel ranks.

Each step the shuffler has ``N = W * B`` workloads (``W`` ranks, ``B`` samples
per rank) and needs ``W`` parts of exactly ``B`` samples each with the largest
part sum as small as possible; then samples move between ranks.

Pipeline of :func:`balanced_partition` (``x`` = workloads; the steps live in
``_solve``):

1. sort ``x`` once (stable: an LSD radix sort of 16-bit digits from 4,096
   items on, tie-free keys ``x << log2 N | index`` below), and compute
   :func:`lower_bound` from the same prefix sums;
2. a greedy start with a cardinality cap. Up to N = 8192: LPT (largest
   item to the lightest part that still has room), with equal-size
   Karmarkar-Karp tried too when LPT misses the target (KK starts ~10x closer
   on smooth inputs). Larger inputs: the projected-load greedy
   (``_fill``: serve the part with the smallest ``load + free slots
   * mean remaining item``, so parts with many empty slots take the small
   items), dealt a row or more at a time -- within ~1e-4 of the bound at
   N = 262,144 in ~32-70 numpy steps, where LPT is up to 2.3e-3 above it;
3. swap refinement to ``lower_bound * (1 + rtol)`` under a work budget that
   depends on ``N`` and ``W`` only: parallel rounds (above N = 1,024) in which
   every part above the target trades one item with a light (or another
   heavy) part, single best swaps for the heaviest part, then (few parts)
   two-for-two swaps. No swap raises the max, so stopping early (budget,
   ``deadline_ms``) is safe;
4. optionally (``tokens``) a hard per-part cap on a second quantity
   (``_tokens``), and (``home``) :func:`localize`: choose which part
   each rank gets, and trade items so that samples stay on their home rank
   without raising the max.

Threads and the GIL: the shuffler runs this in a background thread while the
main thread launches GPU work. Numpy releases the GIL inside sorts, searches,
``argmin`` and element-wise calls on > 500 elements; a thread that wants it
back waits up to ``sys.getswitchinterval()`` (5 ms). With libtorch loaded the
main thread wins nearly every such hand-off, so when it is busy in pure Python
each of those calls costs the partition ~5 ms (2 ms becomes ~50 ms at
64x128); when it is busy with torch ops (which release the GIL at dispatch)
the partition runs at ~2x its standalone time and the main thread loses
~5-8 % of a 50 ms step. Pure Python would avoid the waits but hold the GIL
throughout. The way out is :class:`PartitionWorker`: the same partition in a
child process (numpy only); ``submit`` on the main thread and ``wait`` later
costs the main thread < 1 % and the partition ~1.3x its standalone time under
both kinds of main thread. Within this package the numpy work is kept to few,
large calls (one sort, ~25 calls per start step or refinement round). Numbers:
``docs/benchmarks_partition.md``.

All functions are deterministic: the same input gives the same output on every
rank and process (stable sorts or tie-free keys everywhere).

This package's modules, in the order a call goes through them (this file only
re-exports; no module of the package imports it, and none imports torch, so
the :class:`PartitionWorker` child can run them with numpy alone):

1. ``_validate`` -- input checks shared by every public function;
2. ``_bound`` -- :func:`lower_bound`, one bound for equal and free part sizes;
3. ``_balanced`` -- :func:`balanced_partition`, its array forms and the
   shuffler's call (``solve_rows``);
4. ``_solve`` -- the pipeline above, with its start heuristics ``_lpt``,
   ``_kk`` (also :func:`karmarkar_karp`) and ``_fill``, and the swap
   refinement ``_refine``;
5. ``_tokens`` -- the per-part token cap;
6. ``_locality`` -- :func:`localize`;
7. ``_free`` -- :func:`free_partition`, on ``_free_state`` (state and LPT)
   and ``_free_refine`` (moves and swaps);
8. ``_stats`` -- :class:`PartitionStats`, :func:`partition_stats`, :func:`imbalance`;
9. ``_worker`` -- :class:`PartitionWorker`, the partition (or any numpy-only
   function) in a child process.
"""

from balancer.partition._balanced import balanced_partition
from balancer.partition._bound import lower_bound
from balancer.partition._free import free_partition
from balancer.partition._kk import karmarkar_karp
from balancer.partition._locality import localize
from balancer.partition._stats import PartitionStats, imbalance, partition_stats
from balancer.partition._worker import PartitionHandle, PartitionWorker

__all__ = [
    "PartitionHandle",
    "PartitionStats",
    "PartitionWorker",
    "balanced_partition",
    "free_partition",
    "imbalance",
    "karmarkar_karp",
    "localize",
    "lower_bound",
    "partition_stats",
]
