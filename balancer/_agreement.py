"""Phase 1's agreement: the same verdict on every rank from the gathered headers (numpy only).

Every shuffle, every rank contributes one message (:mod:`balancer._protocol`
builds it) to an all-gather; the header's layout is :mod:`balancer._header`.
The payload is sized from the (B, K_total, layout) every rank *agreed* on
earlier, never from local data: a gloo all-gather whose ranks pass different
sizes aborts a process. This module holds that agreement and what the ranks
decide from the gathered headers:

* :class:`Agreement` and :func:`payload_words` -- what was agreed, and the
  payload size it implies;
* :func:`decide` (background thread, pure) -- the same verdict on every rank:
  proceed, agree on a new size and gather again, or fail;
* :func:`describe_failure` -- the error of a failed verdict, from every rank's
  :class:`Report` (one object all-gather, on the error path only), naming the
  field, each rank's value and the offending ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from balancer._header import (
    H_BATCH,
    H_CONFIG,
    H_KEYS,
    H_LAYOUT,
    H_MAGIC,
    H_PAY_B,
    H_PAY_K,
    H_PREV_DIGEST,
    H_PREV_GROUP,
    H_PREV_SEQ,
    H_SEQ,
    H_STATUS,
    MAGIC,
)

__all__ = ["Agreement", "Report", "Verdict", "decide", "describe_failure", "payload_words"]


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What every rank agreed on; the payload is sized from it."""

    batch_size: int
    num_lengths: int
    layout: int


def payload_words(a: Agreement | None) -> int:
    """int64 words of the payload under ``a`` (1 before any agreement).

    Before an agreement a message is its header and one spare word: as long as
    the first gather of ``group_size`` (every rank's header and load), so that
    ranks whose ``group_size`` differs (one grouped, one not) meet in
    collectives of one size and learn of it from the configuration
    fingerprint. With no spare word gloo aborted the process on the size
    mismatch (``op.preamble.length <= op.nbytes``).
    """
    if a is None:
        return 1
    return a.batch_size + (a.num_lengths * a.batch_size + 1) // 2


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
    if (prev >= 0).all() and (prev == prev[0]).all() and _plan_odd(headers):
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


def _plan_odd(headers: np.ndarray) -> list[int]:
    """Ranks whose previous plan digest differs from their planning group's
    (one group of all ranks without ``group_size``); [] when all agree."""
    groups: dict[int, list[int]] = {}
    for r, g in enumerate(headers[:, H_PREV_GROUP].tolist()):
        groups.setdefault(int(g), []).append(r)
    for ranks in groups.values():
        digests = [int(headers[r, H_PREV_DIGEST]) for r in ranks]
        if len(set(digests)) > 1:
            return [ranks[i] for i in _odd(digests)]
    return []


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
            if any(line.startswith("'batch_size'") for line in lines):
                parts.append("every rank's batch must have one batch_size (pad_batch or TokenBatch.pad pads a short one; "
                             "BalancedLoader(batch_size=...) pads each rank's batches to it)")
    if "plan" in verdict.problems:
        odd = _plan_odd(headers)
        offenders.update(odd)
        parts.append(f"the partition of shuffle #{int(headers[0, H_PREV_SEQ])} differed on rank(s) {odd}: "
                     "the partition function is not deterministic across ranks")
    return "; ".join(parts), sorted(offenders)
