"""Phase 1's protocol and agreement, pure: capture and message round trips, verdicts, failure texts."""

from __future__ import annotations

import numpy as np
import torch

from balancer._agreement import Agreement, Report, decide, describe_failure, payload_words
from balancer._header import (
    H_BATCH,
    H_CONFIG,
    H_KEYS,
    H_LAYOUT,
    H_MAGIC,
    H_PAY_B,
    H_PAY_K,
    H_PREV_DIGEST,
    H_PREV_SEQ,
    H_SEQ,
    H_STATUS,
    HEADER_LEN,
    MAGIC,
)
from balancer._protocol import NO_PREV, Status, capture, message
from balancer.batch import BaseBatch
from tests.test_shuffler import make_batch, token_count


def _headers(w: int, a: Agreement, sized: bool = True) -> np.ndarray:
    h = np.zeros((w, HEADER_LEN), np.int64)
    h[:, H_MAGIC] = MAGIC
    h[:, H_BATCH], h[:, H_KEYS], h[:, H_LAYOUT] = a.batch_size, a.num_lengths, a.layout
    if sized:
        h[:, H_PAY_B], h[:, H_PAY_K] = a.batch_size, a.num_lengths
    h[:, H_PREV_SEQ] = -1
    return h


def test_decide() -> None:
    a = Agreement(4, 2, 7)
    assert decide(_headers(2, a), a).kind == "ok"
    v = decide(_headers(2, a, sized=False), None)
    assert (v.kind, v.agreement) == ("retry", a)
    h = _headers(3, a)
    h[:, H_BATCH] = 6
    assert decide(h, a).agreement == Agreement(6, 2, 7)  # every rank moved together
    h = _headers(3, a)
    h[1, H_BATCH] = 6
    assert decide(h, a).problems == ("layout",)
    h = _headers(2, a)
    h[1, H_STATUS] = Status.NEGATIVE
    h[0, H_CONFIG] = 5
    h[1, H_SEQ] = 3
    assert decide(h, a).problems == ("seq", "status", "config")
    h = _headers(2, a)
    h[:, H_PREV_SEQ] = 4
    h[1, H_PREV_DIGEST] = 99
    assert decide(h, a).problems == ("plan",)
    h = _headers(2, a)
    h[0, H_MAGIC] = 3
    v = decide(h, a)
    assert v.problems == ("magic",) and not v.exchange


def _report(r: int, **changes: str) -> Report:
    layout = {"batch_size": "8", "dense dtype": "torch.float32"}
    config = {"comm": "all2all", "locality": "True"}
    for k, v in changes.items():
        (layout if k in layout else config)[k.replace("_", " ") if k == "dense_dtype" else k] = v
    return Report(r, 0, "", layout, config)


def test_failure_texts_name_field_values_and_ranks() -> None:
    a = Agreement(8, 1, 1)
    h = _headers(3, a)
    text, odd = describe_failure(decide_with(h, "config"), h,
                                 [_report(0), _report(1, comm="allgather"), _report(2)])
    assert odd == [1]
    assert "'comm': ranks [0, 2]: 'all2all'; rank 1: 'allgather'" in text
    h[2, H_LAYOUT] = 2
    reports = [_report(0), _report(1), Report(2, 0, "", {"batch_size": "8", "dense dtype": "torch.float64"}, {})]
    text, odd = describe_failure(decide(h, a), h, reports)
    assert odd == [2] and "'dense dtype': ranks [0, 1]: 'torch.float32'; rank 2: 'torch.float64'" in text
    h = _headers(2, a)
    h[1, H_SEQ] = 1
    text, odd = describe_failure(decide(h, a), h, [_report(0), _report(1)])
    assert odd == [1] and "rank 0: '#0'; rank 1: '#1'" in text  # ties: rank 0's value is the reference
    h = _headers(2, a)
    h[0, H_MAGIC] = 1
    text, odd = describe_failure(decide(h, a), h, None)
    assert odd == [0] and "unrecognised shuffle header" in text


def decide_with(h: np.ndarray, problem: str) -> object:
    from balancer._agreement import Verdict

    return Verdict("error", problems=(problem,))


