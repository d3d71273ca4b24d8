"""Phase 1's agreement protocol: what each rank contributes, and how all ranks decide alike.

Every shuffle, every rank contributes one int64 message to an all-gather on the
shuffler's own CPU (gloo) group, issued by the shuffler's background thread::

    header [18]  magic, status, detail, seq, B, K_total, layout fp, config fp,
                 real samples, previous seq, previous plan digest, payload B,
                 payload K_total, bad value (float64 bits), padded length L of a
                 padded token batch (0 otherwise: ranks may pad differently),
                 the shuffle whose output this rank last timed and the seconds
                 its compute took (online calibration; -1 and 0 otherwise),
                 1 reserved
    payload      workloads float64 [B] (as bits), then lengths int32 [K_total, B]
                 (two per word)

The payload is sized from the (B, K_total, layout) every rank *agreed* on
earlier, never from local data: a gloo all-gather whose ranks pass different
sizes aborts a process. A rank whose batch does not fit the agreement sends a
zero payload and its header says why.

Three steps, three threads of control:

1. :func:`capture` (calling thread) -- host checks of shapes and dtypes, then
   the device part (workloads, device-detected status, lengths) built with
   torch ops only (one concatenation of workloads and lengths): no value is
   read, so nothing waits for the device. On CUDA it is copied to pinned memory
   without blocking, with an event.
2. :func:`message` (background thread) -- waits for the event, checks the
   values (negative or non-finite workloads, negative or huge lengths, values
   that do not match their lengths) and assembles the message.
3. :func:`decide` (background thread, pure) -- from the gathered headers, the
   same verdict on every rank: proceed, agree on a new size and gather again,
   or fail. Failures are described by :func:`describe_failure`, from every
   rank's :class:`Report` (one object all-gather, on the error path only), so
   the error names the field, each rank's value and the offending ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from balancer._header import (
    H_BATCH,
    H_CONFIG,
    H_DETAIL,
    H_KEYS,
    H_LAYOUT,
    H_MAGIC,
    H_MEAS_TIME,
    H_PAD_LEN,
    H_PAY_B,
    H_PAY_K,
    H_PREV_DIGEST,
    H_PREV_SEQ,
    H_REAL,
    H_SEQ,
    H_STATUS,
    H_VALUE,
    HEADER_LEN,
    MAGIC,
)
from balancer._layout import (
    WireLayout,
    layout_problems,
    lengths_tensors,
    section_tensor,
    wire_layout,
)
from balancer._limits import MAX_LENGTH

__all__ = [
    "H_BATCH", "H_CONFIG", "H_DETAIL", "H_KEYS", "H_LAYOUT", "H_MAGIC", "H_PAD_LEN", "H_PAY_B", "H_PAY_K",
    "H_PREV_DIGEST",
    "H_PREV_SEQ", "H_REAL", "H_SEQ", "H_STATUS", "H_VALUE", "HEADER_LEN", "MAGIC", "Agreement", "LocalMeta", "Report", "Status", "Verdict", "capture",
    "decide", "describe_failure", "message", "payload_words",
]

class Status:
    """Bits of a header's status word (0: the rank's input is valid)."""

    BAD_INPUT = 1  # host-detected: batch type, layout, workload_fn output
    NEGATIVE = 2  # a real sample's workload is < 0 (detail: its index)
    NONFINITE = 4  # a real sample's workload is NaN or infinite (detail: its index)
    BAD_REAL = 8  # actual_batch_size outside [0, batch_size]
    BAD_LENGTHS = 16  # a KJT length < 0 or >= 2**31, or values that do not match the lengths


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What every rank agreed on; the payload is sized from it."""

    batch_size: int
    num_lengths: int
    layout: int


def payload_words(a: Agreement | None) -> int:
    """int64 words of the payload under ``a`` (0 before any agreement)."""
    if a is None:
        return 0
    return a.batch_size + (a.num_lengths * a.batch_size + 1) // 2


