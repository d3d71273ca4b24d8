"""Phase 1's protocol: what each rank contributes to the metadata all-gather.

Every shuffle, every rank contributes one int64 message to an all-gather on the
shuffler's own CPU (gloo) group, issued by the shuffler's background thread::

    header [19]  magic, status, detail, seq, B, K_total, layout fp, config fp,
                 real samples, previous seq, previous plan digest, payload B,
                 payload K_total, bad value (float64 bits), padded length L of a
                 padded token batch (0 otherwise: ranks may pad differently),
                 the shuffle whose output this rank last timed and the seconds
                 its compute took (online calibration; -1 and 0 otherwise),
                 the lowest rank of the group that planned the previous
                 shuffle (``group_size``; -1: every rank planned it), and
                 whether this rank's data has run out (``exhausted``: 1, else 0)
    payload      workloads float64 [B] (as bits), then lengths int32 [K_total, B]
                 (two per word)

The payload is sized from the (B, K_total, layout) every rank *agreed* on
earlier, never from local data: a gloo all-gather whose ranks pass different
sizes aborts a process. A rank whose batch does not fit the agreement sends a
zero payload and its header says why.

Three steps, three threads of control (the first two here):

1. :func:`capture` (calling thread) -- host checks of shapes and dtypes, then
   the device part (workloads, device-detected status, lengths) built with
   torch ops only (one concatenation of workloads and lengths): no value is
   read, so nothing waits for the device. On CUDA it is copied to pinned memory
   without blocking, with an event.
2. :func:`message` (background thread) -- waits for the event, checks the
   values (negative or non-finite workloads, negative or huge lengths, values
   that do not match their lengths) and assembles the message.
3. :func:`balancer._agreement.decide` (background thread, pure) -- from the
   gathered headers, the same verdict on every rank: proceed, agree on a new
   size and gather again, or fail (:mod:`balancer._agreement`).

:func:`batch_mismatch` checks, in phase 2, that the batch given to
``finish_shuffle`` is the one :func:`capture` saw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

from balancer._agreement import Agreement, payload_words
from balancer._exchange import padded_length
from balancer._header import H_DONE, H_MEAS_TIME, H_PAD_LEN, H_PREV_GROUP, HEADER_LEN, MAGIC
from balancer._ints import as_count
from balancer._layout import (
    WireLayout,
    layout_problems,
    lengths_tensors,
    scalar_problems,
    section_name,
    section_tensor,
    wire_layout,
)
from balancer._limits import MAX_LENGTH

__all__ = [
    "NO_PREV", "LocalData", "LocalMeta", "NoBatch", "Status", "bad_input", "batch_mismatch", "capture",
    "exhausted_problem",
    "layout_description", "lengths_matrix", "message",
]

# ``message``'s ``prev`` before a shuffler's first plan: no shuffle, no digest, no planning group.
NO_PREV = (-1, 0, -1)


class Status:
    """Bits of a header's status word (0: the rank's input is valid)."""

    BAD_INPUT = 1  # host-detected: batch type, layout, workload_fn output
    NEGATIVE = 2  # a real sample's workload is < 0 (detail: its index)
    NONFINITE = 4  # a real sample's workload is NaN or infinite (detail: its index)
    BAD_REAL = 8  # actual_batch_size outside [0, batch_size]
    BAD_LENGTHS = 16  # a KJT length < 0 or >= 2**31, or values that do not match the lengths


@dataclasses.dataclass(frozen=True)
class NoBatch:
    """Stands in for a batch a rank cannot give (its loader yielded none to take the
    layout of, or raised): the shuffle fails on every rank, naming ``reason`` and the
    rank; on this rank chained from ``cause`` (or ``cause`` itself where it is no
    ``Exception``, see :func:`reraise`)."""

    reason: str
    cause: BaseException | None = None


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
    exhausted: bool = False  # this rank's data has run out: the batch is padding only

    def agreement(self) -> Agreement:
        return Agreement(self.batch_size, self.num_lengths, self.layout_fp)


def exhausted_problem(real: int, rank: int) -> str:
    """Why ``exhausted=True`` with ``real`` real samples is invalid input."""
    return (f"exhausted=True with actual_batch_size={real}: a rank whose data has run out shuffles a batch "
            f"of no real sample (padding_like) (rank {rank})")


def _fail(meta: LocalMeta, status: int, text: str, cause: BaseException | None = None) -> LocalMeta:
    meta.status |= status
    meta.error = meta.error or text
    meta.cause = meta.cause or cause
    return meta


def bad_input(meta: LocalMeta, text: str, cause: BaseException | None = None) -> LocalMeta:
    """Mark ``meta`` as bad input found after :func:`capture` (``text`` names the rank):
    every rank's ``finish_shuffle`` raises it, as for any problem ``capture`` finds."""
    return _fail(meta, Status.BAD_INPUT, text, cause)