def test_capture_and_message_round_trip() -> None:
    batch = make_batch(1, 6, 4, seed=3)
    meta = capture(batch, lambda b: token_count(b).double() * 1e-3, seq=5, rank=1, config=9, base_type=BaseBatch)
    assert meta.status == 0 and meta.error == ""
    a = meta.agreement()
    msg, data = message(meta, a, (4, 123, -1))
    assert msg.size == HEADER_LEN + payload_words(a)
    assert (msg[H_SEQ], msg[H_PREV_SEQ], msg[H_PREV_DIGEST], msg[H_CONFIG]) == (5, 4, 123, 9)
    assert data is not None
    want = token_count(batch).double().numpy() * 1e-3
    want[4:] = 0  # padding
    assert data.workloads.tolist() == want.tolist()
    assert msg[HEADER_LEN : HEADER_LEN + 6].view(np.float64).tolist() == want.tolist()
    # Under another agreement the payload is zero and sized from that agreement.
    other = Agreement(9, 3, 0)
    msg, _ = message(meta, other, NO_PREV)
    assert msg.size == HEADER_LEN + payload_words(other) and not msg[HEADER_LEN:].any()


def test_bad_input_becomes_a_status_not_an_exception() -> None:
    batch = make_batch(0, 6, 5, seed=3)
    cases = {
        "negative": (lambda b: -token_count(b) - 1, Status.NEGATIVE, "workloads[0] = -"),
        "nan": (lambda b: torch.full((6,), float("nan")), Status.NONFINITE, "workloads[0] = nan"),
        "raise": (lambda b: {}["x"], Status.BAD_INPUT, "workload_fn raised KeyError"),
        "shape": (lambda b: token_count(b)[:3], Status.BAD_INPUT, "workloads has shape (3,)"),
        # these two raised in capture itself, on this rank only (its peers waited for phase 1)
        "sparse": (lambda b: token_count(b).double().to_sparse(), Status.BAD_INPUT, "workloads is a torch.sparse_coo"),
        "meta": (lambda b: torch.ones(6, device="meta"), Status.BAD_INPUT, "tensor on meta, expected a dense"),
    }
    for name, (fn, status, text) in cases.items():
        meta = capture(batch, fn, seq=0, rank=2, config=0, base_type=BaseBatch)
        msg, data = message(meta, meta.agreement(), NO_PREV)
        assert msg[H_STATUS] & status and data is None, name
        assert text in meta.error and "(rank 2)" in meta.error, (name, meta.error)
    # NaN in a padding sample is not an error (padding is never read).
    meta = capture(batch, lambda b: torch.tensor([1.0] * 5 + [float("nan")]), seq=0, rank=0, config=0,
                   base_type=BaseBatch)
    assert message(meta, meta.agreement(), NO_PREV)[0][H_STATUS] == 0
    # Values that do not match their lengths are caught where the lengths are on the host.
    broken = make_batch(0, 6, 5, seed=3)
    object.__setattr__(broken.extra, "_values", broken.extra.values()[:-1])
    meta = capture(broken, token_count, seq=0, rank=0, config=0, base_type=BaseBatch)
    msg, _ = message(meta, meta.agreement(), NO_PREV)
    assert msg[H_STATUS] & Status.BAD_LENGTHS and "extra.values has" in meta.error
    assert "expected sum(lengths) = " in meta.error, meta.error  # (no '* 1' for one element per value)
    # A negative length is named by field, key and sample (was 'a KJT length is negative').
    negative = make_batch(0, 6, 5, seed=3)
    lengths = negative.extra.lengths().clone()
    lengths[2] = -4
    object.__setattr__(negative.extra, "_lengths", lengths)
    meta = capture(negative, token_count, seq=0, rank=1, config=0, base_type=BaseBatch)
    msg, _ = message(meta, meta.agreement(), NO_PREV)
    assert msg[H_STATUS] & Status.BAD_LENGTHS
    assert "extra.lengths of key 'e', sample 2 = -4, expected 0 <= length < 2**31 (rank 1)" in meta.error, meta.error
    meta = capture(object(), token_count, seq=0, rank=3, config=0, base_type=BaseBatch)
    assert meta.status == Status.BAD_INPUT and "batch is a object, expected a BaseBatch (rank 3)" in meta.error