@dataclasses.dataclass
class LocalMeta:
    """This rank's phase-1 contribution, captured on the calling thread.

    ``host`` holds ``[workloads (B, float64 bits), lengths (K_total * B)]`` as
    int64 words -- on the CPU the very tensor the calling thread built, on CUDA
    its pinned copy, complete once ``event`` has completed.
    """

    seq: int
    rank: int
    config: int
    batch_size: int = -1
    num_lengths: int = 0
    layout_fp: int = 0
    real: int = 0
    status: int = 0
    error: str = ""
    cause: BaseException | None = None
    layout: WireLayout | None = None
    numels: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    host: torch.Tensor | None = None
    event: Any = None
    pad_len: int = 0  # L of a padded TokenBatch
    measured: tuple[int, float] = (-1, 0.0)  # (shuffle, compute seconds) this rank last timed

    def agreement(self) -> Agreement:
        return Agreement(self.batch_size, self.num_lengths, self.layout_fp)


def _fail(meta: LocalMeta, status: int, text: str, cause: BaseException | None = None) -> LocalMeta:
    meta.status |= status
    meta.error = meta.error or text
    meta.cause = meta.cause or cause
    return meta


def lengths_matrix(batch: Any, layout: WireLayout) -> torch.Tensor:
    """[K_total, B] int64 lengths (every KJT key, or ``seq_lens``), stacked (device ops only)."""
    rows = [t.to(torch.int64) for t in lengths_tensors(batch, layout)]
    flat = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64, device=batch.seq_lens.device
                                                    if layout.is_tokens else batch.device)
    return flat.view(layout.num_lengths, layout.batch_size)


def capture(batch: Any, workload_fn: Callable[[Any], Any] | None, *, seq: int, rank: int,
            config: int, base_type: type[Any] | tuple[type[Any], ...]) -> LocalMeta:
    """This rank's contribution to shuffle ``seq``; never raises for bad input.

    Problems visible from shapes and dtypes (wrong type, layout, workload
    shape) go into the status here; the values are checked by :func:`message`
    in the background. Reads no tensor value: one concatenation of the
    workloads and every KJT's lengths (and on CUDA a non-blocking copy to
    pinned memory) is all the device work.
    """
    meta = LocalMeta(seq, rank, config)
    if not isinstance(batch, base_type):
        names = " or a ".join(t.__name__ for t in (base_type if isinstance(base_type, tuple) else (base_type,)))
        return _fail(meta, Status.BAD_INPUT, f"batch is a {type(batch).__name__}, expected a {names} (rank {rank})")
    layout = wire_layout(batch)
    meta.layout = layout
    meta.batch_size, meta.num_lengths, meta.layout_fp = layout.batch_size, layout.num_lengths, layout.fingerprint
    b = layout.batch_size
    meta.pad_len = batch.max_len if layout.is_tokens and not batch.packed else 0
    real = batch.actual_batch_size
    meta.real = int(real) if isinstance(real, int) else -1
    if not 0 <= meta.real <= b:
        return _fail(meta, Status.BAD_REAL, f"actual_batch_size={real!r}, expected 0 <= "
                     f"actual_batch_size <= batch_size={b} (rank {rank})")
    problems = layout_problems(batch, layout)
    if problems:
        return _fail(meta, Status.BAD_INPUT, "; ".join(problems) + f" (rank {rank})")
    for s in layout.sections:
        if s.jagged:
            meta.numels[(s.field, s.part)] = section_tensor(batch, s).numel()
    if workload_fn is None:
        w = torch.zeros(b, dtype=torch.float64, device=batch.device)
    else:
        try:
            w = torch.as_tensor(workload_fn(batch))
        except Exception as e:  # reported on every rank, re-raised here as the cause
            return _fail(meta, Status.BAD_INPUT, f"workload_fn raised {type(e).__name__}: {e} (rank {rank})", e)
        if w.dim() != 1 or w.numel() != b or w.is_complex() or w.dtype == torch.bool:
            return _fail(meta, Status.BAD_INPUT, f"workloads has shape {tuple(w.shape)} and dtype {w.dtype}, "
                         f"expected [batch_size={b}] of an integer or floating dtype (rank {rank})")
    parts = [w.to(device=batch.device, dtype=torch.float64, non_blocking=True).view(torch.int64)]
    parts += [t.to(torch.int64) for t in lengths_tensors(batch, layout)]
    part = torch.cat(parts)
    if part.device.type == "cuda":
        meta.host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
        meta.host.copy_(part, non_blocking=True)
        meta.event = torch.cuda.Event()
        meta.event.record(torch.cuda.current_stream(part.device))
    else:
        meta.host = part
    return meta


