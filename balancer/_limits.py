"""The library's numeric limits, side by side: what each one bounds and why that value.

int64 holds values below ``2**63``. Every integer the library adds up is kept
a bit or two below that, so that the sums it forms cannot wrap around; float64
holds every integer below ``2**53`` exactly. Each limit is defined here once
and imported where it is checked.
"""

from __future__ import annotations

__all__ = ["DISPATCH_TOTAL", "LENGTHS_TOTAL", "MAX_COST", "MAX_LENGTH", "MAX_TIMEOUT_S", "MAX_TOTAL",
           "PACKED_KEY_LIMIT"]

MAX_COST = 2**62
"""Largest per-sample cost an estimator (:mod:`balancer.workloads`) returns.

Float costs are clamped to it before the int64 cast (a float64 -> int64 cast of
a value >= ``2**63`` is undefined). One bit below int64's range, so a consumer
may add two costs without overflowing. Public as ``balancer.workloads.MAX_COST``.
"""

MAX_TOTAL = 2**61
"""Largest total workload the partitioner accepts (``balanced_partition``,
``free_partition``, ``lower_bound``, ...; checked in float64).

Refinement adds and subtracts part loads (a swap's effect on two parts, a load
plus the gap to another); with every load below ``2**61`` such a doubled sum
stays below ``2**62`` and never overflows int64. The shuffler's quantized
workloads (:mod:`balancer._quantize`, at most ``2**26`` each) stay below it
for any N < ``2**35``; a single estimator cost may exceed it (``MAX_COST``),
which is why the shuffler quantizes.
"""

PACKED_KEY_LIMIT = 2**62
"""Bound on packed integer keys: a value and a tie-breaker in one int64
(``value << bits | index`` for one plain sort, ``load * W + part`` in LPT's
heap, ``row * span + key`` for one flat ``searchsorted`` over many rows).

Code packs only while the packed keys stay below this, and otherwise takes the
slower unpacked path with the same result; one bit of headroom below int64's
range leaves room for the offset a key gains when one more item is added.
"""

MAX_LENGTH = 2**31 - 1
"""Largest KJT length or ``seq_lens`` entry a shuffle carries.

Phase 1 sends every length as int32, two per int64 word of the message
(:mod:`balancer._protocol`); a larger length is reported as invalid input.
"""

LENGTHS_TOTAL = 2**53
"""The lengths (token counts) one call of the LLM planners (``plan_dispatch``,
``plan_micro_batches``, ``BufferedDispatcher.put``) receives sum below this.

The planners add lengths in float64 (token sums of groups and micro-batches,
checked against ``max_tokens``), which holds every integer below ``2**53``
exactly; a length of ``2**53 + 1`` would read as ``2**53`` and a total past it
could pass a budget it exceeds.
"""

MAX_TIMEOUT_S = 1e8
"""Largest ``timeout`` (seconds, ~3 years) a shuffler or loader accepts.

Timeouts become ``datetime.timedelta`` (at most ~8.6e13 s) for the process
groups and, plus a margin, thread waits (``threading.TIMEOUT_MAX``, ~9.2e9 s
on Linux); a larger value would pass the check and fail later with an
``OverflowError`` at the first shuffle.
"""

DISPATCH_TOTAL = 2.0**50
"""``plan_dispatch`` partitions integer costs unchanged while their total is
below this; otherwise (and for float costs) it partitions float64 costs scaled
to a total of at most this. Far below ``MAX_TOTAL``, so FLOP counts of any size
are accepted; below ``2**53``, so integer costs under it also add up exactly
in float64 (the statistics).
"""