def reraise(meta: LocalMeta, error: Exception) -> NoReturn:
    """Raise ``error`` (what every rank raises for a failed shuffle) on the rank whose
    capture failed with ``meta.cause``: chained from it, or the cause itself where it
    is no ``Exception`` (``KeyboardInterrupt``, ``SystemExit``, ``CancelledError``:
    the peers learnt of it through phase 1; here it must still interrupt or exit)."""
    cause = meta.cause
    if cause is not None and not isinstance(cause, Exception):
        raise cause
    raise error from cause


def stay_length(meta: LocalMeta) -> int:
    """The padded length a padded ``TokenBatch`` that stays put gets, as a moved one
    would: its longest real sample rounded up to ``pad_multiple`` (0 for any other
    batch). Background thread: reads the host copy of phase 1, complete by now."""
    layout = meta.layout
    if layout is None or meta.host is None or not any(s.jagged and s.padded for s in layout.sections):
        return 0
    b = meta.batch_size
    return padded_length(int(meta.host[b : b + b].numpy()[: max(meta.real, 0)].max(initial=0)), layout.pad_multiple)


def lengths_matrix(batch: Any, layout: WireLayout) -> torch.Tensor:
    """[K_total, B] int64 lengths (every KJT key, or ``seq_lens``), stacked (device ops only)."""
    rows = [t.to(torch.int64) for t in lengths_tensors(batch, layout)]
    flat = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64, device=batch.seq_lens.device
                                                    if layout.is_tokens else batch.device)
    return flat.view(layout.num_lengths, layout.batch_size)


def capture(batch: Any, workload_fn: Callable[[Any], Any] | None, *, seq: int, rank: int,
            config: int, base_type: type[Any] | tuple[type[Any], ...], exhausted: bool = False,
            expected: str | None = None) -> LocalMeta:
    """This rank's contribution to shuffle ``seq``; never raises for bad input.

    Problems visible from shapes and dtypes (wrong type, layout, workload
    shape) go into the status here; the values are checked by :func:`message`
    in the background. Reads no tensor value: one concatenation of the
    workloads and every KJT's lengths (and on CUDA a non-blocking copy to
    pinned memory) is all the device work. A batch that cannot even be read
    (a field set to ``None`` after construction, a nested tensor) is reported
    the same way: raising here would leave the peers in a collective this
    rank never joins.
    """
    try:
        return _capture(batch, workload_fn, LocalMeta(seq, rank, config, exhausted=exhausted), base_type, expected)
    except BaseException as e:  # noqa: BLE001 - reported on every rank, re-raised here (see reraise)
        return _fail(LocalMeta(seq, rank, config, exhausted=exhausted), Status.BAD_INPUT,
                     f"the batch could not be read: {type(e).__name__}: {e} (rank {rank})", e)


