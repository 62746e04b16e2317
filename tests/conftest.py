"""Shared fixtures: one real local Ray cluster per test session, storage in a temp dir.

Tiers (cheapest first): pure torch (no Ray) → the shared cluster (marked `cluster`, by the
fixture it uses) → `slow`: several Train runs, or clusters of their own (CLI subprocesses,
simulated nodes, `ray start --head` + `ray job submit`). `make test-fast` runs the first two.
The tiers are enforced, not trusted: a test outside `slow` whose body starts a Ray cluster of
its own fails, saying to mark it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


def _ray_sessions() -> set[str]:
    # Where Ray puts a new cluster's session (its default temp dir, as Ray derives it).
    root = Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray"
    return {p.name for p in root.glob("session_2*")} if root.is_dir() else set()


def _started_here(session: str) -> bool:
    """Whether the Ray session was started by this pytest process or a process it started (or
    by one already gone, which on CI's machine can only be ours): its name ends in the pid of
    the process that started it."""
    pid = int(session.rsplit("_", 1)[1])
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid
    return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Around a test's body (its fixtures are already set up): a test outside the slow tier
    may use the shared cluster, never start one of its own."""
    if item.get_closest_marker("slow"):
        return (yield)
    before = _ray_sessions()
    outcome = yield
    started = sorted(s for s in _ray_sessions() - before if _started_here(s))
    if started:
        pytest.fail(
            f"{item.nodeid} started a Ray cluster of its own ({', '.join(started)}): "
            "mark it @pytest.mark.slow (or use the shared `ray_cluster` fixture)",
            pytrace=False,
        )
    return outcome


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

    from relay.runtime import cluster

    os.environ["RAY_ADDRESS"] = "local"  # never join a `ray start` cluster another test runs
    # Without Ray's dashboard, as in the clusters relay starts: tests read actors from the GCS
    # (relay.runtime.ray_private), not through Ray's state API, which the dashboard serves.
    cluster.connect(num_cpus=4)
    yield ray


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_exit():
    yield
    import ray

    ray.shutdown()