@dataclasses.dataclass(frozen=True)
class LocalData:
    """The host view of a :class:`LocalMeta` (background thread)."""

    workloads: np.ndarray  # [B] float64, 0 for padding and invalid entries
    lengths: np.ndarray  # [K_total, B] int64


def message(meta: LocalMeta, agreed: Agreement | None, prev: tuple[int, int]) -> tuple[np.ndarray, LocalData | None]:
    """The int64 message of ``meta`` under ``agreed`` (background thread).

    Waits for the device copy, checks the values, and returns the message and
    this rank's data (``None`` when unusable).

    Args:
        prev: ``(seq, plan digest)`` of this shuffler's previous shuffle, or ``(-1, 0)``.
    """
    data = None
    detail, bad_value = -1, 0
    if meta.host is not None:
        if meta.event is not None:
            meta.event.synchronize()
        words = meta.host.numpy()
        b, k = meta.batch_size, meta.num_lengths
        workloads = words[:b].view(np.float64).copy()
        workloads[meta.real :] = 0.0  # padding costs nothing, whatever workload_fn said
        lengths = words[b : b + k * b].reshape(k, b)
        detail, value = _workload_checks(meta, workloads)
        bad_value = int(np.array(value, np.float64).view(np.int64))
        _value_checks(meta, lengths, detail, value)
        data = LocalData(workloads, lengths)
    size = payload_words(agreed)
    msg = np.zeros(HEADER_LEN + size, np.int64)
    msg[:H_PAD_LEN + 2] = [MAGIC, meta.status, detail, meta.seq, meta.batch_size, meta.num_lengths,
                           meta.layout_fp, meta.config, meta.real, prev[0], prev[1],
                           agreed.batch_size if agreed else 0, agreed.num_lengths if agreed else 0, bad_value,
                           meta.pad_len, meta.measured[0]]
    msg[H_MEAS_TIME] = np.array(meta.measured[1], np.float64).view(np.int64)
    usable = data is not None and meta.status == 0 and agreed == meta.agreement()
    if usable:
        assert data is not None and agreed is not None, "usable implies both"
        b = agreed.batch_size
        msg[HEADER_LEN : HEADER_LEN + b] = data.workloads.view(np.int64)
        packed = np.zeros(2 * (size - b), np.int32)
        packed[: data.lengths.size] = data.lengths.reshape(-1)
        msg[HEADER_LEN + b :] = packed.view(np.int64)
    return msg, (data if meta.status == 0 else None)


def _workload_checks(meta: LocalMeta, workloads: np.ndarray) -> tuple[int, float]:
    """Status bits for negative / non-finite real workloads (cleared to 0);
    returns the first offending index and its value, or ``(-1, 0.0)``."""
    x = workloads[: meta.real]
    nonfinite = ~np.isfinite(x)
    negative = x < 0
    bad = nonfinite | negative
    if not bad.any():
        return -1, 0.0
    meta.status |= (Status.NEGATIVE if negative.any() else 0) | (Status.NONFINITE if nonfinite.any() else 0)
    first = int(np.argmax(bad))
    value = float(x[first])
    x[bad] = 0.0
    return first, value


