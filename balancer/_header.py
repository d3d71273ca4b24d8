"""The phase-1 header's layout, shared by the protocol (torch side) and the planner (numpy only)."""

MAGIC = 0x62616C616E6305  # "balanc" + protocol version 5
HEADER_LEN = 19
(H_MAGIC, H_STATUS, H_DETAIL, H_SEQ, H_BATCH, H_KEYS, H_LAYOUT, H_CONFIG, H_REAL, H_PREV_SEQ,
 H_PREV_DIGEST, H_PAY_B, H_PAY_K, H_VALUE, H_PAD_LEN, H_MEAS_SEQ, H_MEAS_TIME, H_PREV_GROUP,
 H_DONE) = range(19)

__all__ = [
    "HEADER_LEN", "H_BATCH", "H_CONFIG", "H_DETAIL", "H_DONE", "H_KEYS", "H_LAYOUT", "H_MAGIC", "H_MEAS_SEQ", "H_MEAS_TIME",
    "H_PAD_LEN", "H_PAY_B", "H_PAY_K", "H_PREV_DIGEST", "H_PREV_GROUP", "H_PREV_SEQ", "H_REAL", "H_SEQ", "H_STATUS",
    "H_VALUE", "MAGIC",
]
