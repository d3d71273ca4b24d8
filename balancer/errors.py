"""Errors a shuffle raises beyond ``ValueError`` (bad input) and ``RuntimeError`` (misuse)."""

from __future__ import annotations

__all__ = ["ShuffleAbortedError"]


class ShuffleAbortedError(RuntimeError):
    """A shuffle gave up because peers did not take part in time (stalled or dead).

    Raised on every rank that was waiting, within the shuffler's ``timeout``
    (plus a grace period of at most 5 s to find out who is missing). The
    shuffler that raised it is closed: its collectives are out of step with the
    group, so every later call raises ``RuntimeError``.

    Attributes:
        seq: the shuffle's sequence number on its shuffler.
        phase: ``"phase 1"`` (metadata all-gather, background thread) or
            ``"phase 2"`` (the redistribution).
        missing: ranks (within the shuffle's group) that did not arrive, ``[]``
            on a rank that came late itself (every other rank got there first and
            gave up), or ``None`` when they could not be determined.
    """

    def __init__(self, message: str, *, seq: int, phase: str, missing: list[int] | None) -> None:
        super().__init__(message)
        self.seq = seq
        self.phase = phase
        self.missing = missing