def _capture(batch: Any, workload_fn: Callable[[Any], Any] | None, meta: LocalMeta,
             base_type: type[Any] | tuple[type[Any], ...], expected: str | None = None) -> LocalMeta:
    rank = meta.rank
    if isinstance(batch, NoBatch):
        return _fail(meta, Status.BAD_INPUT, f"{batch.reason} (rank {rank})", batch.cause)
    if not isinstance(batch, base_type):
        return _fail(meta, Status.BAD_INPUT,
                     f"batch is a {type(batch).__name__}, expected a {expected or _names(base_type)} (rank {rank})")
    problems = scalar_problems(batch)
    if problems:
        return _fail(meta, Status.BAD_INPUT, "; ".join(problems) + f" (rank {rank})")
    layout = wire_layout(batch)
    meta.layout = layout
    meta.batch_size, meta.num_lengths, meta.layout_fp = layout.batch_size, layout.num_lengths, layout.fingerprint
    b = layout.batch_size
    meta.pad_len = batch.max_len if layout.is_tokens and not batch.packed else 0
    real = batch.actual_batch_size
    count = as_count(real)  # a numpy integer set after construction too
    meta.real = -1 if count is None else count
    if not 0 <= meta.real <= b:
        return _fail(meta, Status.BAD_REAL, f"actual_batch_size={real!r}, expected 0 <= "
                     f"actual_batch_size <= batch_size={b} (rank {rank})")
    if meta.exhausted and meta.real:
        return _fail(meta, Status.BAD_REAL, exhausted_problem(meta.real, rank))
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
        except BaseException as e:  # noqa: BLE001 - reported on every rank, re-raised here (see reraise)
            # Not only Exception: a KeyboardInterrupt in one rank's workload_fn
            # left its peers in phase 1 until the shuffler timeout.
            what = str(e) if getattr(e, "own_message", False) else f"workload_fn raised {type(e).__name__}: {e}"
            return _fail(meta, Status.BAD_INPUT, f"{what} (rank {rank})", e)
        if w.dim() != 1 or w.numel() != b or w.is_complex() or w.dtype == torch.bool:
            return _fail(meta, Status.BAD_INPUT, f"workloads has shape {tuple(w.shape)} and dtype {w.dtype}, "
                         f"expected [batch_size={b}] of an integer or floating dtype (rank {rank})")
        if w.layout != torch.strided or w.device.type == "meta":  # the copy below would raise on this rank only
            return _fail(meta, Status.BAD_INPUT, f"workloads is a {w.layout} tensor on {w.device}, expected a "
                         f"dense tensor with values (rank {rank})")
    if w.device.type not in ("cpu", "cuda"):
        w = w.cpu()  # another accelerator (MPS has no float64): a blocking copy
    elif w.device.type == "cuda" and batch.device.type == "cuda" and w.device != batch.device:
        w = w.to(batch.device, non_blocking=True)  # another GPU: one device to wait for
    w = w.to(torch.float64).view(torch.int64)
    lengths = [t.to(torch.int64) for t in lengths_tensors(batch, layout)]
    cuda = next((t.device for t in (w, *lengths) if t.device.type == "cuda"), None)
    if cuda is None:
        # The CPU (the very tensor), or another accelerator: a blocking copy, no event.
        meta.host = torch.cat([t if t.device.type == "cpu" else t.cpu() for t in (w, *lengths)])
        return meta
    # Costs and lengths go to one pinned host buffer, each from where it is: a device
    # part by a non_blocking copy that the background thread waits for (the event),
    # a host part by a plain copy. (Costs computed on the device for a host batch came
    # back by a non_blocking copy that nothing waited for, and were read before it
    # landed; host costs for a device batch went to the device and back.)
    meta.host = torch.empty(b + sum(t.numel() for t in lengths), dtype=torch.int64, pin_memory=True)
    meta.host[:b].copy_(w, non_blocking=True)
    if lengths:
        meta.host[b:].copy_(torch.cat(lengths), non_blocking=True)
    meta.event = torch.cuda.Event()
    meta.event.record(torch.cuda.current_stream(cuda))
    return meta


@dataclasses.dataclass(frozen=True)
class LocalData:
    """The host view of a :class:`LocalMeta` (background thread)."""

    workloads: np.ndarray  # [B] float64, 0 for padding and invalid entries
    lengths: np.ndarray  # [K_total, B] int64


def message(meta: LocalMeta, agreed: Agreement | None,
            prev: tuple[int, int, int]) -> tuple[np.ndarray, LocalData | None]:
    """The int64 message of ``meta`` under ``agreed`` (background thread).

    Waits for the device copy, checks the values, and returns the message and
    this rank's data (``None`` when unusable).

    Args:
        prev: ``(seq, plan digest, lowest rank of the group that planned
            it)`` of this shuffler's previous shuffle (the group -1: every
            rank planned it, no ``group_size``), or :data:`NO_PREV`.
    """
    data = None
    detail, bad_value = -1, 0
    if meta.host is not None:
        if meta.event is not None:
            with torch.cuda.device(meta.event.device):  # where it was recorded: this thread may be on another GPU
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
    msg[H_PREV_GROUP] = prev[2]
    msg[H_DONE] = int(meta.exhausted)
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
    # A bad length first: it is the cause where workload_fn turned it into a bad
    # workload (a negative seq_lens was reported as a negative workload). (Tested on
    # the lengths, not the status: a second message of the same shuffle, after a
    # retried agreement, finds the status bits of the first one's checks.)
    if lengths.size and (lengths.min() < 0 or lengths.max() > MAX_LENGTH):
        _fail(meta, Status.BAD_LENGTHS, f"{_bad_length(meta.layout, lengths)}, expected 0 <= length < 2**31 "
              f"(rank {r})")
    if meta.status & Status.NEGATIVE:
        _fail(meta, 0, f"workloads[{detail}] = {value!r}, expected >= 0 for real samples (rank {r})")
    if meta.status & Status.NONFINITE:
        _fail(meta, 0, f"workloads[{detail}] = {value!r}, expected a finite value (rank {r})")
    layout = meta.layout
    if layout is None or meta.status:
        return
    _padding_checks(meta, layout, lengths)
    if meta.status:
        return
    padded = next((s for s in layout.sections if s.jagged and s.padded), None)
    if padded is not None:  # padded tokens: every sample fits L (not the stride: a field's width may be 0)
        longest = int(lengths[padded.row : padded.row + padded.count].max(initial=0))
        if longest > meta.pad_len:
            _fail(meta, Status.BAD_LENGTHS, f"seq_lens has a sample of {longest} tokens, longer than "
                  f"the padded length {meta.pad_len} of {section_name(padded)} (rank {r})")
    for s in layout.sections:
        if not s.jagged or s.padded:
            continue
        got = meta.numels[(s.field, s.part)]
        expected = int(lengths[s.row : s.row + s.count].sum()) * s.width
        if got != expected:
            what = "sum(seq_lens)" if s.part == "tokens" else "sum(lengths)"
            times = f" * {s.width}" if s.width != 1 else ""
            _fail(meta, Status.BAD_LENGTHS, f"{section_name(s)} has {got} elements, expected {what}{times} = "
                  f"{expected} (rank {r})")


