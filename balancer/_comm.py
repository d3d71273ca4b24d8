"""Every collective of a shuffle, the groups they run on, and phase 2's execution.

This is the only module of balancer that communicates. Per shuffle:

======  ==================  ====================  ======================================
phase   thread              group                 call
======  ==================  ====================  ======================================
1       background          ``meta`` (gloo, CPU)  one all-gather of the phase-1 message
                                                  (``group_size``: of the headers, then
                                                  point to point within the group)
2       calling             ``data`` or the DP    one ``all_to_all_single`` (or one
                            group                 all-gather) of one flat byte buffer
======  ==================  ====================  ======================================

Why two dedicated gloo groups. Gloo and NCCL match collectives by the order in
which each rank issues them on a group. The background thread issues phase 1
while the training loop issues its own collectives, so phase 1 needs a group
that no other thread uses: ``meta``. Phase 2 of a CPU batch runs on ``data``,
a second gloo group of the shuffler's own, so that its deadline is the
shuffler's (``timeout``) and a failure there cannot leave the caller's group
half way through a collective; phase 2 of a CUDA batch runs on the caller's
(NCCL) group, on the current stream. Both groups are created once, on the first
shuffle, with ``use_local_synchronization`` so that only the group's own ranks
take part, and live as long as the process group: destroying them would let a
later group reuse their names, and with them stale rendezvous keys in the
store, while a peer that closed its shuffler later still holds the old ones.

Sizes. Every size passed to a collective comes from the agreement of phase 1
(the message) or from the host plan built from phase 1's data
(:mod:`balancer._exchange`): no rank ever sizes a message from data its peers
have not seen, and nothing here reads a device tensor.

Deadlines. Both gloo groups time out after the shuffler's ``timeout``; gloo
then raises (it does not abort). :func:`missing_ranks` names who did not
arrive: each rank that gave up writes a key to the default store, waits a
short grace period, and reads which peers wrote theirs.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from balancer._exchange import Exchange
from balancer._gather import DeviceBlob, HostTensors, put_runs, take_runs, upload
from balancer._layout import OPAQUE, WireLayout, opaque, section_tensor

logger = logging.getLogger(__name__)

__all__ = [
    "ShuffleGroups", "all_gather_fixed", "all_gather_objects", "assemble", "create_groups", "execute",
    "gather_group", "gather_rows", "missing_ranks", "pack", "receive_buffer", "resolve_group", "take_part",
]


def resolve_group(pg: dist.ProcessGroup | None, who: str = "BatchShuffler") -> tuple[Any, int, int]:
    """``(group, world size, rank)``, resolved now: ``None`` is the default group
    (``dist.group.WORLD`` is ``None`` before ``init_process_group``, so it is
    never a default argument); ``(None, 1, 0)`` without torch.distributed.

    Raises:
        ValueError: this process is not a member of ``pg`` (before any collective).
    """
    if not dist.is_available() or not dist.is_initialized():
        return None, 1, 0
    group = pg if pg is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        # (torch keeps one placeholder for every group a process is not in: its ranks are not this group's)
        raise ValueError(f"{who}: this process (global rank {dist.get_rank()}) is not a member of the process "
                         "group passed; call it only on the group's members")
    return group, dist.get_world_size(group), rank


def new_gloo_group(ranks: list[int], timeout: datetime.timedelta) -> Any:
    """A gloo group over ``ranks`` (global), created by those ranks alone.

    Over the whole world every rank calls ``new_group`` and torch names the
    group by its count of such calls, which every rank advances alike. Over a
    subgroup only its members call it (``use_local_synchronization``), and
    torch names the group by the number of groups the calling process holds
    (pytorch/pytorch#173608): members that hold different numbers (a rank in
    one more group than another) pick different names and never meet.
    """
    local = len(ranks) < dist.get_world_size()
    return dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=local)


def held_groups() -> int | None:
    """How many process groups this process holds (torch's private registry; ``None`` if unknown)."""
    try:
        return len(dist.distributed_c10d._world.pg_names)
    except AttributeError:
        return None


def _all_gather_into(out: torch.Tensor, t: torch.Tensor, group: Any) -> None:
    # Looked up per call: torch >= 2.13 prefers all_gather_single, and tests
    # count collectives by wrapping the module's functions.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


def all_gather_fixed(t: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather a 1-D tensor whose size every rank knows in advance.

    Example (W=2): rank0 ``[1, 2]``, rank1 ``[3, 4]`` -> both ``[[1, 2], [3, 4]]``.

    Returns:
        [W, M] tensor, row r from rank r, on ``t``'s device.
    """
    w = dist.get_world_size(group)
    out = t.new_empty(w * t.numel())
    _all_gather_into(out, t.contiguous(), group)
    return out.view(w, t.numel())


# ------------------------------------------------------------------ groups
@dataclasses.dataclass(frozen=True)
class ShuffleGroups:
    """The groups of one shuffler on one data-parallel group.

    Attributes:
        user: the caller's group (phase 2 of device batches).
        meta: gloo group of the background thread (phase 1).
        data: gloo group for phase 2 of CPU batches.
        name: ``meta``'s name, the same on every rank (store keys).
        world_size, rank: within ``user``.
        timeout: seconds before a collective on ``meta``/``data`` gives up.
        ranks: the global rank of each rank of ``user``.
    """

    user: Any
    meta: Any
    data: Any
    name: str
    world_size: int
    rank: int
    timeout: float
    ranks: tuple[int, ...]

    @property
    def note(self) -> str:
        """What rank numbers in a message mean: '' over the whole world, else the global ranks."""
        return rank_note(list(self.ranks))

    def phase2_group(self, device: torch.device) -> Any:
        """``data`` for a CPU batch; the caller's group for a device batch,
        unless that group is gloo-only (then ``data``, which carries any device)."""
        if device.type == "cpu":
            return self.data
        backend = str(dist.get_backend(self.user)).lower()
        return self.user if "nccl" in backend or "xccl" in backend else self.data


def create_groups(pg: Any, timeout: float) -> ShuffleGroups:
    """Create the shuffler's two gloo groups over ``pg``'s ranks (every rank of
    ``pg`` calls this at the same point: the first shuffle)."""
    ranks = dist.get_process_group_ranks(pg)
    td = datetime.timedelta(seconds=timeout)
    meta = new_gloo_group(ranks, td)
    data = new_gloo_group(ranks, td)
    name = str(getattr(meta, "group_name", "")) or f"balancer-{'-'.join(map(str, ranks))}"
    return ShuffleGroups(pg, meta, data, name, dist.get_world_size(pg), dist.get_rank(pg), timeout, tuple(ranks))


def rank_note(ranks: list[int]) -> str:
    """'' where ``ranks`` (global, of a group) are the whole world, else a note that rank numbers
    are within that group, with its global ranks."""
    if not ranks or ranks == list(range(dist.get_world_size())):
        return ""
    return f" (rank numbers here are within the process group passed, whose global ranks are {ranks})"


# ------------------------------------------------------------------ phase 1
def gather_rows(msg: np.ndarray, groups: ShuffleGroups) -> np.ndarray:
    """All-gather this rank's int64 message over ``meta`` (background thread).

    Returns:
        [W, len(msg)] int64, row r from rank r.
    """
    t = torch.from_numpy(np.ascontiguousarray(msg, dtype=np.int64))
    return all_gather_fixed(t, groups.meta).numpy()


def gather_group(msg: np.ndarray, members: np.ndarray, groups: ShuffleGroups) -> np.ndarray:
    """Exchange this rank's int64 message with the other ``members`` of its
    group over ``meta``, point to point (background thread; ``group_size``).

    Every member calls it with the same ``members`` (formed from gathered
    data) and messages of one agreed size, so each send meets its receive.

    Example (members ``[0, 2]``): rank0 ``[1, 2]``, rank2 ``[5, 6]`` -> both
    ``[[1, 2], [5, 6]]``; ranks 1 and 3 exchange among themselves meanwhile.

    Returns:
        [G, len(msg)] int64, row i from rank ``members[i]``.
    """
    t = torch.from_numpy(np.ascontiguousarray(msg, dtype=np.int64))
    out = torch.empty((members.size, t.numel()), dtype=torch.int64)
    ops = []
    for i, r in enumerate(members.tolist()):
        if r == groups.rank:
            out[i] = t
            continue
        peer = dist.get_global_rank(groups.meta, r)
        ops += [dist.P2POp(dist.isend, t, peer, groups.meta), dist.P2POp(dist.irecv, out[i], peer, groups.meta)]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return out.numpy()


def all_gather_objects(obj: Any, groups: ShuffleGroups) -> list[Any]:
    """Every rank's picklable ``obj`` over ``meta`` (error path only)."""
    out: list[Any] = [None] * groups.world_size
    dist.all_gather_object(out, obj, group=groups.meta)
    return out


def missing_ranks(groups: ShuffleGroups, seq: int, phase: str, grace: float) -> list[int] | None:
    """Ranks (within the group) that did not report a failure of ``phase`` of shuffle ``seq``.

    Called by every rank whose collective failed: each writes its key, then
    waits up to ``grace`` seconds for the others'. A rank that is stalled or
    dead never writes; ``None`` if the store cannot be reached.
    """
    names = [str(r) for r in range(groups.world_size)]
    return _absent(f"balancer/{groups.name}/failed/{seq}/{phase}/", names[groups.rank], names, grace)


def missing_at_setup(ranks: list[int], attempt: str, grace: float) -> list[int] | None:
    """Ranks (within the group of global ``ranks``) that did not reach the setup ``attempt``
    (the same text on every rank: which shuffler, which shuffle) of a shuffler's groups, as
    :func:`missing_ranks` tells them."""
    return _absent(_setup_key("setup", ranks, attempt) + "/", str(dist.get_rank()), [str(r) for r in ranks], grace)


def setup_failures(ranks: list[int], attempt: str, report: bool = False) -> int | None:
    """How many ranks (of the group of global ``ranks``) reported that creating the groups of
    ``attempt`` failed, after adding this rank's report where ``report`` (``None`` if the
    store cannot be reached). One counter in the default store: one round trip."""
    key = _setup_key("setup-failed", ranks, attempt)
    try:
        return int(dist.distributed_c10d._get_default_store().add(key, 1 if report else 0))
    except Exception as e:  # noqa: BLE001 - diagnosis only: the setup goes on (or fails) as before
        logger.warning("balancer: could not read whether other ranks gave up the setup: %s", e)
        return None


def _setup_key(kind: str, ranks: list[int], attempt: str) -> str:
    """The default store's key of ``kind`` for the setup ``attempt`` over global ``ranks``."""
    return f"balancer/{kind}/{','.join(str(r) for r in ranks)}/{attempt}"


def _absent(prefix: str, mine: str, names: list[str], grace: float) -> list[int] | None:
    """Write ``prefix + mine`` to the default store, then wait up to ``grace`` seconds for
    ``prefix + name`` of every name; the indices of the names still absent (``None`` if the
    store cannot be reached)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(prefix + mine, "1")
        deadline = time.monotonic() + grace
        while True:
            present = [i for i, n in enumerate(names) if store.check([prefix + n])]
            if len(present) == len(names) or time.monotonic() > deadline:
                return sorted(set(range(len(names))) - set(present))
            time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 - diagnosis only; the caller still raises
        logger.warning("balancer: could not read which ranks are missing: %s", e)
        return None


# ------------------------------------------------------------------ phase 2
def pack(batch: Any, layout: WireLayout, ex: Exchange, blob: DeviceBlob) -> torch.Tensor:
    """The uint8 send buffer of ``ex`` (``sum(send_splits)`` bytes; ``allgather``: one row)."""
    dev = batch.device
    local = [opaque(section_tensor(batch, s)) for s in layout.sections]
    srcs = [t if g is None else take_runs(t, g, blob) for t, g in zip(local, ex.pack, strict=True)]
    as_bytes = [t.view(torch.uint8) for t in srcs]
    zeros = torch.zeros(max((n for j, _, n in ex.pieces if j < 0), default=0), dtype=torch.uint8, device=dev)
    pieces = [zeros[:n] if j < 0 else as_bytes[j][off : off + n] for j, off, n in ex.pieces]
    return torch.cat(pieces) if pieces else zeros[:0]


def receive_buffer(ex: Exchange, device: torch.device) -> torch.Tensor:
    """The receive buffer: ``recv_bytes`` for the collective, then a zero tail."""
    buf = torch.empty(ex.recv_bytes + ex.tail, dtype=torch.uint8, device=device)
    if ex.tail:
        buf[ex.recv_bytes :].zero_()
    return buf


def assemble(batch: Any, layout: WireLayout, ex: Exchange, blob: DeviceBlob, buf: torch.Tensor,
             replace: Any) -> Any:
    """The output batch from the filled receive buffer: one gather per section
    (and one scatter into padded token slots), KJTs built with their sizes
    known (no later access syncs either)."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    pads = dict(zip((t.name for t in layout.tokens), layout.token_pads, strict=True))
    for s, g, p in zip(layout.sections, ex.out, ex.puts, strict=True):
        flat = take_runs(buf.view(OPAQUE[s.itemsize]), g, blob)
        if p is not None:  # padded token slots: the runs into the field's pad value
            pad = pads.get(s.field, 0)
            init = None if pad == 0 else torch.full(
                (p.dst_numel,), pad, dtype=s.dtype, device=flat.device).view(OPAQUE[s.itemsize])
            flat = put_runs(flat, p, blob, init)
        out[(s.field, s.part)] = flat.view(s.dtype)
    b = ex.out_batch
    lengths = []
    for (idx, int32), dtype in zip(ex.out_lengths, _lengths_dtypes(layout), strict=True):
        t = (blob.i32 if int32 else blob.i64)[idx]
        lengths.append(t if t.dtype == dtype else t.to(dtype))
    fields: dict[str, Any] = {}
    if layout.is_tokens:
        # Packed: T_out tokens, from the plan (seq_lens play a one-key KJT's
        # lengths there); not -1, which a per-token width of 0 cannot resolve.
        lead = (b, ex.out_len) if any(s.padded for s in layout.sections if s.jagged) else (ex.length_per_key[0][0],)
        fields["tokens"] = {t.name: out[(t.name, "tokens")].view(*lead, *t.shape) for t in layout.tokens}
        fields["samples"] = {d.name: out[(d.name, "samples")].view(b, *d.shape) for d in layout.dense}
        fields["seq_lens"] = lengths[0]
        return replace(batch, **fields, batch_size=b, actual_batch_size=ex.num_out)
    # A BaseBatch: TorchRec is loaded (imported here so that token batches never need it).
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    for spec, kl, per_key in zip(layout.kjts, lengths, ex.length_per_key, strict=True):
        offsets = [0]
        for n in per_key:
            offsets.append(offsets[-1] + n)
        fields[spec.name] = KeyedJaggedTensor(
            keys=list(spec.keys), values=out[(spec.name, "values")], weights=out.get((spec.name, "weights")),
            lengths=kl, stride=b, length_per_key=list(per_key), offset_per_key=offsets)
    for d in layout.dense:
        fields[d.name] = out[(d.name, "dense")].view(b, *d.shape)
    return replace(batch, **fields, batch_size=b, actual_batch_size=ex.num_out)


def _lengths_dtypes(layout: WireLayout) -> list[torch.dtype]:
    if layout.is_tokens:
        assert layout.seq_lens_dtype is not None, "a token layout knows its seq_lens dtype"
        return [layout.seq_lens_dtype]
    return [k.lengths_dtype for k in layout.kjts]


def take_part(device: torch.device, world_size: int, group: Any) -> float:
    """Phase 2 of a rank that sends and receives nothing (``group_size``: its group
    moved nothing) while other groups exchange: the same ``all_to_all_single``,
    with empty buffers. Returns the seconds spent in the call."""
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    t0 = time.perf_counter()
    dist.all_to_all_single(empty, empty, [0] * world_size, [0] * world_size, group=group)
    return time.perf_counter() - t0


def execute(batch: Any, layout: WireLayout, ex: Exchange, host: HostTensors, group: Any,
            replace: Any) -> tuple[Any, float]:
    """Run phase 2: pack, one collective, assemble. Reads no device value.

    Args:
        batch: this rank's batch (the one phase 1 described).
        ex: this rank's plan; ``host`` its index arrays as host tensors.
        group: where the collective runs (:meth:`ShuffleGroups.phase2_group`).
        replace: ``(batch, **fields) -> batch`` building the output.

    Returns:
        The output batch and the seconds spent in the collective call.
    """
    blob = upload(host, batch.device)
    send = pack(batch, layout, ex, blob)
    buf = receive_buffer(ex, batch.device)
    t0 = time.perf_counter()
    if ex.comm == "all2all":
        dist.all_to_all_single(buf[: ex.recv_bytes], send, list(ex.recv_splits), list(ex.send_splits),
                               group=group)
    else:
        _all_gather_into(buf[: ex.recv_bytes], send, group)
    collective_s = time.perf_counter() - t0
    return assemble(batch, layout, ex, blob, buf, replace), collective_s
