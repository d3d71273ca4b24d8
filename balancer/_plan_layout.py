"""The wire layout as the planner sees it: :class:`PlanLayout` (numpy only).

:class:`balancer._layout.WireLayout` derives the layout from a batch's tensors
(torch); its :meth:`~balancer._layout.WireLayout.plan_layout` is this module's
view of it, which is all that planning needs and which imports no torch, so it
crosses into the torch-free planner process.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["KJTPlan", "PlanLayout", "SectionPlan", "sample_bytes"]


@dataclasses.dataclass(frozen=True)
class SectionPlan:
    """A wire section as the planner sees it (see :class:`balancer._layout.Section`)."""

    jagged: bool  # elements per sample follow the lengths (KJT values/weights, tokens); else dense
    row: int  # first row of its keys in the lengths matrix (-1 for dense)
    count: int  # keys (1 for dense)
    itemsize: int  # bytes per element
    width: int  # jagged: elements per length unit; dense: elements per sample
    stride: int = 0  # padded tokens: elements per sample slot (0 when L or the width is 0)
    padded: bool = False  # padded tokens (fixed per-sample slots); else back to back


@dataclasses.dataclass(frozen=True)
class KJTPlan:
    """A KJT field as the planner sees it: its rows of the lengths matrix."""

    row: int
    num_keys: int
    int32: bool  # lengths dtype int32 (else int64)


@dataclasses.dataclass(frozen=True)
class PlanLayout:
    """The numpy view of a :class:`balancer._layout.WireLayout`: what planning needs."""

    batch_size: int
    num_lengths: int
    sections: tuple[SectionPlan, ...]
    kjts: tuple[KJTPlan, ...]  # the fields whose output lengths are rebuilt (a TokenBatch: seq_lens)
    pad_multiple: int = 1  # padded token fields: output length rounded up to this


def sample_bytes(layout: PlanLayout, lengths: np.ndarray) -> np.ndarray:
    """[W * B] bytes each sample occupies in phase 2's payload (lengths [W, K, B])."""
    w, _, b = lengths.shape
    out = np.zeros((w, b), np.int64)
    for s in layout.sections:
        if s.jagged:
            out += lengths[:, s.row : s.row + s.count].sum(axis=1) * s.width * s.itemsize
        else:
            out += s.width * s.itemsize
    return out.reshape(-1)