def _bad_length(layout: WireLayout | None, lengths: np.ndarray) -> str:
    """The first length out of range, named: its field, key and sample."""
    row, col = (int(i) for i in np.argwhere((lengths < 0) | (lengths > MAX_LENGTH))[0])  # [rows, B]
    value = int(lengths[row, col])
    if layout is not None and layout.is_tokens:
        return f"seq_lens[{col}] = {value}"
    for k in layout.kjts if layout is not None else ():
        if k.row <= row < k.row + len(k.keys):
            return f"{k.name}.lengths of key {k.keys[row - k.row]!r}, sample {col} = {value}"
    return f"a KJT length = {value}"


def _padding_checks(meta: LocalMeta, layout: WireLayout, lengths: np.ndarray) -> None:
    """Padding samples (from ``actual_batch_size`` on) hold no tokens: a length there would
    be kept where no sample moves and dropped where samples move (the shuffle writes padding
    anew), so the output would depend on the plan. Checked on the lengths phase 1 already
    holds on the host (``BaseBatch`` checks it at construction only on the CPU)."""
    tail = lengths[:, meta.real :]
    if not tail.any():
        return
    row, col = (int(i) for i in np.argwhere(tail)[0])
    sample, got = meta.real + col, int(tail[row, col])
    if layout.is_tokens:
        what, fix = f"seq_lens {got}", "TokenBatch.pad appends such samples"
    else:
        spec = next(k for k in layout.kjts if k.row <= row < k.row + len(k.keys))
        what = f"length {got} for key {spec.keys[row - spec.row]!r} of {spec.name}"
        fix = "pad_batch appends such samples"
    _fail(meta, Status.BAD_LENGTHS, f"padding sample {sample} (actual_batch_size={meta.real}) has {what}, "
          f"expected 0: samples from actual_batch_size on are padding and hold no data; {fix}, or "
          f"raise actual_batch_size to count it as real (rank {meta.rank})")


def layout_description(meta: LocalMeta) -> dict[str, str]:
    return meta.layout.describe() if meta.layout is not None else {"batch class": "not a batch"}


def _names(base_type: type[Any] | tuple[type[Any], ...]) -> str:
    return " or a ".join(t.__name__ for t in (base_type if isinstance(base_type, tuple) else (base_type,)))


def batch_mismatch(batch: Any, meta: LocalMeta | None, base_type: type[Any] | tuple[type[Any], ...],
                   expected: str | None = None) -> str:
    """Why ``batch`` cannot finish the shuffle ``meta`` started ("" if it can); shapes only.

    ``finish_shuffle`` checks it on this rank before using up the handle.
    """
    if meta is None or meta.layout is None or meta.status:
        return ""
    if not isinstance(batch, base_type):
        return f"batch is a {type(batch).__name__}, expected a {expected or _names(base_type)}"
    layout = wire_layout(batch)
    if layout.fingerprint != meta.layout_fp:
        return "batch has another layout (fields, keys, dtypes or per-sample shapes)"
    if batch.actual_batch_size != meta.real:
        return f"batch has actual_batch_size={batch.actual_batch_size}, the started one {meta.real}"
    problems = layout_problems(batch, layout)  # e.g. a dense field replaced by one of another size
    if problems:
        return "; ".join(problems)
    for s in layout.sections:
        if s.jagged:
            n = section_tensor(batch, s).numel()
            if n != meta.numels.get((s.field, s.part)):
                return f"{section_name(s)} has {n} elements, the started batch {meta.numels.get((s.field, s.part))}"
    return ""
