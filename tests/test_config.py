"""BalancerConfig: defaults, immutability and validation messages."""

from __future__ import annotations

import dataclasses

import pytest

from balancer.config import BalancerConfig


def test_defaults_are_plain_torchrec() -> None:
    c = BalancerConfig()
    assert c.enable_balanced_shuffler is False
    assert (c.comm, c.partition, c.locality, c.log_interval, c.pipeline) == (
        "all2all",
        "balanced",
        True,
        0,
        "sparse_dist",
    )


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        BalancerConfig().comm = "allgather"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("enable_balanced_shuffler", 1),
        ("comm", "nccl"),
        ("partition", "greedy"),
        ("locality", "yes"),
        ("log_interval", -1),
        ("log_interval", True),
        ("log_interval", 1.5),
        ("pipeline", "semi_sync"),
        ("shuffle_timeout_s", 0),
        ("shuffle_timeout_s", float("nan")),
        ("shuffle_timeout_s", 1e14),  # an OverflowError (timedelta) at the first shuffle once
        ("capacity", 0),
        ("capacity", 2.5),
    ],
)
def test_invalid_value_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{field}={value!r}"):
        BalancerConfig(**{field: value})  # type: ignore[arg-type]


def test_valid_choices() -> None:
    for comm in ("all2all", "allgather"):
        for partition in ("balanced", "karmarkar_karp"):
            for pipeline in ("sparse_dist", "prefetch"):
                c = BalancerConfig(True, comm, partition, False, 10, pipeline)
                assert c.comm == comm and c.partition == partition and c.pipeline == pipeline


def test_capacity_needs_the_balanced_partition() -> None:
    assert BalancerConfig(capacity=48).capacity == 48
    with pytest.raises(ValueError, match=r"capacity=48 needs partition='balanced', got 'karmarkar_karp'"):
        BalancerConfig(capacity=48, partition="karmarkar_karp")


def test_process_executor_needs_the_balanced_partition() -> None:
    # Accepted here once, and refused only by create_train_pipeline's BatchShuffler.
    with pytest.raises(ValueError, match=r"executor='process' runs balanced_partition in a child process; "
                                         r"partition='karmarkar_karp' needs executor='thread' or 'auto'"):
        BalancerConfig(partition="karmarkar_karp", executor="process")
    assert BalancerConfig(partition="karmarkar_karp", executor="auto").executor == "auto"
