"""Test-side name for :mod:`balancer.testing` (the forked gloo harness)."""

from balancer.testing import WorkerError, free_port, run_workers, run_workers_outcomes

__all__ = ["WorkerError", "free_port", "run_workers", "run_workers_outcomes"]