def _value_checks(meta: LocalMeta, lengths: np.ndarray, detail: int, value: float) -> None:
    r = meta.rank
    if lengths.size and (lengths.min() < 0 or lengths.max() > MAX_LENGTH):
        meta.status |= Status.BAD_LENGTHS
    if meta.status & Status.NEGATIVE:
        _fail(meta, 0, f"workloads[{detail}] = {value!r}, expected >= 0 for real samples (rank {r})")
    if meta.status & Status.NONFINITE:
        _fail(meta, 0, f"workloads[{detail}] = {value!r}, expected a finite value (rank {r})")
    if meta.status & Status.BAD_LENGTHS:
        _fail(meta, 0, f"a {'seq_lens' if meta.layout is not None and meta.layout.is_tokens else 'KJT'} length "
              f"is negative or >= 2**31 (rank {r})")
    layout = meta.layout
    if layout is None or meta.status:
        return
    for s in layout.sections:
        if not s.jagged:
            continue
        name = f"{s.part}[{s.field!r}]" if s.part == "tokens" else f"{s.field}.{s.part}"
        got = meta.numels[(s.field, s.part)]
        if s.stride:  # padded tokens: every sample must fit its slot
            longest = int(lengths[s.row : s.row + s.count].max(initial=0))
            if longest * s.width > s.stride:
                _fail(meta, Status.BAD_LENGTHS, f"seq_lens has a sample of {longest} tokens, longer than "
                      f"the padded length {s.stride // max(s.width, 1)} of {name} (rank {r})")
            continue
        expected = int(lengths[s.row : s.row + s.count].sum()) * s.width
        if got != expected:
            what = "sum(seq_lens)" if s.part == "tokens" else "sum(lengths)"
            _fail(meta, Status.BAD_LENGTHS, f"{name} has {got} elements, expected {what} * "
                  f"{s.width} = {expected} (rank {r})")


# ------------------------------------------------------------------ verdict
@dataclasses.dataclass(frozen=True)
class Verdict:
    """What every rank does after a gather; identical on every rank.

    ``kind``: ``"ok"`` (payload valid under ``agreement``), ``"retry"`` (every
    rank moved to the same new ``agreement``: gather again), ``"error"``
    (``problems`` lists what failed; ``exchange`` says whether the ranks can
    swap :class:`Report` s to describe it).
    """

    kind: Literal["ok", "retry", "error"]
    agreement: Agreement | None = None
    problems: tuple[str, ...] = ()
    exchange: bool = True


def decide(headers: np.ndarray, agreed: Agreement | None) -> Verdict:
    """The verdict for gathered headers ``[W, HEADER_LEN]`` (row r from rank r).

    Example (W=2, nothing agreed yet, then agreed on B=4)::

        both send B=4, same layout, no payload     -> retry (agree on B=4)
        both send B=4, payload sized for B=4       -> ok
        rank 1 sends status NEGATIVE               -> error ["status"]
        rank 1 sends B=6                           -> error ["layout"]
    """
    w = headers.shape[0]
    if any(int(headers[r, H_MAGIC]) != MAGIC for r in range(w)):
        return Verdict("error", problems=("magic",), exchange=False)
    problems = []
    if any(int(headers[r, H_SEQ]) != int(headers[0, H_SEQ]) for r in range(w)):
        problems.append("seq")
    if any(int(headers[r, H_STATUS]) for r in range(w)):
        problems.append("status")
    if any(int(headers[r, H_CONFIG]) != int(headers[0, H_CONFIG]) for r in range(w)):
        problems.append("config")
    prev = headers[:, H_PREV_SEQ]
    if (prev >= 0).all() and (prev == prev[0]).all() and (headers[:, H_PREV_DIGEST] != headers[0, H_PREV_DIGEST]).any():
        problems.append("plan")
    schemas = {Agreement(int(h[H_BATCH]), int(h[H_KEYS]), int(h[H_LAYOUT])) for h in headers}
    if len(schemas) > 1:
        problems.append("layout")
    if problems:
        return Verdict("error", problems=tuple(problems))
    (schema,) = schemas
    sized = all(int(h[H_PAY_B]) == schema.batch_size and int(h[H_PAY_K]) == schema.num_lengths
                for h in headers)
    if schema == agreed and sized:
        return Verdict("ok", agreed)
    return Verdict("retry", schema)


