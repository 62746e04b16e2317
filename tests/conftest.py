"""Shared fixtures: one real local Ray cluster per test session, storage in a temp dir.

Tiers (cheapest first): pure torch (no Ray) → the shared cluster → subprocesses that start
clusters of their own (CLI, `ray start --head` + `ray job submit`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def relay_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("relay-home")
    os.environ["RELAY_HOME"] = str(home)
    return home


@pytest.fixture(scope="module")
def ray_cluster(relay_home):
    """A 4-logical-CPU local cluster (2 per DDP worker pair leaves room for Ray's own actors),
    started once and shared; restarted only after a test that needed a cluster of its own
    (test_multinode.py's simulated nodes) shut it down."""
    import ray

    from relay import cluster

    os.environ["RAY_ADDRESS"] = "local"  # never join a `ray start` cluster another test runs
    cluster.connect(num_cpus=4)
    yield ray


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_exit():
    yield
    import ray

    ray.shutdown()
