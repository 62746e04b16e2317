"""Getting onto a Ray cluster: the one the caller already joined, the one `RAY_ADDRESS` (or
`ray job submit`) names, or else an embedded local cluster started in this process
(`RAY_ADDRESS=local` insists on that even when a `ray start` cluster runs on this machine)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import ray

from relay import background

# Ray Train's controller polls workers this often and each `ray.train.report` waits for the poll;
# at Ray's default (2 s) short epochs would spend most of their time waiting. The driver's value
# is propagated to the controller by Ray Train itself.
REPORT_POLL_INTERVAL_S = "0.1"


def _local_runtime_env() -> dict:
    # Workers of an embedded cluster import user tasks ("module:Class") from where the user is,
    # as the driver does. On a remote cluster `ray job submit --working-dir` plays this role.
    paths = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}


def connect(
    *, verbose: bool = False, num_cpus: int | None = None, direct_ingress: bool = False
) -> None:
    """Join or start a cluster; quiet unless `verbose` (worker logs stay in Ray's log files).

    `direct_ingress`: Serve's ingress replicas also serve HTTP themselves, on ports 30000+
    (serve/app.py says when that pays). Serve reads the flag from its processes' environment,
    which they inherit from the cluster, so it only takes effect on a cluster started here.
    """
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", REPORT_POLL_INTERVAL_S)
    if direct_ingress:
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    if ray.is_initialized():
        return
    options: dict = {
        "log_to_driver": verbose,
        "logging_level": logging.INFO if verbose else logging.ERROR,
    }
    if os.environ.get("RAY_ADDRESS", "local") == "local":
        options["runtime_env"] = _local_runtime_env()
        options["num_cpus"] = num_cpus
    ray.init(**options)


def _placement_groups() -> list:
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table = state._global_state_accessor.get_placement_group_table()
    return [gcs_pb2.PlacementGroupTableData.FromString(raw) for raw in table]


def _made_by_actor(pg) -> bool:
    # A group made by a driver records the nil actor id (all 0xff bytes) and reads as "dead".
    return pg.creator_actor_id != b"\xff" * len(pg.creator_actor_id) and not pg.is_detached


def release_orphaned_placement_groups() -> int:
    """Remove placement groups whose creating actor is dead; returns how many.

    A Train run's worker group lives in a placement group its controller actor creates. Ray
    keeps such a group until its creator actor *and* its job are gone, so when Tune stops a
    trial by killing it mid-run, the group outlives the controller for as long as the sweep's
    job runs. Ray Train's own PlacementGroupCleaner is meant to remove it but polls the state
    API and, on a loaded machine, sometimes never does — the group's CPUs then stay reserved
    and later trials (or later runs) wait forever. A group whose creator is dead has no owner
    left, so removing it takes nothing from anyone.
    """
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    released = 0
    for pg in _placement_groups():
        live = pg.state in (pg.PENDING, pg.PREPARED, pg.CREATED, pg.RESCHEDULING)
        if live and pg.creator_actor_dead and _made_by_actor(pg):
            remove_placement_group(PlacementGroup(PlacementGroupID(pg.placement_group_id)))
            released += 1
    return released


@contextmanager
def reclaiming_orphans(interval_s: float = 2.0, settle_s: float = 10.0) -> Iterator[None]:
    """Release orphaned placement groups every `interval_s` while the block runs, and at its
    end until no group created by an actor remains (at most `settle_s`)."""
    try:
        with background.every(interval_s, release_orphaned_placement_groups, "relay-pg-reclaim"):
            yield
    finally:
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            release_orphaned_placement_groups()
            if not any(_made_by_actor(pg) and pg.state == pg.CREATED for pg in _placement_groups()):
                break
            time.sleep(0.5)