@dataclasses.dataclass(frozen=True)
class Report:
    """What a rank tells its peers when a verdict is an error (picklable)."""

    rank: int
    seq: int
    error: str
    layout: dict[str, str]
    config: dict[str, str]


def _groups(values: Sequence[Any]) -> str:
    """``ranks [0, 2]: 'a'; rank 1: 'b'`` -- every rank's value, grouped."""
    order: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        order.setdefault(v, []).append(r)
    parts = [f"ranks {rs}: {v!r}" if len(rs) > 1 else f"rank {rs[0]}: {v!r}" for v, rs in order.items()]
    return "; ".join(parts)


def _odd(values: Sequence[Any]) -> list[int]:
    """Ranks whose value differs from the most common one (rank 0's on a tie)."""
    counts: dict[Any, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    common = max(counts, key=lambda v: (counts[v], v == values[0]))
    return [r for r, v in enumerate(values) if v != common]


def _field_diffs(dicts: Sequence[dict[str, str]]) -> tuple[list[str], list[int]]:
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    lines, offenders = [], set()
    for key in keys:
        values = [d.get(key, "absent") for d in dicts]
        if len(set(values)) > 1:
            lines.append(f"{key!r}: {_groups(values)}")
            offenders.update(_odd(values))
    return lines, sorted(offenders)


def describe_failure(verdict: Verdict, headers: np.ndarray, reports: list[Report] | None) -> tuple[str, list[int]]:
    """The error text of a failed verdict (the same on every rank) and the offending ranks."""
    w = headers.shape[0]
    if reports is None:  # a rank speaks another protocol: nothing more can be exchanged
        bad = [r for r in range(w) if int(headers[r, H_MAGIC]) != MAGIC]
        return (f"rank(s) {bad} sent an unrecognised shuffle header (a different balancer version, "
                "or shuffles issued in a different order)", bad)
    parts, offenders = [], set()
    if "seq" in verdict.problems:
        seqs = [int(h[H_SEQ]) for h in headers]
        odd = _odd(seqs)
        offenders.update(odd)
        parts.append(f"ranks are at different shuffles ({_groups(['#' + str(s) for s in seqs])}): rank(s) "
                     f"{odd} started more or fewer shuffles, e.g. skipped a finish_shuffle or used "
                     "another shuffler")
    if "status" in verdict.problems:
        bad = [r for r in range(w) if int(headers[r, H_STATUS])]
        offenders.update(bad)
        parts.append(f"invalid shuffle input on rank(s) {bad}: " + "; ".join(reports[r].error for r in bad))
    if "config" in verdict.problems:
        lines, odd = _field_diffs([rep.config for rep in reports])
        offenders.update(odd)
        parts.append(f"shuffler configuration differs between ranks (rank(s) {odd} differ): " + "; ".join(lines))
    if "layout" in verdict.problems:
        # A rank whose input is invalid already has its message; compare the rest.
        valid = [r for r in range(w) if not int(headers[r, H_STATUS])]
        lines, odd = _field_diffs([reports[r].layout for r in valid])
        odd = [valid[i] for i in odd]
        offenders.update(odd)
        if lines:
            parts.append(f"batch layout differs between ranks (rank(s) {odd} differ): " + "; ".join(lines))
    if "plan" in verdict.problems:
        digests = [int(h[H_PREV_DIGEST]) for h in headers]
        odd = _odd(digests)
        offenders.update(odd)
        parts.append(f"the partition of shuffle #{int(headers[0, H_PREV_SEQ])} differed on rank(s) {odd}: "
                     "the partition function is not deterministic across ranks")
    return "; ".join(parts), sorted(offenders)


def layout_description(meta: LocalMeta) -> dict[str, str]:
    return meta.layout.describe() if meta.layout is not None else {"batch class": "not a batch"}


__all__ += ["LocalData", "layout_description", "lengths_matrix", "wire_layout"]
